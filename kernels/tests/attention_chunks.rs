//! The attention in chunks of (sequence, head) pairs, its probabilities computed again in
//! backward (`Attention::Chunked`), against the attention that keeps them
//! (`Attention::Materialized`) on the host twins: the same loss and gradients bit for bit —
//! every pair is its own product and softmax, so chunks change no sum's order, and backward's
//! probabilities are forward's — at chunks that divide the pairs and chunks that do not, with
//! f32 and bf16 products and with activation checkpointing; and the memory it saves: no
//! block keeps its `t × t` probabilities.

mod common;

use fsdp_kernels::gpt::{Attention, DeviceGpt, GptOps, HostOps, HostProducts};

/// The loss and every gradient's bits, and the step's counted peak.
fn step(
    products: HostProducts,
    attention: Attention,
    ckpt: bool,
    cfg: &fsdp_gpt::model::GptConfig,
    rows: usize,
) -> (u32, Vec<(String, Vec<u32>)>, u64) {
    let dims = common::dims(cfg);
    let t = cfg.block_size;
    let ops = HostOps::with_products(products);
    let mut model = DeviceGpt::new(ops, dims, &common::weights(cfg)).unwrap();
    model.set_attention(attention);
    model.set_activation_checkpointing(ckpt);
    let inputs = common::ids(rows * t, 1, cfg.vocab_size);
    let targets = common::ids(rows * t, 2, cfg.vocab_size);
    model.ops().reset_peak();
    let loss = model.step(&inputs, &targets, rows, t).unwrap();
    let grads = model
        .download_grads()
        .unwrap()
        .into_iter()
        .map(|(name, g)| (name, common::bits(&g)))
        .collect();
    (loss.to_bits(), grads, model.ops().memory().peak)
}

#[test]
fn chunked_attention_gives_the_materialized_bits() {
    let cfg = fsdp_gpt::model::GptConfig::new(2, 3, 24, 16, 64).unwrap();
    let (rows, t) = (3, cfg.block_size);
    // 9 (sequence, head) pairs: chunks of 1, 4 (4 + 4 + 1) and all of them.
    let pair = t * t * 4;
    for products in [
        HostProducts::F32,
        HostProducts::Bf16Operands,
        HostProducts::F16Operands,
    ] {
        for ckpt in [false, true] {
            let (loss, grads, _) = step(products, Attention::Materialized, ckpt, &cfg, rows);
            for max_bytes in [1, 4 * pair + 3, 9 * pair, usize::MAX] {
                let chunked = Attention::Chunked { max_bytes };
                let (l, g, _) = step(products, chunked, ckpt, &cfg, rows);
                let what = format!("{products:?}, checkpointing {ckpt}, {chunked:?}");
                assert_eq!(l, loss, "{what}: the loss");
                for ((name, a), (_, b)) in g.iter().zip(&grads) {
                    assert_eq!(a, b, "{what}: {name}'s gradient");
                }
            }
        }
    }
}

#[test]
fn chunks_keep_no_probabilities() {
    // t² dominates: 16 (sequence, head) pairs of 64 × 64 scores, 16 KiB each.
    let cfg = fsdp_gpt::model::GptConfig::new(3, 4, 16, 64, 32).unwrap();
    let rows = 4;
    let pair = 64 * 64 * 4;
    let (_, _, kept) = step(
        HostProducts::F32,
        Attention::Materialized,
        false,
        &cfg,
        rows,
    );
    let one = Attention::Chunked { max_bytes: pair };
    let (_, _, chunked) = step(HostProducts::F32, one, false, &cfg, rows);
    // Materialized, backward starts holding every block's probabilities (16 pairs each) and
    // the last block's backward adds two more sets (their gradient and the scores'); a
    // chunk of one pair holds three pair matrices at most, besides q, k and v's gradients.
    let all = (16 * pair) as u64;
    assert!(
        kept >= chunked + 3 * all,
        "materialized {kept} B, chunked {chunked} B"
    );
    assert_eq!(
        Attention::Chunked { max_bytes: pair }.chunk_pairs(64, 16),
        1
    );
    assert_eq!(Attention::default().chunk_pairs(1024, 96), 16);
    assert_eq!(Attention::default().chunk_pairs(1024, 8), 8);
    assert_eq!(Attention::Materialized.chunk_pairs(1024, 96), 96);
}
