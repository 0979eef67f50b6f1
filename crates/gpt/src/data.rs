//! Token streams and the batch rule.
//!
//! A token stream is a sequence of `L` token ids: either a file of little-endian `u16` ids
//! (nanoGPT's `train.bin`, see [`read_token_file`]) or a corpus generated here
//! ([`synthetic_corpus`]). Global batch `k` has `B` rows of `T` tokens; row `j` starts at token
//! `((k·B + j)·T) mod (L − T − 1)` and its targets are the next tokens. Rank `r` of `N` gets rows
//! `r·B/N … (r+1)·B/N − 1` ([`get_batch`]).

use std::path::Path;

use crate::model::{BatchShape, SplitMix64};
use fsdp::FsdpError;

/// Rows of input token ids with their next-token targets, row after row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Input ids, `shape.rows · shape.seq_len` of them.
    pub inputs: Vec<u32>,
    /// Target ids (each input's next token), same layout.
    pub targets: Vec<u32>,
    /// Rows and tokens per row.
    pub shape: BatchShape,
}

/// Reads a file of little-endian `u16` token ids (nanoGPT's `train.bin` format).
///
/// # Errors
/// [`FsdpError::Io`] if it cannot be read, [`FsdpError::TokenFileOddLength`] if its length in
/// bytes is odd, [`FsdpError::TokenStreamTooShort`] if it holds fewer than 2 tokens (one input
/// and its target).
pub fn read_token_file(path: impl AsRef<Path>) -> Result<Vec<u16>, FsdpError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| FsdpError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if bytes.len() % 2 != 0 {
        return Err(FsdpError::TokenFileOddLength {
            path: path.to_path_buf(),
            bytes: bytes.len() as u64,
        });
    }
    let tokens: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    if tokens.len() < 2 {
        return Err(FsdpError::TokenStreamTooShort {
            len: tokens.len(),
            needed: 2,
            reason: format!(
                "{} must hold at least one input token and its target",
                path.display()
            ),
        });
    }
    Ok(tokens)
}

