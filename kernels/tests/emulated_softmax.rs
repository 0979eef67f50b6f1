//! The softmaxes' CUDA source (`cu/nn_softmax.cu` of `Program::Nn`) run on the host
//! (`common::emulator`: the program as NVRTC compiles it, a block's threads as host threads,
//! a warp's shuffles through barriers), each launched as its launcher launches it
//! (`launch::plan`: the same kernels, grids, parameters and offsets), against its twin
//! (`host::nn`, `host::nn_loss`) **bitwise**, as `tests/gpu_nn.rs` holds them on a GPU:
//! causal_softmax_forward in f32 and written as its bf16 and f16 roundings,
//! causal_softmax_forward_both (f32 and its bf16 or f16 rounding in one pass),
//! causal_softmax_backward in f32, bf16 and f16; cross_entropy_fused writing an f32, bf16 or
//! f16 gradient, and the f32 kernel given one buffer for the logits and their gradient
//! (`launch::cross_entropy_fused_in_place`), each under a grad scaler's seed read from a
//! step's scalars, and without one (the launcher's null `const double* s`).
//!
//! Shapes: sequences shorter than a warp and longer than one or two (5, 33, 70: none a
//! multiple of 32), row counts that leave the last block's warps partly idle; vocabularies
//! below a block of 256 threads and past two (100, 300, 700). The attention's chunks of
//! (sequence, head) pairs are launched as a view of the whole buffers from a pair past the
//! first, and the head's chunk of rows as `gpt/cuda.rs` launches it (its own logits, the
//! targets and losses from row `first` on): elements outside the chunk must stay as they were.
//! Scores and probabilities above the diagonal are NaN or infinite (never read), some causal
//! scores -inf (a row of them: a NaN row), one large; targets 0, `v − 1`, `v` and `u32::MAX`
//! (the last two: a NaN loss and a NaN row of the gradient), a target whose logit is -inf;
//! outputs start as a sentinel so that an element left unwritten shows.
//!
//! What this cannot check: the hardware itself (`tests/gpu_nn.rs` does, on a GPU).

mod common;

use common::data;
use common::emulator::{addr, bytes_of, values_of, Emulator};
use fsdp_kernels::host::nn::{self};
use fsdp_kernels::host::{self, f32_to_bf16, f32_to_f16};
use fsdp_kernels::launch::plan;
use fsdp_kernels::Program;
use half::{bf16, f16};

/// What outputs start as (f32, and its bf16 and f16 bits): an element a kernel leaves
/// unwritten keeps it, a value no twin gives here.
const SENTINEL: f32 = -7.25;
const SENTINEL_BF16: u16 = 0xC0E8;
const SENTINEL_F16: u16 = 0xC740;

/// The attention's scale, `1/√head_dim` for a head of 8 (`tests/gpu_nn.rs`).
fn attention_scale() -> f32 {
    1.0 / 8.0f32.sqrt()
}

/// Equal bits, element by element (the emulator computes on the twin's host: NaNs alike).
#[track_caller]
fn same_bits<T: Copy + PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "{what} [{i}]: emulated kernel vs twin");
    }
}

/// f32 values as bits, for [`same_bits`].
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `whole` elements of which `range` holds `inner` and the rest `outside`.
fn framed<T: Copy>(whole: usize, range: std::ops::Range<usize>, inner: &[T], outside: T) -> Vec<T> {
    let mut v = vec![outside; whole];
    v[range].copy_from_slice(inner);
    v
}

/// Scores of `pairs` `t × t` matrices (`tests/gpu_nn.rs`'s), with what a causal softmax must
/// handle: NaN and infinities above the diagonal (never read), a causal row holding -inf
/// (probability 0 there), a whole causal row of -inf (a NaN row: max and value both -inf),
/// and a large score (the rest of its row underflows).
fn scores(pairs: usize, t: usize) -> Vec<f32> {
    let mut s = data(pairs * t * t, 21, 20.0);
    above_diagonal(&mut s, t);
    let last = (pairs * t - 1) * t; // the last row of the last matrix
    s[last] = f32::NEG_INFINITY;
    s[last + t / 2] = f32::NEG_INFINITY;
    if pairs > 1 {
        s[t * t] = f32::NEG_INFINITY; // row 0 of matrix 1: its only causal score
    }
    s[(t - 1) * t + t / 3] = 1.0e4; // the last row of matrix 0
    s
}

