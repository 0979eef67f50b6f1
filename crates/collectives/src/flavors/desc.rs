//! The description of one rank's collective call, shared by every backend that compares calls
//! across ranks before data moves (the ring engine over any transport, `nccl`, `mpi`): the
//! struct, its two encodings, the comparison that names the ranks and what differed, and the
//! codes of element types, reduce ops and operations.
//!
//! - [`OpDesc::encode`] / [`OpDesc::decode`]: variable length, with the full list of an unequal
//!   all-gather's sizes (the ring engine's transports).
//! - [`OpDesc::encode_fixed`] / [`OpDesc::decode_fixed`]: [`FIXED_BYTES`] bytes, for backends
//!   that all-gather descriptions as one fixed-size block (`nccl`, `mpi`); an unequal
//!   all-gather's sizes become a fingerprint and the reason of an invalid call is truncated.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use fsdp_device::DType;

use super::tcp::wire::{Reader, Writer};
use crate::{CollectiveError, ReduceOp};

mod fixed;
#[cfg_attr(not(any(feature = "nccl", feature = "mpi")), allow(unused_imports))]
pub(crate) use self::fixed::{decode_all_fixed, FIXED_BYTES};

/// Operations a description may name; the code of an operation is its index plus one.
pub(crate) const OPS: [&str; 8] = [
    "all_gather_base",
    "reduce_scatter_base",
    "all_reduce",
    "broadcast",
    "reduce",
    "barrier",
    "all_gather",
    "split",
];

/// Code of an element type: 0 for none, else 1 + its index in [`DType::ALL`].
pub(crate) fn dtype_code(d: Option<DType>) -> u8 {
    d.map_or(0, |d| {
        1 + DType::ALL.iter().position(|&x| x == d).expect("in ALL") as u8
    })
}

/// The element type of a [`dtype_code`]; `Err` names an unknown code.
pub(crate) fn dtype_from_code(c: u64) -> Result<Option<DType>, String> {
    match c {
        0 => Ok(None),
        c => DType::ALL
            .get(c as usize - 1)
            .map(|&d| Some(d))
            .ok_or_else(|| format!("unknown element type code {c}")),
    }
}

/// Code of a reduce op: 0 for none, else 1 + its index in [`ReduceOp::ALL`].
pub(crate) fn reduce_code(op: Option<ReduceOp>) -> u8 {
    op.map_or(0, |op| {
        1 + ReduceOp::ALL.iter().position(|&x| x == op).expect("in ALL") as u8
    })
}

/// The reduce op of a [`reduce_code`]; `Err` names an unknown code.
pub(crate) fn reduce_from_code(c: u64) -> Result<Option<ReduceOp>, String> {
    match c {
        0 => Ok(None),
        c => ReduceOp::ALL
            .get(c as usize - 1)
            .map(|&o| Some(o))
            .ok_or_else(|| format!("unknown reduce op code {c}")),
    }
}

/// FNV-1a over the sizes (as little-endian u64s): a fingerprint of an unequal all-gather's
/// output layout.
pub(crate) fn sizes_fingerprint(sizes: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &s in sizes {
        for b in (s as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The output sizes of an unequal all-gather, as a rank described them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Sizes {
    /// Every size (variable-length encoding).
    List(Vec<usize>),
    /// Their [`sizes_fingerprint`] (fixed-size encoding).
    Fingerprint(u64),
}

impl Sizes {
    /// Whether these are the sizes `lens`.
    fn are(&self, lens: &[usize]) -> bool {
        match self {
            Sizes::List(l) => l == lens,
            Sizes::Fingerprint(f) => *f == sizes_fingerprint(lens),
        }
    }

    fn fingerprint(&self) -> u64 {
        match self {
            Sizes::List(l) => sizes_fingerprint(l),
            Sizes::Fingerprint(f) => *f,
        }
    }
}

impl fmt::Display for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sizes::List(l) => write!(f, "sizes={l:?}"),
            Sizes::Fingerprint(h) => write!(f, "output sizes #{h:016x}"),
        }
    }
}

/// What one rank issued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OpDesc {
    /// One of [`OPS`].
    pub op: &'static str,
    /// The collective's sequence number in its group.
    pub seq: u64,
    pub dtype: Option<DType>,
    /// Elements per rank (the collective's natural unit); for an unequal all-gather, this rank's
    /// input length (which differs across ranks by design: `sizes` is compared instead).
    pub count: usize,
    pub reduce: Option<ReduceOp>,
    pub root: Option<usize>,
    /// Per-rank output sizes of an unequal all-gather.
    pub sizes: Option<Sizes>,
    /// Why this rank's call was invalid, if it was.
    pub invalid: Option<String>,
    /// Per-rank split arguments (color, key): not compared across ranks.
    pub split: Option<(Option<u32>, usize)>,
}

impl OpDesc {
    pub fn new(op: &'static str) -> OpDesc {
        OpDesc {
            op,
            seq: 0,
            dtype: None,
            count: 0,
            reduce: None,
            root: None,
            sizes: None,
            invalid: None,
            split: None,
        }
    }

    /// Everything that must agree across ranks, as text.
    pub fn signature(&self) -> String {
        let mut parts = Vec::new();
        if let Some(d) = self.dtype {
            parts.push(format!("dtype={d}"));
        }
        if self.sizes.is_none() && self.op != "barrier" && self.op != "split" {
            parts.push(format!("count={}", self.count));
        }
        if let Some(op) = self.reduce {
            parts.push(format!("op={op}"));
        }
        if let Some(root) = self.root {
            parts.push(format!("root={root}"));
        }
        if let Some(sizes) = &self.sizes {
            parts.push(sizes.to_string());
        }
        format!("{}({})", self.op, parts.join(", "))
    }

