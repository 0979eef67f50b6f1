//! How a collective's buffer is cut into chunks (one per ring position) and segments (the unit
//! that moves in one ring step).

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
