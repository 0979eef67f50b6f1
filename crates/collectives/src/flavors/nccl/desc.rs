//! The 64-byte description of a call that the ranks all-gather before each collective when
//! [`NcclOptions::verify`](super::NcclOptions::verify) is on, and its comparison.

use std::collections::BTreeMap;

use fsdp_device::DType;

use crate::ReduceOp;

/// Bytes per rank in the descriptor exchange.
pub(crate) const DESC_BYTES: usize = 64;
const MAGIC: [u8; 4] = *b"NCD1";

/// What one rank issued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub op: &'static str,
    pub seq: u64,
    pub dtype: Option<DType>,
    /// Elements per rank (the collective's natural unit); the input length of an unequal
    /// all-gather is not compared (it differs by design), its `sizes` are.
    pub count: u64,
    pub reduce: Option<ReduceOp>,
    pub root: Option<u64>,
    /// FNV-1a hash of the per-rank sizes of an unequal all-gather.
    pub sizes: Option<u64>,
    /// This rank's arguments failed validation.
    pub invalid: bool,
}

const OPS: [&str; 8] = [
    "all_gather_base",
    "reduce_scatter_base",
    "all_reduce",
    "broadcast",
    "reduce",
    "barrier",
    "all_gather",
    "split",
];

fn dtype_code(d: Option<DType>) -> u8 {
    match d {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F64) => 2,
        Some(DType::BF16) => 3,
        Some(DType::F16) => 4,
    }
}

fn dtype_from(c: u8) -> Option<DType> {
    match c {
        1 => Some(DType::F32),
        2 => Some(DType::F64),
        3 => Some(DType::BF16),
        4 => Some(DType::F16),
        _ => None,
    }
}

fn op_code(op: Option<ReduceOp>) -> u8 {
    match op {
        None => 0,
        Some(o) => 1 + ReduceOp::ALL.iter().position(|x| *x == o).unwrap_or(254) as u8,
    }
}

fn op_from(c: u8) -> Option<ReduceOp> {
    (c as usize)
        .checked_sub(1)
        .and_then(|i| ReduceOp::ALL.get(i).copied())
}

