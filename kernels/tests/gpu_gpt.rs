//! `DeviceGpt<CudaOps>` (the GPT step on one CUDA stream: the layer kernels and cuBLAS) against
//! `DeviceGpt<HostOps>` (the same model code over the kernels' twins and a plain f32 product)
//! on the same weights and batch.
//!
//! Every non-product kernel equals its twin bitwise (`tests/gpu_nn.rs`), and the permutations
//! and residual adds are exact or bitwise too, so the two differ only by the products'
//! rounding: cuBLAS (f32 compute, no TF32) sums each dot product in its own blocked order, the
//! host left to right. Bounds: the loss within 1e-5 relative, every gradient within
//! `max|gpu − host| ≤ 2e-5·max|host|`. They come from a measurement that runs without a GPU
//! (`the_products_rounding_alone_stays_inside_the_bounds`): the host's f32 products against
//! products accumulated in f64 and rounded once (close to exact; cuBLAS's lie between) change
//! the loss by 0 and the gradients by at most 1.9e-6 of their maxima on these models, and the
//! test keeps that 4× inside the bounds. A wrong product or layout gives errors of order 1.
//! Without a GPU the GPU test prints `skipped: no GPU (<reason>)` and passes.

mod common;

use common::{data, gpu, ids, max_abs, max_abs_diff, weights};
use fsdp_device::Stream;
use fsdp_gpt::model::GptConfig;
use fsdp_kernels::gpt::{
    Attention, CudaMemory, CudaOps, DeviceGpt, GptDims, GptOps, HostOps, HostProducts, Logits,
    Products,
};

fn cuda_ops(test: &str) -> CudaOps {
    let s = Stream::cuda(0, test).expect("a CUDA stream on cuda:0");
    CudaOps::new(s).expect("cuBLAS on the stream")
}

/// Losses within this relative difference.
const LOSS_BOUND: f64 = 1e-5;
/// Gradients within this fraction of their maxima.
const GRAD_BOUND: f64 = 2e-5;

/// The small model, and one wider than a block of 256 threads (`n_embd` 320, vocabulary
/// 1000, t 64): (dims, rows, t).
fn cases() -> [(GptDims, usize, usize); 2] {
    let dims = |n_layer, n_head, n_embd, block_size, vocab_size| GptDims {
        n_layer,
        n_head,
        n_embd,
        block_size,
        vocab_size,
    };
    [
        (dims(2, 2, 32, 16, 64), 2, 16),
        (dims(2, 5, 320, 64, 1000), 2, 64),
    ]
}

/// The case's model on `ops` with the test weights, and its batch (inputs, targets).
fn model<O: GptOps>(ops: O, dims: GptDims, rows: usize, t: usize) -> (DeviceGpt<O>, [Vec<u32>; 2]) {
    let cfg = GptConfig::new(
        dims.n_layer,
        dims.n_head,
        dims.n_embd,
        dims.block_size,
        dims.vocab_size,
    )
    .unwrap();
    let v = dims.vocab_size;
    let batch = [ids(rows * t, 1, v), ids(rows * t, 2, v)];
    (DeviceGpt::new(ops, dims, &weights(&cfg)).unwrap(), batch)
}

/// One step of `model` on the case's batch: the loss and every gradient.
fn run<O: GptOps>(ops: O, dims: GptDims, rows: usize, t: usize) -> (f32, Vec<(String, Vec<f32>)>) {
    run_with(
        ops,
        dims,
        rows,
        t,
        (Attention::default(), Logits::default()),
    )
}

/// [`run`] with the attention's matrices and the logits held as `chunks` says.
fn run_with<O: GptOps>(
    ops: O,
    dims: GptDims,
    rows: usize,
    t: usize,
    chunks: (Attention, Logits),
) -> (f32, Vec<(String, Vec<f32>)>) {
    let (mut model, [x, y]) = model(ops, dims, rows, t);
    model.set_attention(chunks.0);
    model.set_logits(chunks.1);
    let loss = model.step(&x, &y, rows, t).unwrap();
    (loss, model.download_grads().unwrap())
}

