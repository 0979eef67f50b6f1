//! Row-major matrix products and their cuBLAS (column-major) calls, on the host.
//!
//! The model stores matrices row-major (a `Linear` weight is `[out, in]`, activations are
//! `[tokens, features]`); cuBLAS is column-major. A row-major `C = op(A)·op(B)` is the
//! column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`, and a row-major matrix read column-major is its
//! transpose, so the call swaps the operands and keeps each operand's transpose flag:
//! [`MatMul::cublas`]. [`MatMul::host`] is the row-major definition and [`ColMajorCall::host`]
//! cuBLAS's column-major definition, both naive, in f64, so the mapping is tested on the host.

use crate::KernelError;

/// A row-major, possibly batched product `C = alpha·op(A)·op(B) + beta·C`, with `op(A)` of
/// shape `[m, k]`, `op(B)` `[k, n]` and `C` `[m, n]`, each operand stored densely row-major
/// (`A` as `[m, k]`, or `[k, m]` when `trans_a`; `B` as `[k, n]`, or `[n, k]` when `trans_b`),
/// batch `i` of each operand starting `i·stride` elements after the first, the first at the
/// operand's offset (0 unless [`MatMul::at`] says otherwise: a product on part of a buffer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatMul {
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// `A` is stored transposed (`[k, m]`).
    pub trans_a: bool,
    /// `B` is stored transposed (`[n, k]`).
    pub trans_b: bool,
    /// Products in the batch (1: a plain product).
    pub batch: usize,
    /// Elements from one batch of `A` to the next.
    pub stride_a: usize,
    /// Elements from one batch of `B` to the next.
    pub stride_b: usize,
    /// Elements from one batch of `C` to the next.
    pub stride_c: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of `C`'s previous value (0: overwrite, 1: accumulate).
    pub beta: f32,
    /// Element of `A`'s buffer where its first batch starts.
    pub offset_a: usize,
    /// Element of `B`'s buffer where its first batch starts.
    pub offset_b: usize,
    /// Element of `C`'s buffer where its first batch starts.
    pub offset_c: usize,
}

