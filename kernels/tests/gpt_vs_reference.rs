//! `DeviceGpt<HostOps>` (the GPT step over the kernels' twins and a plain f32 product) against
//! the CPU reference GPT (`fsdp_gpt::model::forward_backward`, matched to PyTorch by that
//! crate's golden tests), with the same weights and batch, on 2 layers, 2 heads, `n_embd` 32,
//! vocabulary 64, batches 2×16 and 3×5: the loss within 1e-6 relative and every parameter's
//! gradient within `max|host − ref| ≤ 1e-5·max|ref|`. Measured: the losses are equal and the
//! worst gradient is 1.3e-6 of its maximum (the twins' own e^x, ln and erfc, their reduction
//! orders, and attention's scale applied in the softmax rather than the product).

mod common;

use common::{data, ids, max_abs, max_abs_diff, weights};
use fsdp_gpt::data::Batch;
use fsdp_gpt::model::{forward_backward, param_specs, zeros_like_params, BatchShape, GptConfig};
use fsdp_kernels::gpt::{param_shapes, DeviceGpt, GptDims, GptOps, HostOps};

fn config() -> (GptConfig, GptDims) {
    let cfg = GptConfig::new(2, 2, 32, 16, 64).unwrap();
    let dims = GptDims {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        vocab_size: 64,
    };
    (cfg, dims)
}

#[test]
fn the_parameter_names_and_shapes_are_the_reference_gpts() {
    let (cfg, dims) = config();
    let want: Vec<(String, Vec<usize>)> = param_specs(&cfg)
        .into_iter()
        .map(|s| (s.name, s.shape))
        .collect();
    assert_eq!(param_shapes(&dims), want);
}

#[test]
fn loss_and_every_gradient_match_the_reference_gpt() {
    let (cfg, dims) = config();
    let params = weights(&cfg);
    let mut model = DeviceGpt::new(HostOps::new(), dims, &params).unwrap();
    for (case, (rows, t)) in [(2usize, 16usize), (3, 5)].into_iter().enumerate() {
        let n = rows * t;
        let batch = Batch {
            inputs: ids(n, 1 + case as u64, 64),
            targets: ids(n, 11 + case as u64, 64),
            shape: BatchShape { rows, seq_len: t },
        };
        let mut want = zeros_like_params(&cfg);
        let want_loss = forward_backward(&cfg, &params, &mut want, &batch, n).unwrap();
        let loss = model.step(&batch.inputs, &batch.targets, rows, t).unwrap();
        let rel = ((loss - want_loss) / want_loss).abs();
        println!("[{rows}x{t}] loss {loss} vs reference {want_loss}: relative {rel:.2e}");
        assert!(rel <= 1e-6, "loss {loss} vs {want_loss}");
        assert!(want_loss > 3.0, "a loss near ln 64 ≈ 4.16: {want_loss}");
        let grads = model.download_grads().unwrap();
        assert_eq!(grads.len(), want.len());
        let mut worst = (0.0f64, String::new());
        for (name, got) in &grads {
            let r = &want[name];
            assert_eq!(got.len(), r.len(), "{name}");
            let max = max_abs(r);
            assert!(max > 0.0, "{name}: a zero reference gradient tests nothing");
            let err = max_abs_diff(got, r);
            let e = err / max;
            assert!(e <= 1e-5, "{name}: max error {err:e} vs max |grad| {max:e}");
            if e > worst.0 {
                worst = (e, name.clone());
            }
        }
        println!(
            "[{rows}x{t}] worst gradient error relative to its max: {:.2e} ({})",
            worst.0, worst.1
        );
    }
}

#[test]
fn a_step_overwrites_the_gradients() {
    let (cfg, dims) = config();
    let mut model = DeviceGpt::new(HostOps::new(), dims, &weights(&cfg)).unwrap();
    let (x, y) = (ids(32, 3, 64), ids(32, 4, 64));
    let l1 = model.step(&x, &y, 2, 16).unwrap();
    let g1 = model.download_grads().unwrap();
    let l2 = model.step(&x, &y, 2, 16).unwrap();
    assert_eq!(l1.to_bits(), l2.to_bits());
    assert_eq!(g1, model.download_grads().unwrap());
}

#[test]
fn bad_inputs_are_errors() {
    let (cfg, dims) = config();
    let params = weights(&cfg);
    let mut model = DeviceGpt::new(HostOps::new(), dims, &params).unwrap();
    let ok = ids(16, 5, 64);
    let mut bad = ok.clone();
    bad[3] = 64;
    let msg = |r: Result<f32, fsdp_kernels::KernelError>| r.unwrap_err().to_string();
    assert!(msg(model.step(&bad, &ok, 1, 16)).contains("inputs holds id 64"));
    assert!(msg(model.step(&ok, &bad, 1, 16)).contains("targets holds id 64"));
    assert!(msg(model.step(&ok, &ok, 2, 16)).contains("inputs has 16 ids, expected 2×16"));
    assert!(msg(model.step(&ok[..15], &ok, 1, 16)).contains("inputs has 15 ids"));
    let long = ids(17, 6, 64);
    assert!(msg(model.step(&long, &long, 1, 17)).contains("at most 16"));
    let mut missing = params.clone();
    missing.remove("transformer.h.1.mlp.c_fc.bias");
    let e = DeviceGpt::new(HostOps::new(), dims, &missing)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("transformer.h.1.mlp.c_fc.bias"),
        "{e}"
    );
    let mut short = params;
    short.insert("transformer.wpe.weight".into(), vec![0.0; 3]);
    let e = DeviceGpt::new(HostOps::new(), dims, &short).err().unwrap();
    assert!(e.to_string().contains("has 3 elements"), "{e}");
}