/// The loss's relative difference and the worst gradient's difference over its maximum
/// (with its name).
fn differences(
    a: &(f32, Vec<(String, Vec<f32>)>),
    b: &(f32, Vec<(String, Vec<f32>)>),
) -> (f64, f64, String) {
    let rel = f64::from((a.0 - b.0) / b.0).abs();
    let mut worst = (0.0f64, String::new());
    assert_eq!(a.1.len(), b.1.len());
    for ((name, got), (other, r)) in a.1.iter().zip(&b.1) {
        assert_eq!(name, other);
        let max = max_abs(r);
        assert!(max > 0.0, "{name}: a zero gradient tests nothing");
        let err = max_abs_diff(got, r);
        let e = err / max;
        // A NaN difference is the worst (and fails the bounds).
        if e.is_nan() || e > worst.0 {
            worst = (e, name.clone());
        }
    }
    (rel, worst.0, worst.1)
}

/// Runs without a GPU: what the products' rounding alone does (f32 left to right against f64
/// accumulation rounded once, the rest bitwise the same) stays 4× inside the bounds of
/// [`the_cuda_step_matches_the_host_step`], whose products differ from the host's in the same
/// way.
#[test]
fn the_products_rounding_alone_stays_inside_the_bounds() {
    for (dims, rows, t) in cases() {
        let f32_products = run(HostOps::new(), dims, rows, t);
        let wide = run(
            HostOps::with_products(HostProducts::F64Rounded),
            dims,
            rows,
            t,
        );
        let (rel, grad, name) = differences(&f32_products, &wide);
        println!("[{dims:?}] products' rounding: loss {rel:.2e}, gradients {grad:.2e} ({name})");
        assert!(rel <= LOSS_BOUND / 4.0, "loss: {rel:e}");
        assert!(grad <= GRAD_BOUND / 4.0, "{name}: {grad:e}");
        assert!(grad > 0.0, "the two products should differ somewhere");
    }
}

/// What bf16 operands do to the step on the host (printed; the GPU test below asserts that the
/// GPU's bf16 step is this far from the f32 one).
#[test]
fn bf16_operands_move_the_step_on_the_host() {
    for (dims, rows, t) in cases() {
        let f32_products = run(HostOps::new(), dims, rows, t);
        let bf16 = run(
            HostOps::with_products(HostProducts::Bf16Operands),
            dims,
            rows,
            t,
        );
        let (rel, grad, name) = differences(&bf16, &f32_products);
        println!("[{dims:?}] bf16 operands vs f32: loss {rel:.2e}, gradients {grad:.2e} ({name})");
        assert!(
            grad > GRAD_BOUND,
            "bf16 operands should move the gradients: {grad:e}"
        );
        assert!(rel < 1e-2 && grad < 0.1, "loss {rel:e}, {name} {grad:e}");
    }
}

#[test]
fn the_cuda_step_matches_the_host_step() {
    let test = "the_cuda_step_matches_the_host_step";
    if !gpu(test) {
        return;
    }
    for (dims, rows, t) in cases() {
        let host = run(HostOps::new(), dims, rows, t);
        let dev = run(cuda_ops(test), dims, rows, t);
        let (rel, grad, name) = differences(&dev, &host);
        println!(
            "[{dims:?}] GPU vs host: loss {} vs {} ({rel:.2e}), gradients {grad:.2e} ({name})",
            dev.0, host.0
        );
        assert!(rel <= LOSS_BOUND, "loss {} vs {}", dev.0, host.0);
        assert!(grad <= GRAD_BOUND, "{name}: {grad:e} of its maximum");
    }
}

