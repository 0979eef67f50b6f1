//! Exact GELU (`nn.GELU()`), forward and backward.

use super::{check_len, Real};

/// Exact GELU (PyTorch's `approximate='none'`), `y = x·Φ(x) = ½·x·(1 + erf(x/√2))`, with
/// `Φ` from [`Real::normal_cdf_pdf`].
///
/// # Panics
/// If `x` and `y` differ in length.
pub fn gelu_forward<T: Real>(x: &[T], y: &mut [T]) {
    check_len("gelu y", y, x.len());
    for (o, &v) in y.iter_mut().zip(x) {
        *o = v * v.normal_cdf_pdf().0;
    }
}

/// GELU backward: `dx += dy·(Φ(x) + x·φ(x))`.
///
/// # Panics
/// If the slices differ in length.
pub fn gelu_backward<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    check_len("gelu dy", dy, x.len());
    check_len("gelu dx", dx, x.len());
    for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
        let (cdf, pdf) = v.normal_cdf_pdf();
        *d += g * (cdf + v * pdf);
    }
}