/// NaN, +inf and -inf in turn above each matrix's diagonal.
fn above_diagonal(v: &mut [f32], t: usize) {
    for (r, row) in v.chunks_exact_mut(t).enumerate() {
        for (j, x) in row.iter_mut().enumerate().skip(r % t + 1) {
            *x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(r + j) % 3];
        }
    }
}

/// Every softmax kernel over the pairs `first..first + count` of `pairs` `t × t` matrices,
/// launched as its launcher launches it given views of the whole buffers from pair `first`
/// (the attention's chunk of (sequence, head) pairs); the twins over the same slices. Outside
/// the chunk the outputs keep their sentinel.
fn softmax_case(emu: &Emulator, pairs: usize, t: usize, first: usize, count: usize) {
    let what = format!("{pairs}x{t}x{t}, pairs {first}..{}", first + count);
    let scale = attention_scale();
    let whole = pairs * t * t;
    let range = first * t * t..(first + count) * t * t;
    let rows = count * t;
    let sc = scores(pairs, t);
    // Backward's inputs: the twin's probabilities (a backward reads the forward's f32 ones)
    // and a gradient, both with garbage above the diagonal.
    let mut p_in = vec![0.0; whole];
    nn::causal_softmax_forward(&sc, t, scale, &mut p_in).unwrap();
    above_diagonal(&mut p_in, t);
    let mut dp = data(whole, 22, 1.0);
    above_diagonal(&mut dp, t);

    let mut p = vec![0.0; rows * t];
    nn::causal_softmax_forward(&sc[range.clone()], t, scale, &mut p).unwrap();
    let mut ds = vec![0.0; rows * t];
    let (pc, dpc) = (&p_in[range.clone()], &dp[range.clone()]);
    nn::causal_softmax_backward(pc, dpc, t, scale, &mut ds).unwrap();

    let f32_out = || bytes_of(&vec![SENTINEL; whole]);
    let mut bufs = vec![
        bytes_of(&sc),                         // 0 scores
        bytes_of(&p_in),                       // 1 probabilities (backward)
        bytes_of(&dp),                         // 2 their gradient
        f32_out(),                             // 3 p, f32
        bytes_of(&vec![SENTINEL_BF16; whole]), // 4 p, bf16
        bytes_of(&vec![SENTINEL_F16; whole]),  // 5 p, f16
        f32_out(),                             // 6 p (both, bf16)
        bytes_of(&vec![SENTINEL_BF16; whole]), // 7 its bf16 rounding
        f32_out(),                             // 8 p (both, f16)
        bytes_of(&vec![SENTINEL_F16; whole]),  // 9 its f16 rounding
        f32_out(),                             // 10 ds, f32
        bytes_of(&vec![SENTINEL_BF16; whole]), // 11 ds, bf16
        bytes_of(&vec![SENTINEL_F16; whole]),  // 12 ds, f16
    ];
    // A view from pair `first`: the buffer's address plus the chunk's offset in its elements.
    let at = |buf: usize, elem: usize| addr(buf) + (range.start * elem) as u64;
    let launches = [
        plan::causal_softmax_forward::<f32>(at(0, 4), t, scale, at(3, 4), rows),
        plan::causal_softmax_forward::<bf16>(at(0, 4), t, scale, at(4, 2), rows),
        plan::causal_softmax_forward::<f16>(at(0, 4), t, scale, at(5, 2), rows),
        plan::causal_softmax_forward_both::<bf16>(at(0, 4), t, scale, at(6, 4), at(7, 2), rows),
        plan::causal_softmax_forward_both::<f16>(at(0, 4), t, scale, at(8, 4), at(9, 2), rows),
        plan::causal_softmax_backward::<f32>(at(1, 4), at(2, 4), t, scale, at(10, 4), rows),
        plan::causal_softmax_backward::<bf16>(at(1, 4), at(2, 4), t, scale, at(11, 2), rows),
        plan::causal_softmax_backward::<f16>(at(1, 4), at(2, 4), t, scale, at(12, 2), rows),
    ]
    .map(Result::unwrap)
    .concat();
    assert_eq!(launches.len(), 8, "one launch a kernel");
    emu.run_plan(&mut bufs, &launches);

    let (p_bf16, p_f16): (Vec<u16>, Vec<u16>) = (
        p.iter().map(|&x| f32_to_bf16(x)).collect(),
        p.iter().map(|&x| f32_to_f16(x)).collect(),
    );
    let (ds_bf16, ds_f16): (Vec<u16>, Vec<u16>) = (
        ds.iter().map(|&x| f32_to_bf16(x)).collect(),
        ds.iter().map(|&x| f32_to_f16(x)).collect(),
    );
    let f32_want = |v: &[f32]| bits(&framed(whole, range.clone(), v, SENTINEL));
    let bf16_want = |v: &[u16]| framed(whole, range.clone(), v, SENTINEL_BF16);
    let f16_want = |v: &[u16]| framed(whole, range.clone(), v, SENTINEL_F16);
    let f32_got = |b: &[u8]| bits(&values_of::<f32>(b));
    for (k, got, want) in [
        ("forward_f32", f32_got(&bufs[3]), f32_want(&p)),
        ("forward_both_bf16 p", f32_got(&bufs[6]), f32_want(&p)),
        ("forward_both_f16 p", f32_got(&bufs[8]), f32_want(&p)),
        ("backward_f32", f32_got(&bufs[10]), f32_want(&ds)),
    ] {
        same_bits(&format!("causal_softmax_{k}, {what}"), &got, &want);
    }
    for (k, buf, want) in [
        ("forward_bf16", 4, bf16_want(&p_bf16)),
        ("forward_f16", 5, f16_want(&p_f16)),
        ("forward_both_bf16 rounding", 7, bf16_want(&p_bf16)),
        ("forward_both_f16 rounding", 9, f16_want(&p_f16)),
        ("backward_bf16", 11, bf16_want(&ds_bf16)),
        ("backward_f16", 12, f16_want(&ds_f16)),
    ] {
        let got: Vec<u16> = values_of(&bufs[buf]);
        same_bits(&format!("causal_softmax_{k}, {what}"), &got, &want);
    }
}

