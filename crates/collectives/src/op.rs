//! Reduce operations and the element-wise kernels that apply them.

use std::fmt;

use fsdp_device::Element;

/// How a reduction combines the ranks' values (NCCL's `ncclRedOp_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Sum divided by the number of ranks (computed as the sum, then one division).
    Avg,
    /// Minimum (NaN if any rank has NaN).
    Min,
    /// Maximum (NaN if any rank has NaN).
    Max,
    /// Product.
    Product,
}

impl ReduceOp {
    /// Every operation.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ];

    /// The lower-case name (`sum`, `avg`, …).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
        }
    }

    /// Combine two values: `acc ⊕ x`. The 16-bit types compute in `f32` and round after every
    /// operation, as NCCL does.
    #[inline]
    pub fn combine<T: Element>(self, acc: T, x: T) -> T {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => acc.add(x),
            ReduceOp::Min => acc.min_nan(x),
            ReduceOp::Max => acc.max_nan(x),
            ReduceOp::Product => acc.mul(x),
        }
    }

    /// The final step over `n` ranks: the division of [`ReduceOp::Avg`], the identity otherwise.
    #[inline]
    pub fn finish<T: Element>(self, v: T, n: usize) -> T {
        match self {
            ReduceOp::Avg => v.div_count(n),
            _ => v,
        }
    }

    /// Reduce values in rank order, exactly as the ring backend does for a chunk whose
    /// accumulation starts at `first` (a naive reference for tests): `v[first] ⊕ v[first+1] ⊕ …`
    /// wrapping around, then [`finish`](ReduceOp::finish).
    pub fn reduce_in_order<T: Element>(self, values: &[T], first: usize) -> T {
        let n = values.len();
        let mut acc = values[first % n];
        for i in 1..n {
            acc = self.combine(acc, values[(first + i) % n]);
        }
        self.finish(acc, n)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `dst[i] = finish?(acc[i] ⊕ x[i])` over slices of equal length.
#[inline]
pub(crate) fn combine_into<T: Element>(
    op: ReduceOp,
    dst: &mut [T],
    acc: &[T],
    x: &[T],
    finish_over: Option<usize>,
) {
    #[inline(always)]
    fn run<T: Element>(dst: &mut [T], acc: &[T], x: &[T], f: impl Fn(T, T) -> T) {
        for ((d, &a), &b) in dst.iter_mut().zip(acc).zip(x) {
            *d = f(a, b);
        }
    }
    match (op, finish_over) {
        (ReduceOp::Sum, _) => run(dst, acc, x, |a, b| a.add(b)),
        (ReduceOp::Avg, None) => run(dst, acc, x, |a, b| a.add(b)),
        (ReduceOp::Avg, Some(n)) => run(dst, acc, x, |a, b| a.add(b).div_count(n)),
        (ReduceOp::Min, _) => run(dst, acc, x, |a, b| a.min_nan(b)),
        (ReduceOp::Max, _) => run(dst, acc, x, |a, b| a.max_nan(b)),
        (ReduceOp::Product, _) => run(dst, acc, x, |a, b| a.mul(b)),
    }
}

/// In place: `dst[i] = finish?(acc[i] ⊕ dst[i])`.
#[inline]
pub(crate) fn combine_in_place<T: Element>(
    op: ReduceOp,
    dst: &mut [T],
    acc: &[T],
    finish_over: Option<usize>,
) {
    #[inline(always)]
    fn run<T: Element>(dst: &mut [T], acc: &[T], f: impl Fn(T, T) -> T) {
        for (d, &a) in dst.iter_mut().zip(acc) {
            *d = f(a, *d);
        }
    }
    match (op, finish_over) {
        (ReduceOp::Sum, _) => run(dst, acc, |a, b| a.add(b)),
        (ReduceOp::Avg, None) => run(dst, acc, |a, b| a.add(b)),
        (ReduceOp::Avg, Some(n)) => run(dst, acc, |a, b| a.add(b).div_count(n)),
        (ReduceOp::Min, _) => run(dst, acc, |a, b| a.min_nan(b)),
        (ReduceOp::Max, _) => run(dst, acc, |a, b| a.max_nan(b)),
        (ReduceOp::Product, _) => run(dst, acc, |a, b| a.mul(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_reference_matches_manual() {
        let v = [1.0f32, 2.0, 3.0, 4.0];
        assert_eq!(
            ReduceOp::Sum.reduce_in_order(&v, 2),
            ((3.0 + 4.0) + 1.0) + 2.0
        );
        assert_eq!(ReduceOp::Avg.reduce_in_order(&v, 0), 2.5);
        assert_eq!(ReduceOp::Product.reduce_in_order(&v, 1), 24.0);
        assert_eq!(ReduceOp::Min.reduce_in_order(&v, 3), 1.0);
        assert_eq!(ReduceOp::Max.reduce_in_order(&v, 3), 4.0);
    }

    #[test]
    fn kernels_match_scalar_combine() {
        let a = [1.0f64, -2.0, 5.0];
        let b = [3.0f64, 4.0, -1.0];
        for op in ReduceOp::ALL {
            let mut d = [0.0; 3];
            combine_into(op, &mut d, &a, &b, Some(2));
            let mut e = b;
            combine_in_place(op, &mut e, &a, Some(2));
            for i in 0..3 {
                let want = op.finish(op.combine(a[i], b[i]), 2);
                assert_eq!(d[i], want);
                assert_eq!(e[i], want);
            }
        }
    }
}