/// Writes token ids as little-endian `u16` (the format [`read_token_file`] reads).
///
/// # Errors
/// [`FsdpError::Io`] if the file cannot be written.
pub fn write_token_file(path: impl AsRef<Path>, tokens: &[u16]) -> Result<(), FsdpError> {
    let path = path.as_ref();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).map_err(|source| FsdpError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Checks that a stream of `len` tokens can give rows of `seq_len` tokens under the batch rule:
/// `L − T − 1 ≥ 1`, i.e. `L ≥ T + 2`.
///
/// # Errors
/// [`FsdpError::TokenStreamTooShort`] otherwise, [`FsdpError::InvalidShape`] if `seq_len == 0`.
pub fn check_stream_len(len: usize, seq_len: usize) -> Result<(), FsdpError> {
    if seq_len == 0 {
        return Err(FsdpError::InvalidShape {
            reason: "sequence length must be at least 1".into(),
        });
    }
    let needed = seq_len.saturating_add(2);
    if len < needed {
        return Err(FsdpError::TokenStreamTooShort {
            len,
            needed,
            reason: format!(
                "rows of {seq_len} tokens start at positions mod (L − {seq_len} − 1), which \
                 must be at least 1"
            ),
        });
    }
    Ok(())
}

/// The first token of row `row` of global batch `k` (`batch_size` rows of `seq_len` tokens) in
/// a stream of `len` tokens: `((k·B + row)·T) mod (L − T − 1)`. Computed without overflow.
///
/// # Errors
/// As [`check_stream_len`].
pub fn row_start(
    len: usize,
    k: u64,
    batch_size: usize,
    row: usize,
    seq_len: usize,
) -> Result<usize, FsdpError> {
    check_stream_len(len, seq_len)?;
    let modulus = (len - seq_len - 1) as u128;
    let idx = (u128::from(k) * batch_size as u128 + row as u128) * seq_len as u128;
    Ok((idx % modulus) as usize)
}

/// Rank `rank`'s share of global batch `k`: rows `rank·B/N … (rank+1)·B/N − 1` of the global
/// batch of `batch_size` (`B`) rows of `seq_len` (`T`) tokens, world size `N`. Inputs are the
/// tokens from each row's start, targets the tokens one further.
///
/// # Errors
/// [`FsdpError::InvalidRank`] if `world_size == 0` or `rank ≥ world_size`;
/// [`FsdpError::BatchNotDivisible`] if `B` is not a multiple of `N`;
/// [`FsdpError::InvalidShape`] if `B` or `T` is zero; [`FsdpError::TokenStreamTooShort`] if
/// the stream has fewer than `T + 2` tokens.
pub fn get_batch(
    tokens: &[u16],
    k: u64,
    batch_size: usize,
    seq_len: usize,
    rank: usize,
    world_size: usize,
) -> Result<Batch, FsdpError> {
    if world_size == 0 || rank >= world_size {
        return Err(FsdpError::InvalidRank { rank, world_size });
    }
    if batch_size == 0 {
        return Err(FsdpError::InvalidShape {
            reason: "global batch size must be at least 1".into(),
        });
    }
    if batch_size % world_size != 0 {
        return Err(FsdpError::BatchNotDivisible {
            batch_size,
            world_size,
        });
    }
    check_stream_len(tokens.len(), seq_len)?;
    let rows = batch_size / world_size;
    let n = rows
        .checked_mul(seq_len)
        .ok_or_else(|| FsdpError::InvalidShape {
            reason: format!("{rows} rows of {seq_len} tokens overflow usize"),
        })?;
    let mut inputs = Vec::new();
    let mut targets = Vec::new();
    for (v, what) in [
        (&mut inputs, "batch inputs"),
        (&mut targets, "batch targets"),
    ] {
        v.try_reserve_exact(n)
            .map_err(|_| FsdpError::HostOutOfMemory {
                what: format!("the {what} ({rows} rows of {seq_len} tokens)"),
                bytes: (n as u64).saturating_mul(4),
            })?;
    }
    for i in 0..rows {
        let start = row_start(tokens.len(), k, batch_size, rank * rows + i, seq_len)?;
        inputs.extend(tokens[start..start + seq_len].iter().map(|&t| u32::from(t)));
        targets.extend(
            tokens[start + 1..start + seq_len + 1]
                .iter()
                .map(|&t| u32::from(t)),
        );
    }
    Ok(Batch {
        inputs,
        targets,
        shape: BatchShape { rows, seq_len },
    })
}

/// How likely each of a token's [`SYNTHETIC_SUCCESSORS`] successors is in [`synthetic_corpus`].
pub const SYNTHETIC_PROBS: [f64; 4] = [0.55, 0.25, 0.15, 0.05];

/// How many possible successors each token has in [`synthetic_corpus`].
pub const SYNTHETIC_SUCCESSORS: usize = SYNTHETIC_PROBS.len();

/// The `i`-th possible successor of token `prev` in the corpus of `seed` (`i <` 4).
pub fn synthetic_successor(seed: u64, vocab_size: u16, prev: u16, i: usize) -> u16 {
    let mut h =
        SplitMix64::new(seed ^ (u64::from(prev) << 20) ^ ((i as u64) << 8) ^ 0x5EED_C0DE_0000_0000);
    (h.next_u64() % u64::from(vocab_size.max(1))) as u16
}

/// A deterministic corpus of `len` token ids below `vocab_size` with structure a small model
/// can learn: a first-order Markov chain in which every token has 4 possible successors
/// (functions of the seed and the token) taken with probabilities 0.55, 0.25, 0.15 and 0.05.
/// Its entropy rate is about 1.14 nats per token (at most; less where successors coincide),
/// against `ln(vocab_size)` for uniform tokens, so the loss of a model that learns the bigram
/// statistics falls well below that of a uniform guess.
pub fn synthetic_corpus(len: usize, vocab_size: u16, seed: u64) -> Vec<u16> {
    let v = vocab_size.max(1);
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(len);
    let mut prev = (rng.next_u64() % u64::from(v)) as u16;
    for _ in 0..len {
        out.push(prev);
        let u = rng.uniform();
        let mut acc = 0.0;
        let mut choice = SYNTHETIC_SUCCESSORS - 1;
        for (i, p) in SYNTHETIC_PROBS.iter().enumerate() {
            acc += p;
            if u < acc {
                choice = i;
                break;
            }
        }
        prev = synthetic_successor(seed, v, prev, choice);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(len: usize) -> Vec<u16> {
        (0..len).map(|i| (i % 1000) as u16).collect()
    }

    #[test]
    fn row_starts_follow_the_rule() {
        let l = 20_000;
        for k in [0u64, 1, 7, 123] {
            for j in 0..8 {
                let s = row_start(l, k, 8, j, 16).unwrap();
                assert_eq!(s, (((k as usize) * 8 + j) * 16) % (l - 16 - 1));
            }
        }
        // Huge k does not overflow.
        let s = row_start(l, u64::MAX, 8, 7, 16).unwrap();
        let expect = ((u128::from(u64::MAX) * 8 + 7) * 16 % (l as u128 - 17)) as usize;
        assert_eq!(s, expect);
    }

    #[test]
    fn batch_rows_inputs_and_targets() {
        let toks = stream(5000);
        let b = get_batch(&toks, 3, 4, 8, 0, 1).unwrap();
        assert_eq!(
            b.shape,
            BatchShape {
                rows: 4,
                seq_len: 8
            }
        );
        for j in 0..4 {
            let s = ((3 * 4 + j) * 8) % (5000 - 9);
            for t in 0..8 {
                assert_eq!(b.inputs[j * 8 + t], u32::from(toks[s + t]));
                assert_eq!(b.targets[j * 8 + t], u32::from(toks[s + t + 1]));
            }
        }
    }

    #[test]
    fn rank_slices_partition_the_global_batch() {
        let toks = stream(3000);
        let full = get_batch(&toks, 5, 8, 16, 0, 1).unwrap();
        for n in [1usize, 2, 4, 8] {
            let mut inputs = Vec::new();
            let mut targets = Vec::new();
            for r in 0..n {
                let b = get_batch(&toks, 5, 8, 16, r, n).unwrap();
                assert_eq!(b.shape.rows, 8 / n);
                inputs.extend(b.inputs);
                targets.extend(b.targets);
            }
            assert_eq!(inputs, full.inputs);
            assert_eq!(targets, full.targets);
        }
    }

    #[test]
    fn bad_world_and_batch_are_errors() {
        let toks = stream(3000);
        assert!(matches!(
            get_batch(&toks, 0, 8, 16, 0, 3),
            Err(FsdpError::BatchNotDivisible {
                batch_size: 8,
                world_size: 3
            })
        ));
        assert!(matches!(
            get_batch(&toks, 0, 8, 16, 2, 2),
            Err(FsdpError::InvalidRank {
                rank: 2,
                world_size: 2
            })
        ));
        assert!(matches!(
            get_batch(&toks, 0, 8, 16, 0, 0),
            Err(FsdpError::InvalidRank { .. })
        ));
        assert!(matches!(
            get_batch(&toks, 0, 0, 16, 0, 1),
            Err(FsdpError::InvalidShape { .. })
        ));
        assert!(matches!(
            get_batch(&toks, 0, 8, 0, 0, 1),
            Err(FsdpError::InvalidShape { .. })
        ));
    }

    #[test]
    fn short_streams_are_errors() {
        // L = T + 1: L − T − 1 = 0, no valid start.
        let toks = stream(17);
        let err = get_batch(&toks, 0, 2, 16, 0, 1).unwrap_err();
        assert!(matches!(
            err,
            FsdpError::TokenStreamTooShort {
                len: 17,
                needed: 18,
                ..
            }
        ));
        assert!(err.to_string().contains("17 tokens"));
        // L = T + 2 is the shortest usable stream: every row starts at 0.
        let toks = stream(18);
        let b = get_batch(&toks, 9, 2, 16, 0, 1).unwrap();
        assert_eq!(&b.inputs[..16], &b.inputs[16..]);
        assert_eq!(b.targets[15], 16);
    }

    fn tmpfile(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("fsdp-data-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn token_file_round_trip_and_errors() {
        let p = tmpfile("ok.bin");
        let toks: Vec<u16> = vec![1, 2, 300, 65535, 0];
        write_token_file(&p, &toks).unwrap();
        assert_eq!(
            std::fs::read(&p).unwrap(),
            [1, 0, 2, 0, 44, 1, 255, 255, 0, 0]
        );
        assert_eq!(read_token_file(&p).unwrap(), toks);

        let odd = tmpfile("odd.bin");
        std::fs::write(&odd, [1u8, 0, 2]).unwrap();
        let err = read_token_file(&odd).unwrap_err();
        assert!(matches!(
            err,
            FsdpError::TokenFileOddLength { bytes: 3, .. }
        ));
        assert!(err.to_string().contains("odd"), "{err}");

        let short = tmpfile("short.bin");
        std::fs::write(&short, [7u8, 0]).unwrap();
        assert!(matches!(
            read_token_file(&short),
            Err(FsdpError::TokenStreamTooShort {
                len: 1,
                needed: 2,
                ..
            })
        ));
        std::fs::write(&short, []).unwrap();
        assert!(matches!(
            read_token_file(&short),
            Err(FsdpError::TokenStreamTooShort { len: 0, .. })
        ));

        let missing = tmpfile("does-not-exist.bin");
        let err = read_token_file(&missing).unwrap_err();
        assert!(matches!(err, FsdpError::Io { .. }));
        assert!(err.to_string().contains("does-not-exist.bin"));
    }

    #[test]
    fn synthetic_corpus_is_deterministic_and_structured() {
        let v = 96u16;
        let a = synthetic_corpus(50_000, v, 7);
        assert_eq!(a, synthetic_corpus(50_000, v, 7));
        assert_ne!(a, synthetic_corpus(50_000, v, 8));
        assert!(a.iter().all(|&t| t < v));
        // Every transition is one of the token's four successors.
        for w in a.windows(2) {
            assert!((0..SYNTHETIC_SUCCESSORS).any(|i| synthetic_successor(7, v, w[0], i) == w[1]));
        }
        // Empirical conditional entropy H(next | prev) is far below ln V.
        let vs = usize::from(v);
        let mut counts = vec![0u32; vs * vs];
        for w in a.windows(2) {
            counts[usize::from(w[0]) * vs + usize::from(w[1])] += 1;
        }
        let total = (a.len() - 1) as f64;
        let mut h = 0.0;
        for row in counts.chunks(vs) {
            let rs: u32 = row.iter().sum();
            for &c in row.iter().filter(|&&c| c > 0) {
                let p_joint = f64::from(c) / total;
                h -= p_joint * (f64::from(c) / f64::from(rs)).ln();
            }
        }
        assert!(h < 1.2, "conditional entropy {h}");
        // Most tokens of the vocabulary occur.
        let distinct = counts
            .chunks(vs)
            .filter(|r| r.iter().any(|&c| c > 0))
            .count();
        assert!(distinct > vs / 2, "only {distinct} distinct tokens");
    }
}