/// Every softmax kernel over whole buffers: a sequence shorter than a warp and one longer
/// than two (neither a multiple of 32), with the last block's warps partly past the rows (35
/// and 140 rows: 3 and 4 of 8 warps busy).
#[test]
fn causal_softmax_kernels_are_their_twins() {
    let Some(emu) = Emulator::build(Program::Nn, "causal_softmax_kernels_are_their_twins") else {
        return;
    };
    for (pairs, t) in [(7usize, 5usize), (2, 70)] {
        softmax_case(emu, pairs, t, 0, pairs);
    }
}

/// The attention's chunks of (sequence, head) pairs, two pairs a chunk of 5 pairs of 33 × 33
/// (longer than a warp): each kernel given views from pair 2 (a middle chunk, 66 rows) and
/// from pair 4 (the last, shorter one, 33 rows), the last block partly idle.
#[test]
fn causal_softmax_kernels_on_a_chunk_of_pairs_are_their_twins() {
    let Some(emu) = Emulator::build(
        Program::Nn,
        "causal_softmax_kernels_on_a_chunk_of_pairs_are_their_twins",
    ) else {
        return;
    };
    softmax_case(emu, 5, 33, 2, 2);
    softmax_case(emu, 5, 33, 4, 1);
}

/// Logits of `n` rows of `v` (`tests/gpu_nn.rs`'s) and targets, with the edges: row 0 all
/// equal, row 4 with -inf logits (its target's among them: an infinite loss), row 5 large
/// (its exponentials underflow but the max's); targets 0, `v − 1`, `v` and, in the last row,
/// `u32::MAX` (out of range: NaN).
fn logits_and_targets(n: usize, v: usize) -> (Vec<f32>, Vec<u32>) {
    assert!(n >= 7);
    let mut logits = data(n * v, 31, 15.0);
    logits[..v].fill(0.5);
    let mut targets: Vec<u32> = (0..n).map(|r| (r * 7919 % v) as u32).collect();
    targets[1] = 0;
    targets[2] = v as u32 - 1;
    targets[3] = v as u32;
    targets[n - 1] = u32::MAX;
    let row4 = &mut logits[4 * v..5 * v];
    for j in (0..v).step_by(3) {
        row4[j] = f32::NEG_INFINITY;
    }
    row4[targets[4] as usize] = f32::NEG_INFINITY;
    for x in &mut logits[5 * v..6 * v] {
        *x *= 700.0;
    }
    (logits, targets)
}

