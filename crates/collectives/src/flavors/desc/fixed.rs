//! The fixed-size encoding of a call description ([`FIXED_BYTES`] bytes), for backends that
//! all-gather descriptions as one block (`nccl`, `mpi`): an unequal all-gather's sizes become a
//! fingerprint and the reason of an invalid call is truncated to fit.
// Only the nccl and mpi features use it; its tests always run.
#![cfg_attr(not(any(feature = "nccl", feature = "mpi")), allow(dead_code))]

use super::{dtype_code, dtype_from_code, reduce_code, reduce_from_code, OpDesc, Sizes, OPS};

/// Bytes of the fixed-size encoding.
pub(crate) const FIXED_BYTES: usize = FIXED_WORDS * 8;
const FIXED_WORDS: usize = 24;
const FIXED_MAGIC: u64 = 0x6673_6470_6465_7302; // "fsdpdes", version 2
/// Words 12.. hold the reason of an invalid call.
const REASON_AT: usize = 12 * 8;
pub(super) const REASON_BYTES: usize = FIXED_BYTES - REASON_AT;
const NONE: u64 = u64::MAX;

fn op_code(op: &str) -> u64 {
    OPS.iter()
        .position(|&o| o == op)
        .map_or(0, |i| i as u64 + 1)
}

fn op_from_code(c: u64) -> Result<&'static str, String> {
    (c as usize)
        .checked_sub(1)
        .and_then(|i| OPS.get(i).copied())
        .ok_or_else(|| format!("unknown operation code {c}"))
}

impl OpDesc {
    /// The fixed-size encoding ([`FIXED_BYTES`] bytes).
    pub fn encode_fixed(&self) -> [u8; FIXED_BYTES] {
        let mut w = [0u64; FIXED_WORDS];
        w[0] = FIXED_MAGIC;
        w[1] = self.seq;
        w[2] = op_code(self.op);
        w[3] = u64::from(dtype_code(self.dtype));
        w[4] = self.count as u64;
        w[5] = u64::from(reduce_code(self.reduce));
        w[6] = self.root.map_or(NONE, |r| r as u64);
        w[7] = self.sizes.as_ref().map_or(NONE, Sizes::fingerprint);
        w[8] = u64::from(self.sizes.is_some());
        let (color, key) = self.split.unwrap_or((None, 0));
        w[9] = match (self.split, color) {
            (None, _) => NONE,
            (Some(_), None) => NONE - 1,
            (Some(_), Some(c)) => u64::from(c),
        };
        w[10] = key as u64;
        let mut out = [0u8; FIXED_BYTES];
        for (i, word) in w.iter().enumerate() {
            out[i * 8..(i + 1) * 8].copy_from_slice(&word.to_le_bytes());
        }
        if let Some(why) = &self.invalid {
            // Truncate at a character boundary; the length word (+1) marks the call invalid.
            let mut end = why.len().min(REASON_BYTES);
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            out[88..96].copy_from_slice(&(end as u64 + 1).to_le_bytes());
            out[REASON_AT..REASON_AT + end].copy_from_slice(&why.as_bytes()[..end]);
        }
        out
    }

    /// Parse [`encode_fixed`](OpDesc::encode_fixed)'s bytes; `Err` describes bytes that are not
    /// a description.
    pub fn decode_fixed(b: &[u8]) -> Result<OpDesc, String> {
        if b.len() < FIXED_BYTES {
            return Err(format!("{} bytes, expected {FIXED_BYTES}", b.len()));
        }
        let word = |i: usize| u64::from_le_bytes(b[i * 8..(i + 1) * 8].try_into().expect("8"));
        if word(0) != FIXED_MAGIC {
            return Err(format!(
                "descriptor with magic {:#x} (another program or version?)",
                word(0)
            ));
        }
        let mut d = OpDesc::new(op_from_code(word(2))?);
        d.seq = word(1);
        d.dtype = dtype_from_code(word(3))?;
        d.count = word(4) as usize;
        d.reduce = reduce_from_code(word(5))?;
        d.root = (word(6) != NONE).then_some(word(6) as usize);
        d.sizes = (word(8) != 0).then_some(Sizes::Fingerprint(word(7)));
        d.split = match word(9) {
            NONE => None,
            c if c == NONE - 1 => Some((None, word(10) as usize)),
            c => Some((Some(c as u32), word(10) as usize)),
        };
        d.invalid = match word(11) {
            0 => None,
            n => {
                let n = ((n - 1) as usize).min(REASON_BYTES);
                Some(String::from_utf8_lossy(&b[REASON_AT..REASON_AT + n]).into_owned())
            }
        };
        Ok(d)
    }
}

/// Decode the fixed-size descriptions of every rank (`raw[r]` is rank r's); `Err` names the
/// rank whose bytes are not a description.
pub(crate) fn decode_all_fixed(raw: &[&[u8]]) -> Result<Vec<OpDesc>, String> {
    raw.iter()
        .enumerate()
        .map(|(r, b)| {
            OpDesc::decode_fixed(b)
                .map_err(|why| format!("rank {r} sent an unreadable call description: {why}"))
        })
        .collect()
}
