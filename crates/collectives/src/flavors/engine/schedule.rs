//! The ring schedules, written once: for each collective, the sequence of [`Step`]s one rank
//! performs. The host algorithms ([`algo`](super::algo)) run them over a
//! [`Transport`](super::Transport) with the host reduction kernels; the CUDA ring (feature
//! `cuda`) enqueues the same steps as device copies and reduction kernels. Since both follow one
//! sequence, chunk `c` of a reduction accumulates in the same order on both (from rank `c + 1`
//! around the ring, the chunk's owner applying the final step), and their results are bitwise
//! equal.
//!
//! Segments are visited in segment-major order (for each segment: the ring steps), which
//! pipelines the steps of different segments across ranks.

use super::chunks::Chunks;

/// One step of a rank in a ring schedule. `chunk` names a block of the collective's layout
/// (see each schedule), `off` and `len` a segment of it in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send this rank's own data of `chunk` (`off`, `len`) to the successor.
    Send {
        chunk: usize,
        off: usize,
        len: usize,
    },
    /// Copy this rank's own block (`off`, `len`) to its place in the output (all-gather; a
    /// no-op when in place).
    CopyOwn { off: usize, len: usize },
    /// Receive the predecessor's segment into this rank's `chunk` (`off`, `len`), then send it
    /// on to the successor if `forward`.
    RecvCopy {
        chunk: usize,
        off: usize,
        len: usize,
        forward: bool,
    },
    /// Receive a partial reduction of `chunk` (`off`, `len`) and combine it with this rank's
    /// data of that chunk: into scratch sent on to the successor (`last == false`), or — the
    /// chain's last step — into this rank's result with the final step over the world.
    RecvReduce {
        chunk: usize,
        off: usize,
        len: usize,
        last: bool,
    },
}

/// Ring all-gather of rank `r` of `n` over `chunks` (chunk `c` of the output is rank `c`'s
/// block): for each segment, send the own block and copy it to its place, then receive the
/// blocks of ranks `r - 1, r - 2, …`, forwarding all but the last.
pub(crate) fn all_gather(n: usize, r: usize, chunks: &Chunks) -> impl Iterator<Item = Step> + '_ {
    (0..chunks.num_segs).flat_map(move |g| {
        let (off, len) = chunks.seg(r, g);
        let send = (n > 1).then_some(Step::Send { chunk: r, off, len });
        let ring = (0..n - 1).map(move |s| {
            let b = (r + n - s - 1) % n;
            let (off, len) = chunks.seg(b, g);
            Step::RecvCopy {
                chunk: b,
                off,
                len,
                forward: s + 2 < n,
            }
        });
        send.into_iter()
            .chain(std::iter::once(Step::CopyOwn { off, len }))
            .chain(ring)
    })
}

/// Ring reduce-scatter of rank `r` of `n` over `chunks` (chunk `c` of the input reduces into
/// rank `c`'s result): for each segment, send the own data of chunk `r - 1`, then receive
/// partials of chunks `r - 2, r - 3, …`, combining and forwarding, the last (chunk `r`)
/// finishing. One rank copies its single chunk ([`Step::CopyOwn`]).
pub(crate) fn reduce_scatter(
    n: usize,
    r: usize,
    chunks: &Chunks,
) -> impl Iterator<Item = Step> + '_ {
    let alone = n == 1;
    (0..chunks.num_segs).flat_map(move |g| {
        let c0 = (r + n - 1) % n;
        let (off0, len0) = chunks.seg(c0, g);
        let first = if alone {
            Step::CopyOwn {
                off: off0,
                len: len0,
            }
        } else {
            Step::Send {
                chunk: c0,
                off: off0,
                len: len0,
            }
        };
        let ring = (0..n - 1).map(move |s| {
            let c = (r + 2 * n - s - 2) % n;
            let (off, len) = chunks.seg(c, g);
            Step::RecvReduce {
                chunk: c,
                off,
                len,
                last: s + 2 == n,
            }
        });
        std::iter::once(first).chain(ring)
    })
}