/// Mixed-precision products (`Products::Bf16`) against their twin
/// (`HostProducts::Bf16Operands`): both multiply bf16-rounded operands and sum in f32, in
/// different orders. Rounding to bf16 amplifies those f32 differences: a value near a bf16
/// rounding boundary rounds one way on the GPU and the other on the host, a change of 2⁻⁸
/// relative in one operand, and that propagates through the later layers. So the gradients
/// are held to the scale of bf16 rounding itself: within twice the host's own difference
/// between bf16 and f32 operands (measured on an H100: 2.4e-4 and 6.3e-3 of the maxima,
/// against host differences of 6.3e-3 and 9.4e-3). The loss within 1e-4 relative (measured:
/// 0 and 6.7e-6). And the products must really be bf16: the GPU's step differs from the
/// f32 host step's by more than the f32 bound. f16 products (`Products::F16`, twin
/// `HostProducts::F16Operands`) are held to the same rule against their own host difference.
#[test]
fn the_cuda_step_with_bf16_products_matches_its_twin() {
    let test = "the_cuda_step_with_bf16_products_matches_its_twin";
    if !gpu(test) {
        return;
    }
    let kinds = [
        (Products::Bf16, HostProducts::Bf16Operands),
        (Products::F16, HostProducts::F16Operands),
    ];
    for (dims, rows, t) in cases() {
        for (products, twin) in kinds {
            let host = run(HostOps::with_products(twin), dims, rows, t);
            let f32_host = run(HostOps::new(), dims, rows, t);
            let (_, scale, _) = differences(&host, &f32_host);
            let dev = run(cuda_ops(test).with_products(products), dims, rows, t);
            let (rel, grad, name) = differences(&dev, &host);
            println!(
                "[{dims:?}] GPU {products:?} vs its twin: loss {} vs {} ({rel:.2e}), gradients \
                 {grad:.2e} ({name}); twin vs f32: {scale:.2e}",
                dev.0, host.0
            );
            assert!(rel <= 1e-4, "{products:?}: loss {} vs {}", dev.0, host.0);
            assert!(
                grad <= 2.0 * scale,
                "{products:?}, {name}: {grad:e} of its maximum"
            );
            let (_, apart, _) = differences(&dev, &f32_host);
            assert!(
                apart > GRAD_BOUND,
                "{products:?} products look like f32 ones: {apart:e}"
            );
        }
    }
    // The kept operand copies are reused as the twin reuses them (`tests/operand_copies.rs`
    // checks the twin's count against the model's products).
    let (dims, rows, t) = cases()[0];
    let (mut host, [x, y]) = model(
        HostOps::with_products(HostProducts::Bf16Operands),
        dims,
        rows,
        t,
    );
    let (mut dev, _) = model(cuda_ops(test).with_products(Products::Bf16), dims, rows, t);
    for _ in 0..2 {
        host.step(&x, &y, rows, t).unwrap();
        dev.step(&x, &y, rows, t).unwrap();
    }
    let (casts, roundings) = (dev.ops().operand_casts(), host.ops().operand_roundings());
    println!("bf16 operand casts in two steps: {casts} (the twin rounds {roundings})");
    assert_eq!(casts, roundings);
}

