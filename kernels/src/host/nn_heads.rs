//! Twins of the bias add and of the attention heads' permutations in `cu/nn.cu`
//! (re-exported by [`host::nn`](crate::host::nn)).

use super::same_len;
use crate::KernelError;

/// Bias add over rows (**accumulates**): `y[r, j] = y[r, j] + bias[j]` for `y: [n, c]`,
/// `c = bias.len()` (a `Linear` layer's bias after its product).
///
/// # Errors
/// [`KernelError::InvalidArgument`] unless `y` is whole rows of `c`.
pub fn bias_add(y: &mut [f32], bias: &[f32]) -> Result<(), KernelError> {
    super::nn::rows_of("bias_add_f32", "y", y.len(), bias.len())?;
    for row in y.chunks_exact_mut(bias.len()) {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
    Ok(())
}

/// Where attention heads sit in token rows: `b` sequences of `t` tokens, each token's row of
/// `row` elements holding `h` heads of `d` elements from column `offset` on.
///
/// - `q`, `k` or `v` of `qkv: [b·t, 3·h·d]` (nanoGPT's `c_attn` output, `[b, t, 3, h, d]`):
///   `row = 3·h·d`, `offset` `0`, `h·d` or `2·h·d`;
/// - the heads' outputs or their gradient `[b·t, h·d]`: `row = h·d`, `offset = 0`.
///
/// The other side of a split or merge is dense `[b, h, t, d]` (one `[t, d]` matrix per
/// sequence and head, as attention's batched products read them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadsLayout {
    /// Sequences.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Heads.
    pub h: usize,
    /// Elements per head.
    pub d: usize,
    /// Elements per token row.
    pub row: usize,
    /// The first head's column in a row.
    pub offset: usize,
}

impl HeadsLayout {
    /// Elements of the dense `[b, h, t, d]` side.
    pub fn heads_len(&self) -> usize {
        self.b * self.h * self.t * self.d
    }

    /// Elements of the rows side, `b·t·row`.
    pub fn rows_len(&self) -> usize {
        self.b * self.t * self.row
    }

    /// The row-side index of element `k` of the dense side.
    fn at(&self, k: usize) -> usize {
        let di = k % self.d;
        let r = k / self.d;
        let ti = r % self.t;
        let r = r / self.t;
        let hh = r % self.h;
        let bi = r / self.h;
        (bi * self.t + ti) * self.row + self.offset + hh * self.d + di
    }

    /// Checks that the heads fit in a row and the sizes in the kernels' 32-bit arguments.
    pub(crate) fn check(
        &self,
        kernel: &'static str,
        rows: usize,
        heads: usize,
    ) -> Result<(), KernelError> {
        let bad = |reason: String| Err(KernelError::InvalidArgument { kernel, reason });
        if self.offset + self.h * self.d > self.row {
            return bad(format!(
                "{} heads of {} from column {} do not fit in rows of {}",
                self.h, self.d, self.offset, self.row
            ));
        }
        let dims = [self.b, self.t, self.h, self.d, self.row, self.offset];
        if dims.iter().any(|&v| u32::try_from(v).is_err()) {
            return bad(format!("{self:?} exceeds the kernels' 32-bit sizes"));
        }
        same_len(kernel, "rows", self.rows_len(), rows)?;
        same_len(kernel, "heads", self.heads_len(), heads)
    }
}

/// Attention heads out of token rows (**writes** `heads: [b, h, t, d]`; see [`HeadsLayout`]).
/// A copy: exact.
///
/// # Errors
/// [`KernelError::Length`] / [`KernelError::InvalidArgument`] for mismatched shapes.
pub fn heads_split(rows: &[f32], l: HeadsLayout, heads: &mut [f32]) -> Result<(), KernelError> {
    l.check("heads_split_f32", rows.len(), heads.len())?;
    for (k, o) in heads.iter_mut().enumerate() {
        *o = rows[l.at(k)];
    }
    Ok(())
}

/// The inverse of [`heads_split`]: writes `heads` into their places in `rows` (the other
/// columns are untouched). A copy: exact.
///
/// # Errors
/// As [`heads_split`].
pub fn heads_merge(heads: &[f32], l: HeadsLayout, rows: &mut [f32]) -> Result<(), KernelError> {
    l.check("heads_merge_f32", rows.len(), heads.len())?;
    for (k, &v) in heads.iter().enumerate() {
        rows[l.at(k)] = v;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_the_qkv_layout_and_merge_its_inverse() {
        let (b, t, h, d) = (2usize, 3usize, 2usize, 4usize);
        let e = h * d;
        let qkv: Vec<f32> = (0..b * t * 3 * e).map(|i| i as f32).collect();
        for (part, offset) in [0usize, e, 2 * e].into_iter().enumerate() {
            let l = HeadsLayout {
                b,
                t,
                h,
                d,
                row: 3 * e,
                offset,
            };
            let mut heads = vec![0.0; l.heads_len()];
            heads_split(&qkv, l, &mut heads).unwrap();
            // nanoGPT: q.view(B, T, H, d).transpose(1, 2), q = columns part·e .. (part+1)·e.
            for bi in 0..b {
                for hh in 0..h {
                    for ti in 0..t {
                        for di in 0..d {
                            let want = qkv[(bi * t + ti) * 3 * e + part * e + hh * d + di];
                            assert_eq!(heads[((bi * h + hh) * t + ti) * d + di], want);
                        }
                    }
                }
            }
            let mut back = vec![-1.0; qkv.len()];
            heads_merge(&heads, l, &mut back).unwrap();
            for (i, (&x, &y)) in back.iter().zip(&qkv).enumerate() {
                let col = i % (3 * e);
                let mine = col >= offset && col < offset + e;
                assert_eq!(x, if mine { y } else { -1.0 }, "element {i}");
            }
        }
    }

    #[test]
    fn shapes_are_checked_and_bias_add_adds_per_column() {
        let l = HeadsLayout {
            b: 1,
            t: 2,
            h: 2,
            d: 2,
            row: 4,
            offset: 1,
        };
        let mut heads = vec![0.0; 8];
        assert!(heads_split(&[0.0; 8], l, &mut heads).is_err());
        let l = HeadsLayout { offset: 0, ..l };
        assert!(heads_split(&[0.0; 7], l, &mut heads).is_err());
        let mut y = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        bias_add(&mut y, &[10.0, 20.0, 30.0]).unwrap();
        assert_eq!(y, [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        assert!(bias_add(&mut y, &[1.0; 4]).is_err());
    }
}
