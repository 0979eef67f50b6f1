//! A GPT step with `Attention::Fused` on CUDA (`DeviceGpt<CudaOps>`, bf16 and f16 products)
//! against the same step on the host twins. The two differ by the products' summation order
//! (cuBLAS's and the tensor cores') and the 16-bit roundings that order moves, so the bound is
//! the one `gpu_gpt.rs` holds bf16 products to: the loss within 1e-4 relative, each gradient
//! within twice what the 16-bit products themselves change on the twins (16-bit fused
//! against f32 materialized attention), with activation checkpointing as well.

use common::{gpu, ids, max_abs, max_abs_diff, weights};
use fsdp_device::Stream;
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gpt::{
    Attention, CudaOps, DeviceGpt, GptDims, GptOps, HostOps, HostProducts, Products,
};

use super::common;

type Step = (f32, Vec<(String, Vec<f32>)>);

/// Heads of 64 values (GPT-2's), `t` of one tile and a part.
fn dims() -> GptDims {
    GptDims {
        n_layer: 2,
        n_head: 5,
        n_embd: 320,
        block_size: 80,
        vocab_size: 1000,
    }
}

fn step<O: GptOps>(ops: O, attention: Attention, ckpt: bool) -> Step {
    let d = dims();
    let cfg = GptConfig::new(d.n_layer, d.n_head, d.n_embd, d.block_size, d.vocab_size).unwrap();
    let (rows, t) = (3, d.block_size);
    let mut model = DeviceGpt::new(ops, d, &weights(&cfg)).unwrap();
    model.set_attention(attention);
    model.set_activation_checkpointing(ckpt);
    let (x, y) = (
        ids(rows * t, 1, d.vocab_size),
        ids(rows * t, 2, d.vocab_size),
    );
    let loss = model.step(&x, &y, rows, t).unwrap();
    (loss, model.download_grads().unwrap())
}

/// The loss's relative difference and the worst gradient's over its maximum.
fn differences(a: &Step, b: &Step) -> (f64, f64) {
    let rel = f64::from((a.0 - b.0) / b.0).abs();
    let worst =
        a.1.iter()
            .zip(&b.1)
            .map(|((_, g), (_, r))| max_abs_diff(g, r) / max_abs(r).max(1e-30))
            .fold(0.0f64, |m, e| if e.is_nan() || e > m { e } else { m });
    (rel, worst)
}

#[test]
fn the_fused_cuda_step_tracks_its_twin() {
    let test = "the_fused_cuda_step_tracks_its_twin";
    if !gpu(test) {
        return;
    }
    let f32_host = step(HostOps::new(), Attention::Materialized, false);
    for (products, twin) in [
        (Products::Bf16, HostProducts::Bf16Operands),
        (Products::F16, HostProducts::F16Operands),
    ] {
        let host = step(HostOps::with_products(twin), Attention::Fused, false);
        let (_, scale) = differences(&host, &f32_host);
        for ckpt in [false, true] {
            let s = Stream::cuda(0, test).expect("a CUDA stream on cuda:0");
            let ops = CudaOps::new(s).expect("cuBLAS").with_products(products);
            let dev = step(ops, Attention::Fused, ckpt);
            let (rel, grad) = differences(&dev, &host);
            println!(
                "{products:?}, checkpointing {ckpt}: loss {rel:.2e}, gradients {grad:.2e} \
                 (16-bit products' own effect {scale:.2e})"
            );
            assert!(rel <= 1e-4, "{products:?}: loss {} vs {}", dev.0, host.0);
            assert!(grad <= 2.0 * scale, "{products:?}: gradients {grad:e}");
        }
    }
}