/// Every cross-entropy kernel over the rows `first..first + r` of `n` rows of `v`, as
/// `gpt/cuda.rs` launches a chunk of the head's rows: the chunk's own logits, the targets and
/// losses as views from row `first`; under a grad scaler at each of `scales` (the seed `1/n`
/// times the scale read from the step's scalars), or without one (`None`: the launcher passes
/// a null pointer for the scalars and the seed is `1/n`). The f32 kernel runs apart and in place
/// (`launch::cross_entropy_fused_in_place`: one buffer for the logits and their gradient).
fn cross_entropy_case(
    emu: &Emulator,
    n: usize,
    v: usize,
    first: usize,
    r: usize,
    scales: &[Option<f32>],
) {
    let what = format!("{n}x{v}, rows {first}..{}", first + r);
    let (all, targets) = logits_and_targets(n, v);
    let logits = &all[first * v..(first + r) * v];
    let tc = &targets[first..first + r];
    let dloss = 1.0 / n as f32;
    for &scale in scales {
        let scalars = host::step_scalars(0, scale.map(|s| (s, 0, 0)));
        let seed = host::scaled_seed("cross_entropy", dloss, scale.map(|_| &scalars[..])).unwrap();
        let (mut loss, mut d) = (vec![0.0; r], vec![0.0; r * v]);
        nn::cross_entropy_fused(logits, tc, v, seed, &mut loss, &mut d).unwrap();
        let (mut in_place, mut loss_ip) = (logits.to_vec(), vec![0.0; r]);
        nn::cross_entropy_fused_in_place(&mut in_place, tc, v, seed, &mut loss_ip).unwrap();
        let nan_rows = tc.iter().filter(|&&t| t as usize >= v).count();
        assert_eq!(loss.iter().filter(|l| l.is_nan()).count(), nan_rows);

        let losses = || bytes_of(&vec![SENTINEL; n]);
        let mut bufs = vec![
            bytes_of(logits),                      // 0 logits
            bytes_of(&targets),                    // 1 targets (all rows)
            bytes_of(&scalars),                    // 2 the step's scalars
            losses(),                              // 3 losses (f32 gradient)
            bytes_of(&vec![SENTINEL; r * v]),      // 4 gradient, f32
            bytes_of(logits),                      // 5 logits, then their gradient
            losses(),                              // 6 losses (in place)
            losses(),                              // 7 losses (bf16 gradient)
            bytes_of(&vec![SENTINEL_BF16; r * v]), // 8 gradient, bf16
            losses(),                              // 9 losses (f16 gradient)
            bytes_of(&vec![SENTINEL_F16; r * v]),  // 10 gradient, f16
        ];
        // Targets and losses from row `first`; the step's scalars, or a null pointer.
        let row = |buf: usize| addr(buf) + (first * 4) as u64;
        let s = if scale.is_some() { addr(2) } else { 0 };
        let launches = [
            plan::cross_entropy_fused::<f32>(addr(0), row(1), v, dloss, s, row(3), addr(4), r),
            plan::cross_entropy_fused_in_place(addr(5), row(1), v, dloss, s, row(6), r),
            plan::cross_entropy_fused::<bf16>(addr(0), row(1), v, dloss, s, row(7), addr(8), r),
            plan::cross_entropy_fused::<f16>(addr(0), row(1), v, dloss, s, row(9), addr(10), r),
        ]
        .map(Result::unwrap)
        .concat();
        assert_eq!(launches.len(), 4, "one launch a kernel");
        emu.run_plan(&mut bufs, &launches);

        let what = format!("{what}, loss scale {scale:?}");
        let loss_want = |l: &[f32]| bits(&framed(n, first..first + r, l, SENTINEL));
        let got = |b: usize| bits(&values_of::<f32>(&bufs[b]));
        for (k, buf, want) in [
            ("cross_entropy_fused_f32 losses", 3, loss_want(&loss)),
            ("cross_entropy_fused_f32 dlogits", 4, bits(&d)),
            (
                "in-place cross_entropy_fused_f32 losses",
                6,
                loss_want(&loss_ip),
            ),
            (
                "in-place cross_entropy_fused_f32 dlogits",
                5,
                bits(&in_place),
            ),
            ("cross_entropy_fused_bf16 losses", 7, loss_want(&loss)),
            ("cross_entropy_fused_f16 losses", 9, loss_want(&loss)),
        ] {
            same_bits(&format!("{k}, {what}"), &got(buf), &want);
        }
        let d_bf16: Vec<u16> = d.iter().map(|&x| f32_to_bf16(x)).collect();
        let d_f16: Vec<u16> = d.iter().map(|&x| f32_to_f16(x)).collect();
        let got16 = |b: usize| values_of::<u16>(&bufs[b]);
        same_bits(
            &format!("cross_entropy_fused_bf16 dlogits, {what}"),
            &got16(8),
            &d_bf16,
        );
        same_bits(
            &format!("cross_entropy_fused_f16 dlogits, {what}"),
            &got16(10),
            &d_f16,
        );
    }
}