/// The attention in chunks of one (sequence, head) pair and the logits in chunks of 5 tokens
/// — products on parts of buffers (`MatMul::at`: cuBLAS at offset pointers; with bf16
/// products, kept copies of the parts), the cross-entropy on rows of the targets and losses —
/// and both whole, each on CUDA against its twin with the bounds above (the twins of the two
/// agree bitwise but the tied weight's gradient: `tests/attention_chunks.rs`,
/// `tests/logits_chunks.rs`), the bf16 casts counted as the twin counts its roundings.
#[test]
fn chunks_on_cuda_match_their_twins() {
    let test = "chunks_on_cuda_match_their_twins";
    if !gpu(test) {
        return;
    }
    for (dims, rows, t) in cases() {
        let small = (
            Attention::Chunked {
                max_bytes: t * t * 4,
            },
            Logits::Chunked {
                max_bytes: 5 * dims.vocab_size * 4,
            },
        );
        for chunks in [small, (Attention::Materialized, Logits::Whole)] {
            let host = run_with(HostOps::new(), dims, rows, t, chunks);
            let dev = run_with(cuda_ops(test), dims, rows, t, chunks);
            let (rel, grad, name) = differences(&dev, &host);
            println!("[{dims:?}] {chunks:?}: GPU vs host: loss {rel:.2e}, gradients {grad:.2e}");
            assert!(
                rel <= LOSS_BOUND,
                "{chunks:?}: loss {} vs {}",
                dev.0,
                host.0
            );
            assert!(grad <= GRAD_BOUND, "{chunks:?}: {name}: {grad:e}");
            let bf16 = HostOps::with_products(HostProducts::Bf16Operands);
            let host = run_with(bf16, dims, rows, t, chunks);
            let f32_host = run_with(HostOps::new(), dims, rows, t, chunks);
            let (_, scale, _) = differences(&host, &f32_host);
            let ops = cuda_ops(test).with_products(Products::Bf16);
            let dev = run_with(ops, dims, rows, t, chunks);
            let (rel, grad, name) = differences(&dev, &host);
            assert!(
                rel <= 1e-4,
                "{chunks:?}, bf16: loss {} vs {}",
                dev.0,
                host.0
            );
            assert!(grad <= 2.0 * scale, "{chunks:?}, bf16: {name}: {grad:e}");
        }
        let twin = HostOps::with_products(HostProducts::Bf16Operands);
        let (mut host, [x, y]) = model(twin, dims, rows, t);
        let (mut dev, _) = model(cuda_ops(test).with_products(Products::Bf16), dims, rows, t);
        host.set_attention(small.0);
        dev.set_attention(small.0);
        host.set_logits(small.1);
        dev.set_logits(small.1);
        host.step(&x, &y, rows, t).unwrap();
        dev.step(&x, &y, rows, t).unwrap();
        assert_eq!(dev.ops().operand_casts(), host.ops().operand_roundings());
    }
}

