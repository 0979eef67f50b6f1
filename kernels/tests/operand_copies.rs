//! The kept bf16 copies of the products' operands (`HostProducts::Bf16Operands`, the twin of
//! `CudaOps` with `Products::Bf16`): a product reuses a copy only when its operand in that
//! position is the buffer the copy was rounded from, unwritten since. A write of any kind
//! (an operation's output, `fill_zero`, `upload_into`, a mutable borrow) makes it round again,
//! so reuse never changes a result: checked against `gemm_bf16_operands` of the values at the
//! time of each product, and the count of roundings of one GPT step against the closed form
//! of the model's products.

mod common;

use common::{data, ids, weights};
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gemm::MatMul;
use fsdp_kernels::gpt::{
    gemm_bf16_operands, Attention, DeviceGpt, GptDims, GptOps, HostOps, HostProducts, Logits,
};

fn product(ops: &HostOps, g: &MatMul, a: &[f32], b: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (da, db) = (ops.upload(a).unwrap(), ops.upload(b).unwrap());
    let mut c = ops.zeros(g.m * g.n).unwrap();
    ops.gemm(g, &da, &db, &mut c).unwrap();
    let mut want = vec![0.0; g.m * g.n];
    gemm_bf16_operands(g, a, b, &mut want).unwrap();
    (c.to_vec(), want)
}

#[test]
fn a_kept_copy_is_reused_only_for_its_unwritten_source() {
    let ops = HostOps::with_products(HostProducts::Bf16Operands);
    let g = MatMul::new(3, 4, 5, false, false);
    let (a0, b0) = (data(15, 1, 1.0), data(20, 2, 1.0));
    let (a, b) = (ops.upload(&a0).unwrap(), ops.upload(&b0).unwrap());
    let mut c = ops.zeros(12).unwrap();
    let check = |a: &[f32], b: &[f32], c: &[f32]| {
        let mut want = vec![0.0; 12];
        gemm_bf16_operands(&g, a, b, &mut want).unwrap();
        assert_eq!(c, &want[..]);
    };
    ops.gemm(&g, &a, &b, &mut c).unwrap();
    check(&a0, &b0, &c);
    assert_eq!(ops.operand_roundings(), 2);
    // The same two buffers, unwritten: both copies are reused.
    ops.gemm(&g, &a, &b, &mut c).unwrap();
    check(&a0, &b0, &c);
    assert_eq!(ops.operand_roundings(), 2);
    // `a` written by an operation: rounded again, and the product sees its new values; `b`
    // only read by one: its copy is still reused.
    let mut a = a;
    ops.axpby(1.0, &b, 0.0, &mut ops.zeros(20).unwrap())
        .unwrap();
    ops.scale(0.5, &mut a).unwrap();
    let half: Vec<f32> = a0.iter().map(|x| x * 0.5).collect();
    ops.gemm(&g, &a, &b, &mut c).unwrap();
    check(&half, &b0, &c);
    assert_eq!(ops.operand_roundings(), 3);
    // Written through a mutable borrow, by `fill_zero` and by `upload_into`.
    a[0] = 7.0;
    let mut seven = half.clone();
    seven[0] = 7.0;
    ops.gemm(&g, &a, &b, &mut c).unwrap();
    check(&seven, &b0, &c);
    let mut b = b;
    ops.fill_zero(&mut b).unwrap();
    ops.gemm(&g, &a, &b, &mut c).unwrap();
    check(&seven, &[0.0; 20], &c);
    ops.upload_into(&b0, &mut b).unwrap();
    ops.gemm(&g, &a, &b, &mut c).unwrap();
    check(&seven, &b0, &c);
    assert_eq!(ops.operand_roundings(), 6);
    // Another buffer with the same values, and the operands in swapped positions (a square
    // product): each is rounded into its position's copy.
    let a2 = ops.upload(&seven).unwrap();
    ops.gemm(&g, &a2, &b, &mut c).unwrap();
    check(&seven, &b0, &c);
    assert_eq!(ops.operand_roundings(), 7);
    let sq = MatMul::new(4, 4, 4, false, false);
    let (x0, y0) = (data(16, 3, 1.0), data(16, 4, 1.0));
    let (x, y) = (ops.upload(&x0).unwrap(), ops.upload(&y0).unwrap());
    let mut z = ops.zeros(16).unwrap();
    ops.gemm(&sq, &x, &y, &mut z).unwrap();
    ops.gemm(&sq, &y, &x, &mut z).unwrap();
    let mut want = vec![0.0; 16];
    gemm_bf16_operands(&sq, &y0, &x0, &mut want).unwrap();
    assert_eq!(z.to_vec(), want);
    assert_eq!(ops.operand_roundings(), 11);
    // A buffer dropped and another made in its place never passes for it.
    drop(x);
    let (p, want) = product(&ops, &sq, &data(16, 5, 1.0), &y0);
    assert_eq!(p, want);
}

#[test]
fn one_gpt_step_rounds_each_operand_once_per_run_of_products() {
    // The results that only products read are operands (rounded once, when written): per
    // block h1, q, k, v, y, h2, gelu's output and the heads' output gradient dYh (8), and
    // each attention chunk's probabilities in forward and its scores' gradient dS (2 a
    // chunk). The products round the four weights in forward and in backward (8), each
    // chunk's probabilities again in backward (1: `dv`'s product reads them as a buffer),
    // and the four dY of the linear backward (4): 20 + 3·c per block for c attention chunks
    // (the probabilities kept: 23, as one chunk). The head: ln_f's output (1), wte once (it
    // stays in its position's copy across chunks), each chunk's dlogits (1): 2 + chunks.
    let t = 8;
    let whole = Logits::Whole;
    // 16 tokens of a vocabulary of 32 in chunks of 5 tokens: 4 chunks.
    let four = Logits::Chunked {
        max_bytes: 5 * 32 * 4 + 3,
    };
    for (attention, logits, head, per_block) in [
        (Attention::Materialized, whole, 3, 23),
        (Attention::default(), Logits::default(), 3, 23),
        // Fused: no probabilities or scores' gradient as operands, none rounded again.
        (Attention::Fused, whole, 3, 20),
        // 4 (sequence, head) pairs, 2 a chunk.
        (
            Attention::Chunked {
                max_bytes: 2 * t * t * 4,
            },
            four,
            2 + 4,
            20 + 3 * 2,
        ),
    ] {
        for n_layer in [1, 2, 3] {
            let dims = GptDims {
                n_layer,
                n_head: 2,
                n_embd: 16,
                block_size: t,
                vocab_size: 32,
            };
            let cfg = GptConfig::new(n_layer, 2, 16, t, 32).unwrap();
            let ops = HostOps::with_products(HostProducts::Bf16Operands);
            let mut model = DeviceGpt::new(ops, dims, &weights(&cfg)).unwrap();
            model.set_attention(attention);
            model.set_logits(logits);
            let (x, y) = (ids(16, 1, 32), ids(16, 2, 32));
            model.step(&x, &y, 2, t).unwrap();
            assert_eq!(
                model.ops().operand_roundings(),
                head + per_block * n_layer as u64,
                "{n_layer} layers, {attention:?}, {logits:?}"
            );
        }
    }
}
