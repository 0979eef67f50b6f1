//! The fused attention (`Attention::Fused`, flash attention's algorithm) in a GPT step on the
//! host twins, against the attention that keeps its probabilities (`Attention::Materialized`)
//! with the same 16-bit products: the loss and every gradient within the rounding the two
//! forms apply at different points, with and without activation checkpointing; f32 products
//! refused by name; and the memory: no `t × t` matrix at all, forward keeping one
//! log-sum-exp per row.

mod common;

use fsdp_kernels::gpt::{Attention, DeviceGpt, GptOps, HostOps, HostProducts};

/// The loss, every gradient, and the step's counted peak.
type Stepped = (f32, Vec<(String, Vec<f32>)>, u64);

/// One step of the case's model with `attention`: [`Stepped`], or the error's text.
fn step(
    products: HostProducts,
    attention: Attention,
    ckpt: bool,
    cfg: &fsdp_gpt::model::GptConfig,
    rows: usize,
) -> Result<Stepped, String> {
    let dims = common::dims(cfg);
    let t = cfg.block_size;
    let ops = HostOps::with_products(products);
    let mut model = DeviceGpt::new(ops, dims, &common::weights(cfg)).unwrap();
    model.set_attention(attention);
    model.set_activation_checkpointing(ckpt);
    let inputs = common::ids(rows * t, 1, cfg.vocab_size);
    let targets = common::ids(rows * t, 2, cfg.vocab_size);
    model.ops().reset_peak();
    let loss = model
        .step(&inputs, &targets, rows, t)
        .map_err(|e| e.to_string())?;
    let grads = model.download_grads().unwrap();
    Ok((loss, grads, model.ops().memory().peak))
}

#[test]
fn fused_attention_tracks_the_materialized_step() {
    let cfg = fsdp_gpt::model::GptConfig::new(2, 3, 24, 16, 64).unwrap();
    let rows = 3;
    let mut worst = [0.0f64; 2];
    for products in [HostProducts::Bf16Operands, HostProducts::F16Operands] {
        let (loss, grads, _) = step(products, Attention::Materialized, false, &cfg, rows).unwrap();
        for ckpt in [false, true] {
            let (l, g, _) = step(products, Attention::Fused, ckpt, &cfg, rows).unwrap();
            let what = format!("{products:?}, checkpointing {ckpt}");
            // The two forms round the probabilities at different points (the materialized
            // form P = e/Σe, the fused one e before dividing by Σe) and the scores' gradient
            // from different rowsums (Σ P·dP against dO·y with y an operand), each within half
            // a 16-bit unit (2⁻⁹ for bf16) of the same value. The loss moves by far less; a
            // gradient by a few units of its largest value at most.
            let dl = f64::from((l - loss).abs()) / f64::from(loss.abs());
            assert!(dl < 1e-3, "{what}: the loss {l} against {loss}");
            worst[0] = worst[0].max(dl);
            for ((name, a), (_, b)) in g.iter().zip(&grads) {
                let scale = common::max_abs(b).max(1e-12);
                let d = common::max_abs_diff(a, b) / scale;
                assert!(
                    d < 2e-2,
                    "{what}: {name}'s gradient differs by {d:e} of its largest"
                );
                worst[1] = worst[1].max(d);
            }
            // Checkpointing computes the same forward again: bitwise the run without.
            if ckpt {
                let (l0, g0, _) = step(products, Attention::Fused, false, &cfg, rows).unwrap();
                assert_eq!(l.to_bits(), l0.to_bits(), "{what}");
                for ((name, a), (_, b)) in g.iter().zip(&g0) {
                    assert_eq!(common::bits(a), common::bits(b), "{what}: {name}");
                }
            }
        }
    }
    println!(
        "fused against materialized: loss {:.2e} (relative), gradients {:.2e} (of their largest)",
        worst[0], worst[1]
    );
    // Not the same computation: the test would not notice if the fused form were not used.
    assert!(worst[1] > 0.0);
}

#[test]
fn f32_products_are_refused_by_name() {
    let cfg = fsdp_gpt::model::GptConfig::new(1, 2, 16, 8, 32).unwrap();
    let err = step(HostProducts::F32, Attention::Fused, false, &cfg, 2).unwrap_err();
    assert!(
        err.contains("fused attention reads bf16 or f16 operands"),
        "{err}"
    );
}

#[test]
fn fused_attention_keeps_no_t_by_t_matrix() {
    // t² dominates: 16 (sequence, head) pairs of 64 × 64 scores, 16 KiB each.
    let cfg = fsdp_gpt::model::GptConfig::new(3, 4, 16, 64, 32).unwrap();
    let rows = 4;
    let pair = 64 * 64 * 4;
    let products = HostProducts::Bf16Operands;
    let (_, _, kept) = step(products, Attention::Materialized, false, &cfg, rows).unwrap();
    let one = Attention::Chunked { max_bytes: pair };
    let (_, _, chunked) = step(products, one, false, &cfg, rows).unwrap();
    let (_, _, fused) = step(products, Attention::Fused, false, &cfg, rows).unwrap();
    // Materialized, backward starts holding every block's probabilities (16 pairs each); a
    // chunk of one pair holds at most three pair matrices (f32) at once, the fused form none,
    // at the cost of each block's log-sum-exp (16 pairs · 64 rows · 4 bytes) kept from
    // forward: at most that over the chunked peak.
    let all = (16 * pair) as u64;
    let lse = (3 * 16 * 64 * 4) as u64;
    assert!(
        fused <= chunked + lse,
        "fused {fused} B, chunked by one pair {chunked} B"
    );
    assert!(
        fused + 3 * all <= kept,
        "fused {fused} B, materialized {kept} B"
    );
    println!("peak: materialized {kept} B, chunked by one pair {chunked} B, fused {fused} B");
}
