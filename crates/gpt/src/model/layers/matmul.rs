//! Strided matrix products: [`gemm`] and the crate-internal [`Mat`] views it shares with the
//! layers.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};

use super::{check_len, Real};

/// A strided matrix inside a slice: element `(i, j)` is at `off + i·rs + j·cs`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mat {
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl Mat {
    /// Row-major `rows × cols` at `off` with row stride `ld`.
    pub(super) fn rm(off: usize, rows: usize, cols: usize, ld: usize) -> Mat {
        Mat {
            off,
            rows,
            cols,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose (same elements).
    pub(super) fn t(self) -> Mat {
        Mat {
            off: self.off,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    fn view<T: Real>(self, s: &[T]) -> ArrayView2<'_, T> {
        ArrayView2::from_shape(
            (self.rows, self.cols).strides((self.rs, self.cs)),
            &s[self.off..],
        )
        .expect("strided matrix lies inside its slice")
    }

    fn view_mut<T: Real>(self, s: &mut [T]) -> ArrayViewMut2<'_, T> {
        ArrayViewMut2::from_shape(
            (self.rows, self.cols).strides((self.rs, self.cs)),
            &mut s[self.off..],
        )
        .expect("strided matrix lies inside its slice")
    }

    /// Its elements copied into a new column-major buffer, and the matrix there; `None` when
    /// the memory for the copy cannot be had.
    fn to_col_major<T: Real>(self, s: &[T]) -> Option<(Vec<T>, Mat)> {
        let mut out = Vec::new();
        out.try_reserve_exact(self.rows * self.cols).ok()?;
        out.resize(self.rows * self.cols, T::zero());
        let (r, c) = (self.rows, self.cols);
        if self.cs == 1 {
            // Contiguous rows: for each band of 16 columns (whose output, 16 columns of `r`
            // elements, stays in L1), read four rows side by side and write four-element runs.
            for j0 in (0..c).step_by(16) {
                let jb = 16.min(c - j0);
                let row = |i: usize| &s[self.off + i * self.rs + j0..][..jb];
                let mut i0 = 0;
                while i0 + 4 <= r {
                    let (r0, r1, r2, r3) = (row(i0), row(i0 + 1), row(i0 + 2), row(i0 + 3));
                    for (j, (((&a, &b), &cc), &d)) in r0.iter().zip(r1).zip(r2).zip(r3).enumerate()
                    {
                        // Four scalar stores: building a [T; 4] and copying it stalls on
                        // store forwarding.
                        let o = &mut out[(j0 + j) * r + i0..][..4];
                        o[0] = a;
                        o[1] = b;
                        o[2] = cc;
                        o[3] = d;
                    }
                    i0 += 4;
                }
                for i in i0..r {
                    for (j, &v) in row(i).iter().enumerate() {
                        out[(j0 + j) * r + i] = v;
                    }
                }
            }
        } else {
            for (j, col) in out.chunks_exact_mut(r).enumerate() {
                let base = self.off + j * self.cs;
                for (i, o) in col.iter_mut().enumerate() {
                    *o = s[base + i * self.rs];
                }
            }
        }
        let m = Mat {
            off: 0,
            rows: self.rows,
            cols: self.cols,
            rs: 1,
            cs: self.rows,
        };
        Some((out, m))
    }
}

/// `c = alpha·a·b + beta·c` through `matrixmultiply`, first copying `a` to column-major and `b`
/// to row-major order when they are not: `matrixmultiply` packs operands in those orders, and
/// for the small products of this model its strided packing costs several times the copy.
/// When the memory for a copy cannot be had, the operand is used in place (slower; the same
/// result bit for bit, since `matrixmultiply` packs every operand whatever its strides).
#[allow(clippy::too_many_arguments)]
pub(super) fn mat_mul<T: Real>(
    alpha: T,
    a: &[T],
    am: Mat,
    b: &[T],
    bm: Mat,
    beta: T,
    c: &mut [T],
    cm: Mat,
) {
    let a_copy;
    let av = if am.rs == 1 || am.rows <= 1 {
        am.view(a)
    } else if let Some((buf, m)) = am.to_col_major(a) {
        a_copy = buf;
        m.view(&a_copy)
    } else {
        am.view(a)
    };
    let b_copy;
    let bv = if bm.cs == 1 || bm.cols <= 1 {
        bm.view(b)
    } else if let Some((buf, m)) = bm.t().to_col_major(b) {
        // Row-major `b` is column-major `bᵀ`.
        b_copy = buf;
        m.t().view(&b_copy)
    } else {
        bm.view(b)
    };
    general_mat_mul(alpha, &av, &bv, beta, &mut cm.view_mut(c));
}

/// `C[m×n] = alpha · op(A) · op(B) + beta · C` for row-major slices: `op(A)` is `A` stored as
/// `[m, k]`, or `Aᵀ` of `A` stored as `[k, m]` when `trans_a`; likewise `op(B)` is `[k, n]`, or
/// `Bᵀ` of `B` stored as `[n, k]` when `trans_b`. With `beta == 0` the old contents of `C` are
/// ignored.
///
/// # Panics
/// If a slice's length is not what its shape needs.
#[allow(clippy::too_many_arguments)]
pub fn gemm<T: Real>(
    m: usize,
    n: usize,
    k: usize,
    alpha: T,
    a: &[T],
    trans_a: bool,
    b: &[T],
    trans_b: bool,
    beta: T,
    c: &mut [T],
) {
    check_len("gemm A", a, m * k);
    check_len("gemm B", b, k * n);
    check_len("gemm C", c, m * n);
    let am = if trans_a {
        Mat::rm(0, k, m, m).t()
    } else {
        Mat::rm(0, m, k, k)
    };
    let bm = if trans_b {
        Mat::rm(0, n, k, k).t()
    } else {
        Mat::rm(0, k, n, n)
    };
    mat_mul(alpha, a, am, b, bm, beta, c, Mat::rm(0, m, n, n));
}
