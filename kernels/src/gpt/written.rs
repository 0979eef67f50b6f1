//! [`Written`]: a layer's result that only matrix products read, which
//! [`GptOps::write_operand`] writes as an operand by the layer's own kernel — with bf16
//! products its bf16 rounding, with no f32 buffer and no cast in between.

use super::ops::GptOps;
use crate::host::nn::{self, HeadsLayout};
use crate::KernelError;

/// A layer's result that only matrix products read ([`GptOps::write_operand`]): each variant
/// is the kernel operation of the same name, its output the new operand.
#[non_exhaustive]
pub enum Written<'a, O: GptOps + ?Sized> {
    /// [`GptOps::gelu_forward`] of `x`.
    Gelu(&'a O::Buf),
    /// [`GptOps::heads_split`] of token rows: q, k or v out of `qkv`; the heads' output
    /// gradient out of its rows.
    HeadsSplit(&'a O::Buf, HeadsLayout),
    /// [`GptOps::heads_merge`] of dense heads into whole token rows (the layout's `row` must be
    /// `h·d` and its `offset` 0: every element of the operand is written).
    HeadsMerge(&'a O::Buf, HeadsLayout),
    /// [`GptOps::causal_softmax_forward`]: the probabilities of `scores`.
    CausalSoftmax {
        /// The scores `q·kᵀ`, `[pairs, t, t]`.
        scores: &'a O::Buf,
        /// Tokens per sequence.
        t: usize,
        /// The scores' scale.
        scale: f32,
    },
    /// [`GptOps::causal_softmax_backward`]: the scores' gradient.
    CausalSoftmaxBackward {
        /// The probabilities.
        probs: &'a O::Buf,
        /// Their gradient.
        dprobs: &'a O::Buf,
        /// Tokens per sequence.
        t: usize,
        /// The scores' scale.
        scale: f32,
    },
}

impl<O: GptOps + ?Sized> Written<'_, O> {
    /// The elements of the result.
    ///
    /// # Errors
    /// A [`HeadsMerge`](Written::HeadsMerge) that would leave elements of its rows unwritten.
    pub fn result_len(&self) -> Result<usize, KernelError> {
        Ok(match self {
            Written::Gelu(x) => O::buf_len(x),
            Written::HeadsSplit(_, l) => l.heads_len(),
            Written::HeadsMerge(_, l) => {
                if l.offset != 0 || l.row != l.h * l.d {
                    return Err(KernelError::InvalidArgument {
                        kernel: "heads_merge",
                        reason: format!(
                            "an operand of whole rows needs offset 0 and rows of h·d = {} \
                             elements (offset {}, row {})",
                            l.h * l.d,
                            l.offset,
                            l.row
                        ),
                    });
                }
                l.heads_len()
            }
            Written::CausalSoftmax { scores, .. } => O::buf_len(scores),
            Written::CausalSoftmaxBackward { probs, .. } => O::buf_len(probs),
        })
    }
}

/// `w` computed by the host twins into `y` (f32): what [`HostOps`](super::HostOps) rounds.
pub(super) fn host_f32(w: &Written<'_, super::HostOps>, y: &mut [f32]) -> Result<(), KernelError> {
    match *w {
        Written::Gelu(x) => nn::gelu_forward(x, y),
        Written::HeadsSplit(rows, l) => nn::heads_split(rows, l, y),
        Written::HeadsMerge(heads, l) => nn::heads_merge(heads, l, y),
        Written::CausalSoftmax { scores, t, scale } => {
            nn::causal_softmax_forward(scores, t, scale, y)
        }
        Written::CausalSoftmaxBackward {
            probs,
            dprobs,
            t,
            scale,
        } => nn::causal_softmax_backward(probs, dprobs, t, scale, y),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::{HostOps, HostProducts};

    fn layout(row: usize, offset: usize) -> HeadsLayout {
        HeadsLayout {
            b: 2,
            t: 3,
            h: 2,
            d: 2,
            row,
            offset,
        }
    }

    #[test]
    fn an_operand_is_the_f32_result_or_its_16_bit_rounding() {
        let x: Vec<f32> = (0..24).map(|i| (i as f32 - 11.3) * 0.37).collect();
        let all = [
            HostProducts::F32,
            HostProducts::Bf16Operands,
            HostProducts::F16Operands,
        ];
        for products in all {
            let ops = HostOps::with_products(products);
            let xb = ops.upload(&x).unwrap();
            let mut want = vec![0.0; 24];
            nn::gelu_forward(&x, &mut want).unwrap();
            if let Some(h) = products.half() {
                want = super::super::products::rounded_to(h, &want);
            }
            let before = ops.operand_roundings();
            let got = ops.write_operand(Written::Gelu(&xb)).unwrap();
            assert_eq!(got.to_vec(), want, "{products:?}");
            let rounded = u64::from(products.half().is_some());
            assert_eq!(ops.operand_roundings() - before, rounded);
            // 24 elements of 2 or 4 bytes beside x's 4.
            let op_bytes = if rounded == 1 { 2 } else { 4 };
            assert_eq!(ops.memory().allocated, 24 * 4 + 24 * op_bytes);
        }
    }

    #[test]
    fn a_merge_into_an_operand_must_write_whole_rows() {
        let ops = HostOps::with_products(HostProducts::Bf16Operands);
        let heads = ops.upload(&[1.0; 24]).unwrap();
        assert_eq!(
            Written::<HostOps>::HeadsMerge(&heads, layout(4, 0))
                .result_len()
                .unwrap(),
            24
        );
        for (row, offset) in [(8, 0), (8, 4), (4, 1)] {
            let e = ops
                .write_operand(Written::HeadsMerge(&heads, layout(row, offset)))
                .unwrap_err();
            assert!(e.to_string().contains("whole rows"), "{e}");
        }
    }
}
