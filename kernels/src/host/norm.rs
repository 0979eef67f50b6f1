//! Twin of `sum_squares_f32` + `sum_f64_final`: the sum of squares of an f32 shard in f64, in
//! the kernels' fixed order (see `cu/norm.cu`).

/// Threads per block of the norm kernels.
pub const NORM_BLOCK: usize = 256;
/// Elements each thread sums in the first pass.
pub const NORM_ITEMS: usize = 16;

/// The shared-memory tree of one block (`NORM_BLOCK` values): halve until one value is left.
pub(crate) fn tree_sum_f64(mut sh: Vec<f64>) -> f64 {
    let mut s = NORM_BLOCK / 2;
    while s > 0 {
        for t in 0..s {
            sh[t] += sh[t + s];
        }
        s /= 2;
    }
    sh[0]
}

/// The block sums of the first pass (one per `NORM_BLOCK · NORM_ITEMS` elements).
pub(crate) fn block_sums(x: &[f32]) -> Vec<f64> {
    let chunk = NORM_BLOCK * NORM_ITEMS;
    x.chunks(chunk)
        .map(|c| {
            let sh = (0..NORM_BLOCK)
                .map(|t| {
                    let mut acc = 0.0f64;
                    for k in 0..NORM_ITEMS {
                        if let Some(&v) = c.get(t + k * NORM_BLOCK) {
                            let v = f64::from(v);
                            acc += v * v;
                        }
                    }
                    acc
                })
                .collect();
            tree_sum_f64(sh)
        })
        .collect()
}

/// The sum of squares of `x` in f64, summed in the kernels' order (bitwise equal to them).
pub fn sum_of_squares(x: &[f32]) -> f64 {
    let sums = block_sums(x);
    let sh = (0..NORM_BLOCK)
        .map(|t| {
            sums.iter()
                .skip(t)
                .step_by(NORM_BLOCK)
                .fold(0.0, |a, &b| a + b)
        })
        .collect();
    tree_sum_f64(sh)
}

/// Twin of `clip_coefficient`: the global norm `√(sharded + replicated)` of the squared parts
/// and the coefficient that clips it to `max_norm` (PyTorch's `max_norm / (total + 1e-6)`,
/// rounded to `f32`, when the norm is finite and that is below 1; else 1, which
/// [`scale_by`] leaves alone; a `max_norm` of `+∞` never clips): `[norm, coefficient]`.
pub fn clip_coefficient(sharded: f64, replicated: f64, max_norm: f64) -> [f64; 2] {
    let total = (sharded + replicated).sqrt();
    let coef = max_norm / (total + 1e-6);
    let c = if total.is_finite() && coef < 1.0 {
        f64::from(coef as f32)
    } else {
        1.0
    };
    [total, c]
}

/// Twin of `scale_by_f32`: `x *= c` (rounded to `f32` first), each product rounded once;
/// nothing when the coefficient is 1.
pub fn scale_by(x: &mut [f32], c: f64) {
    let f = c as f32;
    if f != 1.0 {
        x.iter_mut().for_each(|v| *v *= f);
    }
}