impl MatMul {
    /// A plain product `C[m, n] = op(A)·op(B)`.
    pub fn new(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> MatMul {
        MatMul {
            m,
            n,
            k,
            trans_a,
            trans_b,
            batch: 1,
            stride_a: m * k,
            stride_b: k * n,
            stride_c: m * n,
            alpha: 1.0,
            beta: 0.0,
            offset_a: 0,
            offset_b: 0,
            offset_c: 0,
        }
    }

    /// A `Linear` layer's forward product: `y[rows, out] = x[rows, in] · w[out, in]ᵀ` (the bias
    /// is added by a kernel).
    pub fn linear_forward(rows: usize, inputs: usize, outputs: usize) -> MatMul {
        MatMul::new(rows, outputs, inputs, false, true)
    }

    /// The input gradient of a `Linear` layer: `dx[rows, in] = dy[rows, out] · w[out, in]`.
    pub fn linear_grad_input(rows: usize, inputs: usize, outputs: usize) -> MatMul {
        MatMul::new(rows, inputs, outputs, false, false)
    }

    /// The weight gradient of a `Linear` layer: `dw[out, in] (+)= dy[rows, out]ᵀ · x[rows, in]`,
    /// accumulated into `dw` when `accumulate` (gradient accumulation across micro-batches).
    pub fn linear_grad_weight(
        rows: usize,
        inputs: usize,
        outputs: usize,
        accumulate: bool,
    ) -> MatMul {
        MatMul::new(outputs, inputs, rows, true, false).with_beta(if accumulate {
            1.0
        } else {
            0.0
        })
    }

    /// `batch` products, operands `stride_*` elements apart (attention: one per batch row and
    /// head).
    pub fn batched(
        mut self,
        batch: usize,
        stride_a: usize,
        stride_b: usize,
        stride_c: usize,
    ) -> MatMul {
        self.batch = batch;
        self.stride_a = stride_a;
        self.stride_b = stride_b;
        self.stride_c = stride_c;
        self
    }

    /// With the product scaled by `alpha` (attention's `1/√head_dim`).
    pub fn with_alpha(mut self, alpha: f32) -> MatMul {
        self.alpha = alpha;
        self
    }

    /// With `C`'s previous value scaled by `beta` and added.
    pub fn with_beta(mut self, beta: f32) -> MatMul {
        self.beta = beta;
        self
    }

    /// The operands' first elements at `a`, `b` and `c` of their buffers (attention over a
    /// chunk of its heads: the chunk's part of `q`, `k`, `v` and of the output).
    pub fn at(mut self, a: usize, b: usize, c: usize) -> MatMul {
        self.offset_a = a;
        self.offset_b = b;
        self.offset_c = c;
        self
    }

    /// Elements each operand spans from its offset: `(a, b, c)` (the last batch's end).
    pub fn spans(&self) -> (usize, usize, usize) {
        let end = |stride: usize, one: usize| {
            if self.batch == 0 || one == 0 {
                0
            } else {
                (self.batch - 1) * stride + one
            }
        };
        (
            end(self.stride_a, self.m * self.k),
            end(self.stride_b, self.k * self.n),
            end(self.stride_c, self.m * self.n),
        )
    }

    /// Elements each operand's buffer must hold: `(a, b, c)`, its offset plus its
    /// [span](MatMul::spans).
    pub fn extents(&self) -> (usize, usize, usize) {
        let (a, b, c) = self.spans();
        (
            self.offset_a.saturating_add(a),
            self.offset_b.saturating_add(b),
            self.offset_c.saturating_add(c),
        )
    }

    /// This product with `A` and `B` read from the start of buffers holding only their
    /// spans (kept bf16 copies of the operands' parts), `C` where it was.
    pub(crate) fn operands_from_start(self) -> MatMul {
        self.at(0, 0, self.offset_c)
    }

    /// Checks operands of `a`, `b` and `c` elements against [`MatMul::extents`], and that the
    /// batches of `C` do not overlap: what cuBLAS's products and the host's refuse alike.
    pub(crate) fn check_operands(&self, a: usize, b: usize, c: usize) -> Result<(), KernelError> {
        if self.batch > 1 && self.stride_c < self.m * self.n {
            return Err(KernelError::InvalidArgument {
                kernel: "gemm",
                reason: format!(
                    "batches of C overlap: stride {} < {}×{}",
                    self.stride_c, self.m, self.n
                ),
            });
        }
        let (ea, eb, ec) = self.extents();
        for (what, need, have) in [("a", ea, a), ("b", eb, b), ("c", ec, c)] {
            if have < need {
                return Err(KernelError::Length {
                    kernel: "gemm",
                    what,
                    expected: need,
                    actual: have,
                });
            }
        }
        Ok(())
    }

    /// The column-major call computing this product (operands swapped: see the module docs).
    pub fn cublas(&self) -> ColMajorCall {
        ColMajorCall {
            trans_first: self.trans_b,
            trans_second: self.trans_a,
            m: self.n,
            n: self.m,
            k: self.k,
            ld_first: if self.trans_b { self.k } else { self.n },
            ld_second: if self.trans_a { self.m } else { self.k },
            ldc: self.n,
            batch: self.batch,
            stride_first: self.stride_b,
            stride_second: self.stride_a,
            stride_c: self.stride_c,
        }
    }

    /// The row-major definition, naive in f64 (the reference of the tests).
    pub fn host(&self, a: &[f64], b: &[f64], c: &mut [f64]) {
        let (a, b) = (&a[self.offset_a..], &b[self.offset_b..]);
        let c = &mut c[self.offset_c..];
        for t in 0..self.batch {
            let (a, b) = (&a[t * self.stride_a..], &b[t * self.stride_b..]);
            let c = &mut c[t * self.stride_c..];
            for i in 0..self.m {
                for j in 0..self.n {
                    let mut acc = 0.0;
                    for p in 0..self.k {
                        let x = if self.trans_a {
                            a[p * self.m + i]
                        } else {
                            a[i * self.k + p]
                        };
                        let y = if self.trans_b {
                            b[j * self.k + p]
                        } else {
                            b[p * self.n + j]
                        };
                        acc += x * y;
                    }
                    let old = c[i * self.n + j];
                    c[i * self.n + j] = f64::from(self.alpha) * acc
                        + if self.beta == 0.0 {
                            0.0
                        } else {
                            f64::from(self.beta) * old
                        };
                }
            }
        }
    }
}

/// A column-major `gemm` call (cuBLAS's terms): `C[m, n] = op(first)·op(second)`, `first` being
/// the row-major product's `B` and `second` its `A`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColMajorCall {
    /// `transa` of cuBLAS.
    pub trans_first: bool,
    /// `transb` of cuBLAS.
    pub trans_second: bool,
    /// Rows of cuBLAS's `C`.
    pub m: usize,
    /// Columns of cuBLAS's `C`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `lda`.
    pub ld_first: usize,
    /// `ldb`.
    pub ld_second: usize,
    /// `ldc`.
    pub ldc: usize,
    /// `batchCount`.
    pub batch: usize,
    /// `strideA`.
    pub stride_first: usize,
    /// `strideB`.
    pub stride_second: usize,
    /// `strideC`.
    pub stride_c: usize,
}

