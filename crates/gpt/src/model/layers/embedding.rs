//! Token and position embeddings (`nn.Embedding`), forward and backward.

use super::{check_len, Real};

/// Token plus position embedding: row `r` of `x: [n, e]` is `wte[ids[r]] + wpe[r mod t]`,
/// where the `n = ids.len()` rows are sequences of `t` tokens one after the other.
///
/// # Panics
/// If a slice's length does not match the shapes or an id is out of `wte`.
pub fn embedding_forward<T: Real>(
    ids: &[u32],
    t: usize,
    wte: &[T],
    wpe: &[T],
    e: usize,
    x: &mut [T],
) {
    check_len("embedding x", x, ids.len() * e);
    assert!(
        t > 0 && ids.len() % t == 0 && wpe.len() >= t * e,
        "embedding: {} ids are not whole sequences of {t} positions covered by wpe",
        ids.len()
    );
    for (r, (&id, xr)) in ids.iter().zip(x.chunks_exact_mut(e)).enumerate() {
        let id = id as usize;
        let tok = &wte[id * e..(id + 1) * e];
        let pos = &wpe[(r % t) * e..(r % t + 1) * e];
        for ((o, &a), &p) in xr.iter_mut().zip(tok).zip(pos) {
            *o = a + p;
        }
    }
}

/// Embedding backward, token part: `dwte[ids[r]] += dx[r]` (a scatter-add; repeated ids add up).
///
/// # Panics
/// If a slice's length does not match the shapes or an id is out of `dwte`.
pub fn embedding_backward_tokens<T: Real>(ids: &[u32], dx: &[T], e: usize, dwte: &mut [T]) {
    check_len("embedding dx", dx, ids.len() * e);
    for (&id, g) in ids.iter().zip(dx.chunks_exact(e)) {
        let id = id as usize;
        for (d, &v) in dwte[id * e..(id + 1) * e].iter_mut().zip(g) {
            *d += v;
        }
    }
}

/// Embedding backward, position part: `dwpe[r mod t] += dx[r]` for every row `r` of `dx: [n, e]`.
///
/// # Panics
/// If `dx` is not whole sequences of `t` rows or `dwpe` has fewer than `t` rows.
pub fn embedding_backward_positions<T: Real>(t: usize, dx: &[T], e: usize, dwpe: &mut [T]) {
    assert!(
        t > 0 && dx.len() % (t * e) == 0 && dwpe.len() >= t * e,
        "embedding: dx of {} elements is not whole sequences of {t} positions covered by dwpe",
        dx.len()
    );
    for (r, g) in dx.chunks_exact(e).enumerate() {
        let p = r % t;
        for (d, &v) in dwpe[p * e..(p + 1) * e].iter_mut().zip(g) {
            *d += v;
        }
    }
}