/// FNV-1a over the sizes (as little-endian u64s).
pub(crate) fn hash_sizes(sizes: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for s in sizes {
        for b in (*s as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl Desc {
    pub fn new(op: &'static str) -> Desc {
        Desc {
            op,
            seq: 0,
            dtype: None,
            count: 0,
            reduce: None,
            root: None,
            sizes: None,
            invalid: false,
        }
    }

    pub fn encode(&self) -> [u8; DESC_BYTES] {
        let mut b = [0u8; DESC_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = OPS
            .iter()
            .position(|o| *o == self.op)
            .map_or(255, |i| i as u8);
        b[5] = dtype_code(self.dtype);
        b[6] = op_code(self.reduce);
        b[7] = u8::from(self.invalid) | (u8::from(self.root.is_some()) << 1);
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.root.unwrap_or(0).to_le_bytes());
        b[32..40].copy_from_slice(&self.sizes.unwrap_or(0).to_le_bytes());
        b[40] = u8::from(self.sizes.is_some());
        b
    }

    /// `None` if the bytes are not a descriptor (a peer running something else entirely).
    pub fn decode(b: &[u8]) -> Option<Desc> {
        if b.len() < DESC_BYTES || b[0..4] != MAGIC {
            return None;
        }
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Some(Desc {
            op: OPS.get(b[4] as usize).copied().unwrap_or("unknown"),
            seq: u64_at(8),
            dtype: dtype_from(b[5]),
            count: u64_at(16),
            reduce: op_from(b[6]),
            root: (b[7] & 2 != 0).then(|| u64_at(24)),
            sizes: (b[40] != 0).then(|| u64_at(32)),
            invalid: b[7] & 1 != 0,
        })
    }

    /// Everything that must agree across ranks, as text.
    fn signature(&self) -> String {
        let mut parts = vec![format!("collective #{}", self.seq)];
        if let Some(d) = self.dtype {
            parts.push(format!("dtype={d}"));
        }
        if self.sizes.is_none() && self.op != "barrier" && self.op != "split" {
            parts.push(format!("count={}", self.count));
        }
        if let Some(op) = self.reduce {
            parts.push(format!("op={}", op.name()));
        }
        if let Some(root) = self.root {
            parts.push(format!("root={root}"));
        }
        if let Some(h) = self.sizes {
            parts.push(format!("sizes-hash={h:#018x}"));
        }
        format!("{}({})", self.op, parts.join(", "))
    }
}

/// Compare the exchanged descriptions; `Err(details)` names the ranks and what differed.
/// `raw[r]` is rank r's 64 bytes.
pub(crate) fn compare(raw: &[&[u8]]) -> Result<(), String> {
    let mut descs = Vec::with_capacity(raw.len());
    for (r, b) in raw.iter().enumerate() {
        match Desc::decode(b) {
            Some(d) => descs.push(d),
            None => return Err(format!("rank {r} sent no valid call description")),
        }
    }
    let invalid: Vec<String> = descs
        .iter()
        .enumerate()
        .filter(|(_, d)| d.invalid)
        .map(|(r, d)| {
            format!(
                "rank {r} issued {} with invalid arguments (its own error says why)",
                d.op
            )
        })
        .collect();
    if !invalid.is_empty() {
        return Err(invalid.join("; "));
    }
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (r, d) in descs.iter().enumerate() {
        groups.entry(d.signature()).or_default().push(r);
    }
    if groups.len() == 1 {
        return Ok(());
    }
    let mut by_first: Vec<(Vec<usize>, String)> = groups.into_iter().map(|(s, r)| (r, s)).collect();
    by_first.sort();
    Err(by_first
        .into_iter()
        .map(|(ranks, sig)| {
            if ranks.len() == 1 {
                format!("rank {} issued {sig}", ranks[0])
            } else {
                format!("ranks {ranks:?} issued {sig}")
            }
        })
        .collect::<Vec<_>>()
        .join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Desc {
        let mut d = Desc::new("reduce");
        d.seq = 7;
        d.dtype = Some(DType::BF16);
        d.count = 1 << 40;
        d.reduce = Some(ReduceOp::Avg);
        d.root = Some(3);
        d
    }

    #[test]
    fn round_trip() {
        for op in OPS {
            let mut d = sample();
            d.op = op;
            assert_eq!(Desc::decode(&d.encode()), Some(d.clone()));
            d.invalid = true;
            d.root = None;
            d.sizes = Some(hash_sizes(&[1, 2, 3]));
            assert_eq!(Desc::decode(&d.encode()), Some(d));
        }
        for dt in DType::ALL {
            let mut d = sample();
            d.dtype = Some(dt);
            assert_eq!(Desc::decode(&d.encode()).unwrap().dtype, Some(dt));
        }
        for op in ReduceOp::ALL {
            let mut d = sample();
            d.reduce = Some(op);
            assert_eq!(Desc::decode(&d.encode()).unwrap().reduce, Some(op));
        }
        assert_eq!(Desc::decode(&[0u8; 64]), None);
    }

    #[test]
    fn compare_names_ranks_and_differences() {
        let a = sample().encode();
        let mut other = sample();
        other.count = 5;
        let b = other.encode();
        assert!(compare(&[&a, &a]).is_ok());
        let err = compare(&[&a, &b, &a]).unwrap_err();
        assert!(err.contains("ranks [0, 2] issued reduce("), "{err}");
        assert!(
            err.contains("rank 1 issued reduce(") && err.contains("count=5"),
            "{err}"
        );
        let mut bad = sample();
        bad.invalid = true;
        let err = compare(&[&a, &bad.encode()]).unwrap_err();
        assert!(
            err.contains("rank 1 issued reduce with invalid arguments"),
            "{err}"
        );
        let err = compare(&[&a, &[0u8; 64]]).unwrap_err();
        assert!(
            err.contains("rank 1 sent no valid call description"),
            "{err}"
        );
        assert_ne!(hash_sizes(&[1, 2]), hash_sizes(&[2, 1]));
    }
}