impl ColMajorCall {
    /// cuBLAS's column-major definition, naive in f64: what the GPU computes (up to rounding).
    pub fn host(&self, first: &[f64], second: &[f64], c: &mut [f64], alpha: f32, beta: f32) {
        for t in 0..self.batch {
            let (a, b) = (
                &first[t * self.stride_first..],
                &second[t * self.stride_second..],
            );
            let c = &mut c[t * self.stride_c..];
            for i in 0..self.m {
                for j in 0..self.n {
                    let mut acc = 0.0;
                    for p in 0..self.k {
                        let x = if self.trans_first {
                            a[p + i * self.ld_first]
                        } else {
                            a[i + p * self.ld_first]
                        };
                        let y = if self.trans_second {
                            b[j + p * self.ld_second]
                        } else {
                            b[p + j * self.ld_second]
                        };
                        acc += x * y;
                    }
                    let old = c[i + j * self.ldc];
                    c[i + j * self.ldc] = f64::from(alpha) * acc
                        + if beta == 0.0 {
                            0.0
                        } else {
                            f64::from(beta) * old
                        };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random sequence (xorshift), in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0
            })
            .collect()
    }

    #[test]
    fn the_column_major_call_computes_the_row_major_product() {
        let mut seed = 1;
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (8, 2, 4), (5, 9, 1), (1, 6, 3)] {
            for trans_a in [false, true] {
                for trans_b in [false, true] {
                    for (batch, beta) in [(1, 0.0), (3, 1.0), (2, 0.5)] {
                        let g = MatMul::new(m, n, k, trans_a, trans_b)
                            .batched(batch, m * k + 2, k * n + 1, m * n + 3)
                            .with_alpha(0.75)
                            .with_beta(beta);
                        let (ea, eb, ec) = g.extents();
                        seed += 1;
                        let (a, b) = (values(seed, ea), values(seed + 100, eb));
                        let c0 = values(seed + 200, ec);
                        let (mut want, mut got) = (c0.clone(), c0);
                        g.host(&a, &b, &mut want);
                        g.cublas().host(&b, &a, &mut got, g.alpha, g.beta);
                        for (w, x) in want.iter().zip(&got) {
                            assert!((w - x).abs() <= 1e-12 * (1.0 + w.abs()), "{g:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn linear_products_are_the_layer_formulas() {
        let (rows, inputs, outputs) = (4, 3, 5);
        let x = values(7, rows * inputs);
        let w = values(8, outputs * inputs);
        let dy = values(9, rows * outputs);
        // y[r][o] = Σ_i x[r][i]·w[o][i]
        let mut y = vec![0.0; rows * outputs];
        MatMul::linear_forward(rows, inputs, outputs).host(&x, &w, &mut y);
        // dx[r][i] = Σ_o dy[r][o]·w[o][i]
        let mut dx = vec![0.0; rows * inputs];
        MatMul::linear_grad_input(rows, inputs, outputs).host(&dy, &w, &mut dx);
        // dw[o][i] = 1 + Σ_r dy[r][o]·x[r][i] (accumulating onto ones)
        let mut dw = vec![1.0; outputs * inputs];
        MatMul::linear_grad_weight(rows, inputs, outputs, true).host(&dy, &x, &mut dw);
        for r in 0..rows {
            for o in 0..outputs {
                let want: f64 = (0..inputs)
                    .map(|i| x[r * inputs + i] * w[o * inputs + i])
                    .sum();
                assert!((y[r * outputs + o] - want).abs() < 1e-12);
            }
            for i in 0..inputs {
                let want: f64 = (0..outputs)
                    .map(|o| dy[r * outputs + o] * w[o * inputs + i])
                    .sum();
                assert!((dx[r * inputs + i] - want).abs() < 1e-12);
            }
        }
        for o in 0..outputs {
            for i in 0..inputs {
                let want: f64 = 1.0
                    + (0..rows)
                        .map(|r| dy[r * outputs + o] * x[r * inputs + i])
                        .sum::<f64>();
                assert!((dw[o * inputs + i] - want).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn extents_cover_the_last_batch() {
        let g = MatMul::new(2, 3, 4, false, false).batched(3, 10, 20, 6);
        assert_eq!(g.extents(), (2 * 10 + 8, 2 * 20 + 12, 2 * 6 + 6));
        assert_eq!(MatMul::new(2, 3, 0, false, false).extents(), (0, 0, 6));
    }
}
