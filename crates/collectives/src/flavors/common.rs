//! Pieces shared by the backends that compare calls across ranks before data moves (`ring`,
//! `tcp`): the description of one rank's call and the comparison that names the ranks and what
//! differed.

use std::collections::BTreeMap;

use fsdp_device::DType;

use crate::ReduceOp;

/// What one rank issued.
#[derive(Clone, Debug)]
pub(crate) struct OpDesc {
    pub op: &'static str,
    pub dtype: Option<DType>,
    /// Elements per rank (the collective's natural unit).
    pub count: usize,
    pub reduce: Option<ReduceOp>,
    pub root: Option<usize>,
    /// Per-rank input lengths of an unequal all-gather.
    pub sizes: Option<Vec<usize>>,
    /// Why this rank's call was invalid, if it was.
    pub invalid: Option<String>,
    /// Per-rank split arguments (color, key): not compared across ranks.
    pub split: Option<(Option<u32>, usize)>,
}

impl OpDesc {
    pub fn new(op: &'static str) -> OpDesc {
        OpDesc {
            op,
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
        let mut s = format!("{}(", self.op);
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
            parts.push(format!("sizes={sizes:?}"));
        }
        s.push_str(&parts.join(", "));
        s.push(')');
        s
    }
}

/// Compare the descriptions of all ranks; `Err(details)` names the ranks and what differed.
pub(crate) fn compare(descs: &[OpDesc]) -> Result<(), String> {
    let invalid: Vec<String> = descs
        .iter()
        .enumerate()
        .filter_map(|(r, d)| {
            d.invalid
                .as_ref()
                .map(|why| format!("rank {r} issued {} with invalid arguments: {why}", d.op))
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

/// Element offsets of the blocks (chunks) that a collective moves around the ring, and their
/// segmentation.
pub(crate) struct Chunks {
    pub starts: Vec<usize>,
    pub lens: Vec<usize>,
    /// Elements per segment.
    pub seg: usize,
    /// Segments per chunk (of the longest chunk).
    pub num_segs: usize,
}

impl Chunks {
    /// `n` chunks of `len` elements each, back to back.
    pub fn equal(n: usize, len: usize, seg: usize) -> Chunks {
        Chunks::from_lens(vec![len; n], seg)
    }

    /// `total` elements cut into `n` chunks whose lengths differ by at most one.
    pub fn balanced(n: usize, total: usize, seg: usize) -> Chunks {
        let lens = (0..n)
            .map(|c| (c + 1) * total / n - c * total / n)
            .collect();
        Chunks::from_lens(lens, seg)
    }

    /// One chunk of `total` elements.
    pub fn whole(total: usize, seg: usize) -> Chunks {
        Chunks::from_lens(vec![total], seg)
    }

    fn from_lens(lens: Vec<usize>, seg: usize) -> Chunks {
        let mut starts = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &l in &lens {
            starts.push(at);
            at += l;
        }
        let longest = lens.iter().copied().max().unwrap_or(0);
        Chunks {
            starts,
            lens,
            seg,
            num_segs: longest.div_ceil(seg),
        }
    }

    /// Start of chunk `c`.
    pub fn start(&self, c: usize) -> usize {
        self.starts[c]
    }

    /// (offset inside chunk `c`, length) of segment `g`; the length may be 0.
    pub fn seg(&self, c: usize, g: usize) -> (usize, usize) {
        let off = (g * self.seg).min(self.lens[c]);
        (off, (self.lens[c] - off).min(self.seg))
    }
}
