//! A small reference model of PyTorch's caching-allocator rules, written here from its
//! definition, run side by side with the allocator on random workloads (two streams; plain,
//! `roundup_power2_divisions`, `max_split_size`) and compared block by block after every
//! operation: every segment's blocks (offset, size, state), the current statistics, and the
//! inactive-split running totals (PyTorch counts the net change of each operation).
//!
//! Tie-break: among free blocks of equal size the allocator takes the oldest segment's, then
//! the lowest address in it (see the crate documentation); the model does the same.

use fsdp_allocator::{AllocatorConfig, BlockState, MetaAllocator, MetaBlock, MetaSource};
use fsdp_device::Stream;
use proptest::prelude::*;

#[path = "common/miri.rs"]
mod miri;
use miri::{ops_len, proptest_config};

const MIB: usize = 1 << 20;

#[derive(Clone, Debug)]
enum Op {
    Alloc { stream: usize, size: usize },
    Free { index: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 1..(MIB + 1)).prop_map(|(stream, size)| Op::Alloc { stream, size }),
        3 => (0..2usize, (MIB + 1)..(30 * MIB)).prop_map(|(stream, size)| Op::Alloc { stream, size }),
        5 => any::<usize>().prop_map(|index| Op::Free { index }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MBlock {
    size: usize,
    allocated: bool,
}

#[derive(Debug)]
struct MSegment {
    stream: usize,
    small: bool,
    blocks: Vec<MBlock>,
}

/// The model: segments in creation order, each a list of blocks in address order.
struct Model {
    segments: Vec<MSegment>,
    divisions: usize,
    max_split: Option<usize>,
    /// Live blocks: (segment, offset).
    live: Vec<(usize, usize)>,
    /// Inactive-split running totals: (count allocated, count freed, bytes allocated, freed).
    totals: [u64; 4],
}

/// PyTorch's `test_cuda` reference of `roundup_power2_divisions`.
fn power2_div(size: usize, div: usize) -> usize {
    let mut pow2 = 1;
    while pow2 < size {
        pow2 *= 2;
    }
    if pow2 == size {
        return pow2;
    }
    let step = pow2 / 2 / div;
    let mut ret = pow2 / 2;
    while ret < size {
        ret += step;
    }
    ret
}

impl Model {
    fn round(&self, size: usize) -> usize {
        if self.divisions > 1 && size > 512 * self.divisions {
            power2_div(size, self.divisions)
        } else {
            size.max(1).div_ceil(512) * 512
        }
    }

    fn inactive_split(&self) -> (u64, u64) {
        let mut n = 0;
        let mut bytes = 0;
        for s in &self.segments {
            if s.blocks.len() > 1 {
                for b in s.blocks.iter().filter(|b| !b.allocated) {
                    n += 1;
                    bytes += b.size as u64;
                }
            }
        }
        (n, bytes)
    }

    fn account(&mut self, before: (u64, u64)) {
        let after = self.inactive_split();
        let d = |a: u64, b: u64| (a.saturating_sub(b), b.saturating_sub(a));
        let (up, down) = d(after.0, before.0);
        let (bup, bdown) = d(after.1, before.1);
        self.totals[0] += up;
        self.totals[1] += down;
        self.totals[2] += bup;
        self.totals[3] += bdown;
    }

    fn alloc(&mut self, stream: usize, size: usize) {
        let before = self.inactive_split();
        let rounded = self.round(size);
        let small = rounded <= MIB;
        // Best fit: smallest free block of this stream and pool; then oldest segment, lowest
        // offset.
        let mut best: Option<(usize, usize, usize, usize)> = None; // (size, seg, idx, offset)
        for (si, s) in self.segments.iter().enumerate() {
            if s.stream != stream || s.small != small {
                continue;
            }
            let mut off = 0;
            for (bi, b) in s.blocks.iter().enumerate() {
                let fits = !b.allocated && b.size >= rounded;
                let oversize_ok = match self.max_split {
                    Some(m) if fits => {
                        !((b.size >= m && rounded < m)
                            || (rounded >= m && b.size - rounded >= 20 * MIB))
                    }
                    _ => true,
                };
                if fits && best.is_none_or(|x| b.size < x.0) {
                    if oversize_ok {
                        best = Some((b.size, si, bi, off));
                    } else {
                        // The smallest fit is refused: no cached block serves the request.
                        best = Some((b.size, usize::MAX, 0, 0));
                    }
                }
                off += b.size;
            }
        }
        let (si, bi, off) = match best {
            Some((_, si, bi, off)) if si != usize::MAX => (si, bi, off),
            _ => {
                let seg = if small {
                    2 * MIB
                } else if rounded < 10 * MIB {
                    20 * MIB
                } else {
                    rounded.div_ceil(2 * MIB) * 2 * MIB
                };
                self.segments.push(MSegment {
                    stream,
                    small,
                    blocks: vec![MBlock {
                        size: seg,
                        allocated: false,
                    }],
                });
                (self.segments.len() - 1, 0, 0)
            }
        };
        let block = self.segments[si].blocks[bi];
        let remaining = block.size - rounded;
        let split = if small {
            remaining >= 512
        } else {
            self.max_split.is_none_or(|m| rounded < m) && remaining > MIB
        };
        let blocks = &mut self.segments[si].blocks;
        if split {
            blocks[bi] = MBlock {
                size: rounded,
                allocated: true,
            };
            blocks.insert(
                bi + 1,
                MBlock {
                    size: remaining,
                    allocated: false,
                },
            );
        } else {
            blocks[bi].allocated = true;
        }
        self.live.push((si, off));
        self.account(before);
    }

    fn free(&mut self, index: usize) {
        let before = self.inactive_split();
        let (si, off) = self.live.remove(index);
        let blocks = &mut self.segments[si].blocks;
        let mut pos = 0;
        let mut bi = 0;
        while pos < off {
            pos += blocks[bi].size;
            bi += 1;
        }
        blocks[bi].allocated = false;
        if bi + 1 < blocks.len() && !blocks[bi + 1].allocated {
            blocks[bi].size += blocks.remove(bi + 1).size;
        }
        if bi > 0 && !blocks[bi - 1].allocated {
            let b = blocks.remove(bi);
            blocks[bi - 1].size += b.size;
        }
        self.account(before);
    }
}

fn compare(alloc: &MetaAllocator, model: &Model, streams: &[Stream]) -> Result<(), TestCaseError> {
    let snap = alloc.snapshot();
    // Segments in creation order: the meta source's addresses only grow.
    let mut got = snap.segments.clone();
    got.sort_by_key(|s| s.address);
    let live: Vec<&MSegment> = model.segments.iter().collect();
    prop_assert_eq!(got.len(), live.len(), "segment count");
    for (g, m) in got.iter().zip(&live) {
        let key = |s: &Stream| s.id().as_u64();
        prop_assert_eq!(g.stream, key(&streams[m.stream]));
        let gb: Vec<(u64, bool)> = g
            .blocks
            .iter()
            .map(|b| (b.size, b.state == BlockState::ActiveAllocated))
            .collect();
        let mb: Vec<(u64, bool)> = m
            .blocks
            .iter()
            .map(|b| (b.size as u64, b.allocated))
            .collect();
        prop_assert_eq!(gb, mb);
    }
    let st = alloc.memory_stats();
    let reserved: u64 = model
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .map(|b| b.size as u64)
        .sum();
    let allocated: u64 = model
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.allocated)
        .map(|b| b.size as u64)
        .sum();
    prop_assert_eq!(st.reserved_bytes.all.current, reserved);
    prop_assert_eq!(st.allocated_bytes.all.current, allocated);
    prop_assert_eq!(st.allocation.all.current, model.live.len() as u64);
    let (n, bytes) = model.inactive_split();
    prop_assert_eq!(
        (
            st.inactive_split.all.current,
            st.inactive_split_bytes.all.current
        ),
        (n, bytes)
    );
    let t = model.totals;
    prop_assert_eq!(
        [
            st.inactive_split.all.allocated,
            st.inactive_split.all.freed,
            st.inactive_split_bytes.all.allocated,
            st.inactive_split_bytes.all.freed
        ],
        t
    );
    Ok(())
}

fn run(ops: &[Op], divisions: usize, max_split: Option<usize>) -> Result<(), TestCaseError> {
    let mut cfg = AllocatorConfig::default().with_roundup_power2_divisions(divisions);
    if let Some(m) = max_split {
        cfg = cfg.with_max_split_size(m);
    }
    let alloc = MetaAllocator::new(MetaSource::new(1 << 40), cfg).unwrap();
    let streams = [Stream::inline("a"), Stream::inline("b")];
    let mut model = Model {
        segments: Vec::new(),
        divisions,
        max_split,
        live: Vec::new(),
        totals: [0; 4],
    };
    let mut live: Vec<MetaBlock> = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc { stream, size } => {
                live.push(alloc.allocate(size, &streams[stream]).unwrap());
                model.alloc(stream, size);
            }
            Op::Free { index } => {
                if live.is_empty() {
                    continue;
                }
                let i = index % live.len();
                drop(live.remove(i));
                model.free(i);
            }
        }
        compare(&alloc, &model, &streams)?;
    }
    Ok(())
}

/// Operations per run: 400, or a few under Miri, which interprets every step.
const OPS: usize = ops_len(400);

proptest! {
    #![proptest_config(ProptestConfig {
        max_shrink_iters: 100,
        ..proptest_config(12)
    })]

    #[test]
    fn allocator_matches_the_reference_model(ops in prop::collection::vec(op(), OPS)) {
        run(&ops, 0, None)?;
    }

    #[test]
    fn with_roundup_power2_divisions(ops in prop::collection::vec(op(), OPS)) {
        run(&ops, 4, None)?;
    }

    #[test]
    fn with_max_split_size(ops in prop::collection::vec(op(), OPS)) {
        run(&ops, 0, Some(24 * MIB))?;
    }
}