    /// The variable-length encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.str(self.op);
        w.u64(self.seq);
        w.u8(dtype_code(self.dtype));
        w.u64(self.count as u64);
        w.u8(reduce_code(self.reduce));
        w.opt_u64(self.root.map(|r| r as u64));
        match &self.sizes {
            None => w.u8(0),
            Some(Sizes::List(s)) => {
                w.u8(1);
                w.u64(s.len() as u64);
                for &x in s {
                    w.u64(x as u64);
                }
            }
            Some(Sizes::Fingerprint(h)) => {
                w.u8(2);
                w.u64(*h);
            }
        }
        match &self.invalid {
            None => w.u8(0),
            Some(why) => {
                w.u8(1);
                w.str(why);
            }
        }
        match self.split {
            None => w.u8(0),
            Some((color, key)) => {
                w.u8(1);
                w.opt_u64(color.map(u64::from));
                w.u64(key as u64);
            }
        }
        w.into_bytes()
    }

    /// Parse a description written by [`encode`](OpDesc::encode).
    pub fn decode(b: &[u8]) -> Result<OpDesc, String> {
        let mut r = Reader::new(b);
        let name = r.str()?;
        let op = OPS
            .iter()
            .copied()
            .find(|&o| o == name)
            .ok_or_else(|| format!("unknown operation {name:?} in a call description"))?;
        let mut d = OpDesc::new(op);
        d.seq = r.u64()?;
        d.dtype = dtype_from_code(u64::from(r.u8()?))?;
        d.count = r.usize()?;
        d.reduce = reduce_from_code(u64::from(r.u8()?))?;
        d.root = r.opt_u64()?.map(|x| x as usize);
        d.sizes = match r.u8()? {
            0 => None,
            1 => {
                let n = r.usize()?;
                if n > b.len() {
                    return Err(format!("{n} sizes in a description of {} bytes", b.len()));
                }
                Some(Sizes::List(
                    (0..n).map(|_| r.usize()).collect::<Result<_, _>>()?,
                ))
            }
            _ => Some(Sizes::Fingerprint(r.u64()?)),
        };
        if r.u8()? == 1 {
            d.invalid = Some(r.str()?);
        }
        if r.u8()? == 1 {
            let color = r.opt_u64()?.map(|c| c as u32);
            d.split = Some((color, r.usize()?));
        }
        if !r.at_end() {
            return Err(format!(
                "{} trailing bytes after a call description",
                r.remaining()
            ));
        }
        Ok(d)
    }
}

impl OpDesc {
    /// Split this rank's argument check: on failure the reason goes into the description (so
    /// that the peers fail at once instead of waiting) and the error is returned for the caller.
    pub fn take_check<A>(
        &mut self,
        rank: usize,
        check: Result<A, String>,
    ) -> (Option<A>, Option<CollectiveError>) {
        match check {
            Ok(a) => (Some(a), None),
            Err(reason) => {
                self.invalid = Some(reason.clone());
                let op = self.op;
                (
                    None,
                    Some(CollectiveError::InvalidArgument { rank, op, reason }),
                )
            }
        }
    }
}

/// After the exchange of collective `seq`: this rank's buffers that stayed busy (`busy`, why),
/// then any difference between the ranks' calls, as this crate's errors.
pub(crate) fn check_exchanged(
    rank: usize,
    seq: u64,
    descs: &[OpDesc],
    busy: Option<String>,
    waited: Duration,
) -> crate::Result<()> {
    if let Some(why) = busy {
        return Err(CollectiveError::Device {
            rank,
            source: fsdp_device::DeviceError::Timeout {
                what: format!("access to the buffers of {}: {why}", descs[rank].op),
                waited,
            },
        });
    }
    compare(descs, seq).map_err(|details| CollectiveError::Mismatch { rank, seq, details })
}

/// Compare the descriptions of all ranks of collective `seq`; `Err(details)` names the ranks and
/// what differed.
pub(crate) fn compare(descs: &[OpDesc], seq: u64) -> Result<(), String> {
    let invalid: Vec<String> = descs
        .iter()
        .enumerate()
        .filter_map(|(r, d)| {
            let why = match &d.invalid {
                Some(why) => why.clone(),
                None if d.seq != seq => {
                    format!("it is collective #{} on that rank, #{seq} here", d.seq)
                }
                None => return None,
            };
            Some(format!(
                "rank {r} issued {} with invalid arguments: {why}",
                d.op
            ))
        })
        .collect();
    if !invalid.is_empty() {
        return Err(invalid.join("; "));
    }
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (r, d) in descs.iter().enumerate() {
        groups.entry(d.signature()).or_default().push(r);
    }
    if groups.len() > 1 {
        let mut by_first: Vec<(Vec<usize>, String)> =
            groups.into_iter().map(|(s, r)| (r, s)).collect();
        by_first.sort();
        return Err(by_first
            .into_iter()
            .map(|(ranks, sig)| {
                if ranks.len() == 1 {
                    format!("rank {} issued {sig}", ranks[0])
                } else {
                    format!("ranks {ranks:?} issued {sig}")
                }
            })
            .collect::<Vec<_>>()
            .join("; "));
    }
    if let Some(sizes) = descs.first().and_then(|d| d.sizes.as_ref()) {
        // Every rank agrees on the output sizes; they must be the actual input lengths.
        let lens: Vec<usize> = descs.iter().map(|d| d.count).collect();
        if !sizes.are(&lens) {
            return Err(format!(
                "every rank issued {} with output sizes that differ from the ranks' input \
                 lengths {lens:?}",
                descs[0].op
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "desc_tests.rs"]
mod tests;