/// Every cross-entropy kernel over all rows: a vocabulary below a block (100: threads past it
/// idle in the reductions) under a grad scaler at 2^16 and at 1 and without one, and past two
/// blocks' strides (700 = 2·256 + 188) at 1000 (not a power of two) and without one.
#[test]
fn cross_entropy_kernels_are_their_twins() {
    let Some(emu) = Emulator::build(Program::Nn, "cross_entropy_kernels_are_their_twins") else {
        return;
    };
    cross_entropy_case(emu, 7, 100, 0, 7, &[Some(65536.0), Some(1.0), None]);
    cross_entropy_case(emu, 8, 700, 0, 8, &[Some(1000.0), None]);
}

/// The head's chunk of rows (`Logits::Chunked`): rows 3..7 of 9 (the target `v` among them,
/// `u32::MAX` past them), then the last chunk, rows 7..9, of a vocabulary of 300.
#[test]
fn cross_entropy_kernels_on_a_chunk_of_rows_are_their_twins() {
    let Some(emu) = Emulator::build(
        Program::Nn,
        "cross_entropy_kernels_on_a_chunk_of_rows_are_their_twins",
    ) else {
        return;
    };
    cross_entropy_case(emu, 9, 300, 3, 4, &[Some(1000.0)]);
    cross_entropy_case(emu, 9, 300, 7, 2, &[Some(65536.0), None]);
}

/// The emulator refuses a launch as a GPU does: a block past the kernel's
/// `__launch_bounds__` (the softmaxes declare `NN_BLOCK`), a grid past 65,535 in y, and an
/// empty grid — so a launcher planning such a launch fails here rather than on a GPU. On a GPU
/// (`FSDP_EMULATED_ON=cuda`) the driver refuses each.
#[test]
fn launches_a_gpu_refuses_are_refused() {
    let Some(emu) = Emulator::build(Program::Nn, "launches_a_gpu_refuses_are_refused") else {
        return;
    };
    let (pairs, t) = (1usize, 8usize);
    let good = plan::causal_softmax_forward::<f32>(addr(0), t, 0.5, addr(1), pairs * t).unwrap();
    let refused = |mutate: &dyn Fn(&mut cudarc::driver::LaunchConfig), why: &str| {
        let mut launches = good.clone();
        mutate(&mut launches[0].config);
        let mut bufs = vec![bytes_of(&scores(pairs, t)), vec![0; 4 * pairs * t * t]];
        let msg = emu.run_plan_refused(&mut bufs, &launches, why);
        // On a GPU (FSDP_EMULATED_ON=cuda) the driver refuses the launch in its own words.
        let why = if emu.on_cuda() { "enqueueing" } else { why };
        assert!(msg.contains(why), "{why}: {msg}");
    };
    let block = nn::NN_BLOCK as u32;
    refused(
        &|c| c.block_dim.0 = 2 * block,
        &format!("past its __launch_bounds__({block})"),
    );
    refused(&|c| c.grid_dim.1 = 65536, "at most 2^31 - 1 x 65535");
    refused(&|c| c.grid_dim.0 = 0, "an empty grid");
    // The plan itself runs.
    let mut bufs = vec![bytes_of(&scores(pairs, t)), vec![0; 4 * pairs * t * t]];
    emu.run_plan(&mut bufs, &good);
    let probs: Vec<f32> = values_of(&bufs[1]);
    assert!(probs.iter().all(|p| p.is_finite()));
}