/// Pipelined chain broadcast from `root` along the ring over one chunk of `total` elements in
/// segments of `seg`: the root sends each segment, the others receive it and pass it on, the
/// rank before the root only receiving.
pub(crate) fn broadcast(
    n: usize,
    r: usize,
    root: usize,
    total: usize,
    seg: usize,
) -> impl Iterator<Item = Step> {
    let pos = (r + n - root) % n;
    let chunks = Chunks::whole(total, seg);
    let segs: Vec<(usize, usize)> = (0..chunks.num_segs).map(|g| chunks.seg(0, g)).collect();
    segs.into_iter().filter_map(move |(off, len)| {
        if pos == 0 {
            (n > 1).then_some(Step::Send { chunk: 0, off, len })
        } else {
            Some(Step::RecvCopy {
                chunk: 0,
                off,
                len,
                forward: pos + 1 < n,
            })
        }
    })
}

/// Pipelined chain reduce into `root` over one chunk of `total` elements in segments of `seg`:
/// the chain starts at `root + 1` (which sends its data), each next rank combines and forwards,
/// and the root finishes. A group of one does nothing.
pub(crate) fn reduce(
    n: usize,
    r: usize,
    root: usize,
    total: usize,
    seg: usize,
) -> impl Iterator<Item = Step> {
    let pos = (r + n - root - 1) % n;
    let chunks = Chunks::whole(total, seg);
    let segs: Vec<(usize, usize)> = (0..chunks.num_segs).map(|g| chunks.seg(0, g)).collect();
    segs.into_iter().filter_map(move |(off, len)| {
        if n == 1 {
            None
        } else if pos == 0 {
            Some(Step::Send { chunk: 0, off, len })
        } else {
            Some(Step::RecvReduce {
                chunk: 0,
                off,
                len,
                last: pos + 1 == n,
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's receives match its predecessor's sends, in order and length.
    fn sends_match_receives(n: usize, steps: &dyn Fn(usize) -> Vec<Step>) {
        for r in 0..n {
            let prev = (r + n - 1) % n;
            let sent: Vec<usize> = steps(prev)
                .iter()
                .filter_map(|s| match *s {
                    Step::Send { len, .. } => Some(len),
                    Step::RecvCopy {
                        len, forward: true, ..
                    } => Some(len),
                    Step::RecvReduce {
                        len, last: false, ..
                    } => Some(len),
                    _ => None,
                })
                .collect();
            let got: Vec<usize> = steps(r)
                .iter()
                .filter_map(|s| match *s {
                    Step::RecvCopy { len, .. } | Step::RecvReduce { len, .. } => Some(len),
                    _ => None,
                })
                .collect();
            assert_eq!(sent, got, "rank {r} of {n}");
        }
    }

    #[test]
    fn schedules_pair_up() {
        for n in 1..6 {
            let c = Chunks::balanced(n, 37, 4);
            sends_match_receives(n, &|r| all_gather(n, r, &c).collect());
            sends_match_receives(n, &|r| reduce_scatter(n, r, &c).collect());
            for root in 0..n {
                sends_match_receives(n, &|r| broadcast(n, r, root, 37, 4).collect());
                sends_match_receives(n, &|r| reduce(n, r, root, 37, 4).collect());
            }
        }
    }

    #[test]
    fn reduce_scatter_finishes_own_chunk_once_per_segment() {
        let (n, r) = (4, 1);
        let c = Chunks::equal(n, 10, 4);
        let finals: Vec<Step> = reduce_scatter(n, r, &c)
            .filter(|s| matches!(s, Step::RecvReduce { last: true, .. }))
            .collect();
        assert_eq!(finals.len(), c.num_segs);
        assert!(finals
            .iter()
            .all(|s| matches!(s, Step::RecvReduce { chunk, .. } if *chunk == r)));
    }
}