/// The device trainer's optimizer operations on `HostOps` against their definitions: `scale`
/// is `c·y` rounded once (bitwise the engine's `*g *= c`), `sum_of_squares` the f64 sum of the
/// squares (within f64 rounding), `adamw` the twin `host::adamw`.
#[test]
fn the_optimizer_ops_on_the_host_are_their_definitions() {
    use fsdp_kernels::host::{adamw, AdamW, AdamWScalars};
    let ops = HostOps::new();
    let y0 = data(5000, 9, 3.0);
    let mut y = ops.upload(&y0).unwrap();
    ops.scale(0.3, &mut y).unwrap();
    for (a, b) in y0.iter().zip(y.iter()) {
        assert_eq!((a * 0.3).to_bits(), b.to_bits(), "{a}");
    }
    let naive: f64 = y0.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let sq = ops.sum_of_squares(&ops.upload(&y0).unwrap()).unwrap();
    assert!((sq - naive).abs() <= 1e-12 * naive, "{sq} vs {naive}");
    let h = AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let s = AdamWScalars::new(&h, 2).unwrap();
    let g = data(5000, 10, 0.5);
    let (mut p2, mut m2, mut v2) = (y0.clone(), vec![0.1f32; 5000], vec![0.2f32; 5000]);
    let up = |v: &[f32]| ops.upload(v).unwrap();
    let (mut p1, mut m1, mut v1) = (up(&p2), up(&m2), up(&v2));
    ops.adamw(&s, &mut p1, &up(&g), &mut m1, &mut v1).unwrap();
    adamw::<f32>(&s, &mut p2, &g, &mut m2, &mut v2).unwrap();
    assert_eq!((&*p1, &*m1, &*v1), (&p2, &m2, &v2));
    assert!(ops
        .adamw(&s, &mut up(&[0.0; 3]), &up(&g), &mut m1, &mut v1)
        .is_err());
}

/// `HostOps` counts the bytes of the buffers it hands out while they live (4 an element), and
/// with bf16 products the two operand copies it keeps (2 an element, grown to the largest
/// operand, the short copy freed first), as `CudaOps` does; `scale` holds the old and the new
/// buffer at once. The bf16 products through the kept copies are `gemm_bf16_operands`' bits.
#[test]
fn host_ops_count_their_device_memory() {
    use fsdp_kernels::gemm::MatMul;
    use fsdp_kernels::gpt::{gemm_bf16_operands, HostProducts, MemoryUse};
    let ops = HostOps::new();
    let a = ops.zeros(100).unwrap();
    let ids = ops.upload_ids(&[1, 2, 3]).unwrap();
    assert_eq!(
        ops.memory(),
        MemoryUse {
            allocated: 412,
            peak: 412
        }
    );
    let mut b = ops.upload(&data(50, 1, 1.0)).unwrap();
    ops.scale(0.5, &mut b).unwrap();
    assert_eq!(
        ops.memory(),
        MemoryUse {
            allocated: 612,
            peak: 812
        }
    );
    drop((a, ids));
    ops.reset_peak();
    assert_eq!(
        ops.memory(),
        MemoryUse {
            allocated: 200,
            peak: 200
        }
    );
    drop(b);
    let ops = HostOps::with_products(HostProducts::Bf16Operands);
    let (x, y) = (data(6 * 4, 2, 1.0), data(4 * 5, 3, 1.0));
    let (xd, yd) = (ops.upload(&x).unwrap(), ops.upload(&y).unwrap());
    let mut c = ops.zeros(6 * 5).unwrap();
    let g = MatMul::new(6, 5, 4, false, false);
    ops.gemm(&g, &xd, &yd, &mut c).unwrap();
    let mut want = vec![0.0f32; 30];
    gemm_bf16_operands(&g, &x, &y, &mut want).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&c), bits(&want));
    // 74 f32 buffers, kept copies of 24 and 20 bf16 elements.
    assert_eq!(ops.memory().allocated, 74 * 4 + (24 + 20) * 2);
    // A smaller product reuses them; a larger first operand replaces its copy.
    let g2 = MatMul::new(2, 5, 4, false, false);
    ops.gemm(
        &g2,
        &ops.upload(&x[..8]).unwrap(),
        &yd,
        &mut ops.zeros(10).unwrap(),
    )
    .unwrap();
    assert_eq!(ops.memory().allocated, 74 * 4 + (24 + 20) * 2);
    let big = ops.upload(&data(12 * 4, 4, 1.0)).unwrap();
    let g3 = MatMul::new(12, 5, 4, false, false);
    ops.gemm(&g3, &big, &yd, &mut ops.zeros(60).unwrap())
        .unwrap();
    assert_eq!(ops.memory().allocated, (74 + 48) * 4 + (48 + 20) * 2);
    // Peak: the 60-element output and both kept copies, the short one freed before the new.
    assert_eq!(ops.memory().peak, (74 + 48 + 60) * 4 + (48 + 20) * 2);
}