/// The optimizer's operations of the device trainer (`fsdp-gpt`'s `DeviceTrainer`): AdamW, the
/// sum of squares and the clipping scale on CUDA equal `HostOps` bitwise (a length that is not
/// a multiple of any block, so the tails run too).
#[test]
fn the_optimizer_ops_match_their_twins_bitwise() {
    use fsdp_kernels::host::{AdamW, AdamWScalars};
    if !gpu("the_optimizer_ops_match_their_twins_bitwise") {
        return;
    }
    fn ops_run<O: GptOps>(ops: &O) -> (Vec<Vec<f32>>, f64) {
        let n = 10_007;
        let up = |seed, scale| ops.upload(&data(n, seed, scale)).unwrap();
        let (mut p, g, mut m, mut v) = (up(1, 1.0), up(2, 0.1), up(3, 0.01), up(4, 0.0));
        let h = AdamW {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        for step in 1..=3 {
            let s = AdamWScalars::new(&h, step).unwrap();
            ops.adamw(&s, &mut p, &g, &mut m, &mut v).unwrap();
        }
        let sq = ops.sum_of_squares(&p).unwrap();
        ops.scale(0.37, &mut p).unwrap();
        let out = [&p, &m, &v].map(|b| ops.download(b).unwrap()).to_vec();
        (out, sq)
    }
    let (host, host_sq) = ops_run(&HostOps::new());
    let (cuda, cuda_sq) = ops_run(&cuda_ops("optimizer_ops"));
    assert_eq!(
        host_sq.to_bits(),
        cuda_sq.to_bits(),
        "{host_sq} vs {cuda_sq}"
    );
    for (name, (h, c)) in ["param", "exp_avg", "exp_avg_sq"]
        .iter()
        .zip(host.iter().zip(&cuda))
    {
        let bad = h
            .iter()
            .zip(c)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(bad, None, "{name}: first difference at {bad:?}");
    }
}

/// Where `CudaOps` takes its buffers from changes nothing the step computes: the device's
/// caching allocator ([`CudaMemory::Caching`], PyTorch's `backend:native`) and the driver's
/// stream-ordered pool ([`CudaMemory::Driver`], `backend:cudaMallocAsync`) give the same loss
/// and gradients bitwise, with f32 and bf16 products.
#[test]
fn the_caching_allocator_and_the_drivers_pool_give_the_same_step() {
    let test = "the_caching_allocator_and_the_drivers_pool_give_the_same_step";
    if !gpu(test) {
        return;
    }
    let alloc = CudaMemory::device_allocator(0).expect("the caching allocator of cuda:0");
    for products in [Products::F32, Products::Bf16] {
        for (dims, rows, t) in cases() {
            let with = |memory: CudaMemory| {
                let s = Stream::cuda(0, test).unwrap();
                let ops = CudaOps::with_memory(s, memory)
                    .unwrap()
                    .with_products(products);
                run(ops, dims, rows, t)
            };
            let cached = with(CudaMemory::Caching(alloc.clone()));
            let driver = with(CudaMemory::Driver);
            assert_eq!(
                cached.0.to_bits(),
                driver.0.to_bits(),
                "{products:?} {dims:?}: loss"
            );
            for ((name, a), (_, b)) in cached.1.iter().zip(&driver.1) {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{products:?} {dims:?}: {name} differs");
            }
        }
    }
}

/// The caching allocator serves a steady step from its cache: after two warm-up steps, later
/// steps reserve nothing new from the device (no `cuMemAlloc`: `num_device_alloc` and the
/// reserved bytes stay), hold the same bytes between steps (nothing leaks), and every buffer's
/// block goes back when the model and its operations are dropped. Its peak of allocated bytes
/// covers the counted peak (each counted buffer is one block, rounded up to 512 bytes) within
/// 5%. A fresh allocator of its own, so that no other test's cache is counted.
#[test]
fn the_caching_allocator_serves_steady_steps_from_its_cache() {
    let test = "the_caching_allocator_serves_steady_steps_from_its_cache";
    if !gpu(test) {
        return;
    }
    let source = fsdp_allocator::cuda::CudaSource::new(0).unwrap();
    let alloc = fsdp_allocator::cuda::CudaAllocator::new(source, Default::default()).unwrap();
    let (dims, rows, t) = cases()[1];
    let s = Stream::cuda(0, test).unwrap();
    let ops = CudaOps::with_memory(s, CudaMemory::Caching(alloc.clone()))
        .unwrap()
        .with_products(Products::Bf16);
    let (mut model, [x, y]) = model(ops, dims, rows, t);
    let mut after = Vec::new();
    for _ in 0..4 {
        model.step(&x, &y, rows, t).unwrap();
        model.ops().stream().synchronize().unwrap();
        let st = alloc.memory_stats();
        after.push((
            st.num_device_alloc,
            st.reserved_bytes.all.current,
            st.allocated_bytes.all.current,
        ));
    }
    println!("{test}: (cuMemAlloc calls, reserved, allocated) after each step: {after:?}");
    assert_eq!(after[2], after[1], "the third step reserved or kept more");
    assert_eq!(after[3], after[1], "the fourth step reserved or kept more");
    let counted = model.ops().memory().peak;
    let peak = model.ops().pool_memory().unwrap().peak;
    assert!(peak >= counted, "allocator peak {peak} < counted {counted}");
    assert!(
        (peak - counted) as f64 <= 0.05 * counted as f64,
        "allocator peak {peak} vs counted {counted}"
    );
    assert_eq!(alloc.memory_stats().num_alloc_retries, 0);
    drop(model);
    let st = alloc.memory_stats();
    assert_eq!(st.allocated_bytes.all.current, 0, "blocks not given back");
    assert!(st.reserved_bytes.all.current > 0, "the cache is kept");
}
