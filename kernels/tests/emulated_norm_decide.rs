//! The norm kernels' and the step decisions' CUDA source run on the host
//! (`common::emulator`: the programs as NVRTC compiles them, a block's threads as host
//! threads), each launched with its launcher's grid and parameters, against its twin bitwise
//! (every twin here is documented bitwise, and so are the GPU tests `tests/gpu.rs` and
//! `tests/gpu_step.rs`):
//! - `sum_squares_f32` then `sum_f64_final` (`launch::sum_of_squares`, `src/launch/mod.rs`) on
//!   lengths of one element, around a block's chunk (4096) and past 256 blocks, so that the
//!   final block's threads sum several block sums each; `host::sum_of_squares`.
//! - `sum_squares_many` then `sum_f64_final_many` (`launch::sum_of_squares_many`,
//!   `src/launch/foreach.rs`) on 100 tensors of different lengths, empty ones among them (at a
//!   batch's start and end and in runs), in two batches (96, then 4) that reuse the block
//!   sums, with the `SquaresList` passed by value as the plan lays it out; and a batch of
//!   empty tensors alone (the first launch left out); each tensor's slot
//!   `host::sum_of_squares` of it, the slots around untouched.
//! - `loss_accumulate` (`launch::loss_accumulate`, `src/launch/step.rs`) over micro-batches of
//!   1 … 100 003 losses, first or not, with the scalars fed back; `host::loss_accumulate`.
//! - `clip_coefficient` (`launch::clip_coefficient`) on norms below, at and above the limit,
//!   zero, infinite and NaN, limits of 0, `+∞` and NaN; `host::clip_coefficient`.
//! - `step_decide` (`launch::step_decide`) over runs of steps whose scalars carry over (the
//!   kernel's output fed back), compared with `host::step_decide` after each: clipping taken
//!   and not and a limit of 0, no clipping, NaN and f32-overflowing losses, infinite and NaN
//!   norms, non-finite steps skipped without limit and halting past a limit of 0, 1 or 2, the
//!   bookkeeping fault (a base the count is not within), the grad scaler's growth (its
//!   interval of 1, 2 and 3, a growth past f32's range not applied), backoff and reset, with
//!   power-of-two and other scales and factors; slots past the rule's tensors hold NaN.
//! - `engine_decide` (`launch::engine_decide`, `engine_decide_buffers` in `step_buffers.rs`)
//!   likewise, with the scaler, the non-finite rule (`guard`, the loss's address the sharded
//!   part's without it, as the launcher passes it), both and neither, taken and skipped steps
//!   (`take`), sharded and replicated parts each infinite or NaN, and faults.
//!
//! Each is launched as its launcher launches it (`launch::plan`: the same kernels, grids,
//! parameters and offsets); the last three on one block of one thread.
//!
//! What this cannot check is the hardware itself (its f64 rounding, its scheduling of blocks):
//! `tests/gpu.rs` and `tests/gpu_step.rs` do, on a GPU.

mod common;

use common::emulator::{addr, bytes_of, values_of, Emulator};
use fsdp_kernels::host::{
    self, EngineDecision, NonfiniteRule, ScalerRule, StepRule, NORM_BLOCK, NORM_ITEMS, STEP_COUNT,
    STEP_LOSS, STEP_SQUARES,
};
use fsdp_kernels::launch::{plan, SQUARES_TENSORS};
use fsdp_kernels::Program;

/// Bitwise equality of f64 values (NaNs' payloads too).
fn assert_bits(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what} [{i}]: {g:?} ({:#x}), the twin {w:?} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// `n` gradient-like values: uniform in ±3 times powers of two from 2^-20 to 2^20, so that
/// their squares' sum rounds differently in another order.
fn grads(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed ^ 0x5eed;
    common::data(n, seed, 3.0)
        .into_iter()
        .map(|v| {
            let e = (common::splitmix64(&mut s) % 41) as i32 - 20;
            v * 2f32.powi(e)
        })
        .collect()
}

/// The elements one block of the first pass sums (`NORM_BLOCK · NORM_ITEMS`, as
/// `launch::sum_of_squares` and `sum_of_squares_many` chunk them).
const CHUNK: usize = NORM_BLOCK * NORM_ITEMS;

/// Uninitialised device memory as the launchers allocate it: a pattern that is a NaN as f64.
fn garbage(len_f64: usize) -> Vec<u8> {
    vec![0xAB; len_f64 * 8]
}

/// `launch::sum_of_squares` (`plan::sum_of_squares`): `sum_squares_f32` on
/// `n.div_ceil(CHUNK)` blocks of `NORM_BLOCK` threads into the block sums, then
/// `sum_f64_final` on one block into `out[0]`; for no elements a fill of `out` with 0 (an
/// element-wise kernel, not run here).
#[test]
fn sum_of_squares_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Norm, "sum_of_squares_is_its_twin") else {
        return;
    };
    let mut order_matters = false;
    // One element, one partial block, a block's chunk and one past it, several blocks with a
    // ragged tail, and 258 blocks (the final block's threads 0 and 1 sum two block sums each).
    for (k, n) in [
        1usize,
        17,
        4095,
        4096,
        4097,
        3 * CHUNK + 123,
        257 * CHUNK + 77,
    ]
    .into_iter()
    .enumerate()
    {
        let mut x = grads(n, 81 + k as u64);
        if k == 2 {
            // An infinity in the middle of a chunk: the sum is +inf.
            x[1000] = f32::NEG_INFINITY;
        }
        let want = host::sum_of_squares(&x);
        let naive = x
            .iter()
            .fold(0.0f64, |a, &v| a + f64::from(v) * f64::from(v));
        order_matters |= naive.to_bits() != want.to_bits();
        let blocks = plan::sum_of_squares_blocks(n).unwrap();
        assert_eq!(blocks, n.div_ceil(CHUNK));
        let mut bufs = vec![bytes_of(&x), garbage(blocks), garbage(1)];
        let launches = plan::sum_of_squares(addr(0), n, addr(1), addr(2)).unwrap();
        assert_eq!(launches.len(), 2);
        emu.run_plan(&mut bufs, &launches);
        assert_bits(
            &values_of(&bufs[2]),
            &[want],
            &format!("sum of squares of {n}"),
        );
    }
    let empty = plan::sum_of_squares(addr(0), 0, addr(1), addr(2)).unwrap();
    let kernels: Vec<&str> = empty.iter().map(|l| l.kernel.as_str()).collect();
    assert_eq!(kernels, ["memset_b64"]);
    assert!(
        order_matters,
        "the inputs sum to the same bits in any order: they would not tell the orders apart"
    );
}

/// `launch::sum_of_squares_many` (`plan::sum_of_squares_many`) of `xs` into
/// `scalars[first..]`: per batch of `SQUARES_TENSORS`, `sum_squares_many` on the batch's
/// blocks (left out when it has none) and `sum_f64_final_many` on one block per tensor, both
/// of `NORM_BLOCK` threads, the block sums reused from their start by every batch. Returns
/// the scalars.
fn squares_many(emu: &Emulator, xs: &[Vec<f32>], first: usize, scalars: Vec<f64>) -> Vec<f64> {
    let blocks = plan::sum_of_squares_many_blocks(xs.iter().map(Vec::len)).unwrap();
    // The largest batch's blocks: every batch reuses the sums from their start (the canaries
    // around the buffer fail a batch that writes past it).
    let most = xs
        .chunks(SQUARES_TENSORS)
        .map(|b| b.iter().map(|x| x.len().div_ceil(CHUNK)).sum::<usize>())
        .max()
        .unwrap_or(0);
    assert_eq!(blocks, most);
    // Buffers: the scalars, the block sums (at least one element, uninitialised), the tensors.
    let mut bufs = vec![bytes_of(&scalars), garbage(blocks.max(1))];
    bufs.extend(xs.iter().map(|x| bytes_of(x)));
    let tensors: Vec<(u64, usize)> = xs
        .iter()
        .enumerate()
        .map(|(t, x)| (addr(2 + t), x.len()))
        .collect();
    let launches = plan::sum_of_squares_many(&tensors, addr(1), addr(0), first).unwrap();
    let batches = xs.len().div_ceil(SQUARES_TENSORS);
    let firsts = launches
        .iter()
        .filter(|l| l.kernel == "sum_squares_many")
        .count();
    assert_eq!(launches.len() - firsts, batches, "a final launch a batch");
    emu.run_plan(&mut bufs, &launches);
    values_of(&bufs[0])
}

/// 100 tensors (a batch of 96, then 4) of lengths from 0 to 3 chunks and a few elements into
/// consecutive slots, and 3 empty tensors alone: each slot bitwise its tensor's twin, the
/// slots around untouched.
#[test]
fn sum_of_squares_many_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Norm, "sum_of_squares_many_is_its_twin") else {
        return;
    };
    // Empty tensors first, in a run, last of the first batch; tensors of a chunk and around
    // it, several chunks with a ragged tail; the rest short and of many lengths. The second
    // batch holds a tensor of several blocks, after the first batch's block sums.
    let lens: Vec<usize> = (0..100)
        .map(|i| match i {
            0 | 40 | 41 | 42 | 95 | 97 => 0,
            1 => 1,
            2 => 4095,
            3 => 4096,
            4 => 4097,
            5 => 2 * CHUNK + 255,
            43 => 8191,
            96 => 3 * CHUNK + 5,
            _ => (i * 37) % 300 + 1,
        })
        .collect();
    let xs: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| grads(n, 100 + i as u64))
        .collect();
    let first = 3;
    let sentinel = -7.0f64;
    let got = squares_many(emu, &xs, first, vec![sentinel; first + xs.len() + 2]);
    let mut want = vec![sentinel; first + xs.len() + 2];
    for (i, x) in xs.iter().enumerate() {
        want[first + i] = host::sum_of_squares(x);
    }
    assert_bits(&got, &want, "sum_of_squares_many: the slots");

    // One batch of empty tensors: no first launch; every slot 0.
    let empty = vec![Vec::new(); 3];
    let none = plan::sum_of_squares_many(&[(addr(2), 0); 3], addr(1), addr(0), 1).unwrap();
    let kernels: Vec<&str> = none.iter().map(|l| l.kernel.as_str()).collect();
    assert_eq!(kernels, ["sum_f64_final_many"]);
    assert!(plan::sum_of_squares_many(&[], addr(1), addr(0), 0)
        .unwrap()
        .is_empty());
    let got = squares_many(emu, &empty, 1, vec![sentinel; 5]);
    assert_bits(
        &got,
        &[sentinel, 0.0, 0.0, 0.0, sentinel],
        "three empty tensors",
    );
}

/// Micro-batches of 1 to 100 003 losses (below, at and past a block; many a thread), of
/// accumulations of 1, 3, 7…, first or not, with the kernel's scalars fed back; an infinite
/// loss, then a NaN one, each ending with a new step (`plan::loss_accumulate` over buffers
/// [losses, scalars]: one block of `NORM_BLOCK` threads). No losses, or none accumulated,
/// are refused.
#[test]
fn loss_accumulate_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Norm, "loss_accumulate_is_its_twin") else {
        return;
    };
    let mut want = host::step_scalars(0, None);
    let mut got = want.clone();
    let steps: [(usize, u32, bool); 10] = [
        (1, 3, true),
        (255, 3, false),
        (256, 3, false),
        (257, 1, true),
        (8192, 7, true),
        (100_003, 7, false),
        (700, 2, true),
        (31, 2, false),
        (3, 5, true),
        (513, 5, false),
    ];
    for (m, (n, accum, first)) in steps.into_iter().enumerate() {
        let mut losses: Vec<f32> = common::data(n, 90 + m as u64, 1.0)
            .iter()
            .map(|x| x.abs() * 11.0)
            .collect();
        match m {
            6 => losses[699] = f32::INFINITY,
            7 => losses[5] = f32::NAN,
            _ => {}
        }
        host::loss_accumulate(&losses, accum, first, &mut want).unwrap();
        let mut bufs = vec![bytes_of(&losses), bytes_of(&got)];
        let launches = plan::loss_accumulate(addr(0), n, accum, first, addr(1)).unwrap();
        assert_eq!(launches[0].config.block_dim.0, NORM_BLOCK as u32);
        emu.run_plan(&mut bufs, &launches);
        got = values_of(&bufs[1]);
        assert_bits(
            &got,
            &want,
            &format!("loss_accumulate step {m}: {n} losses"),
        );
    }
    assert!(want[STEP_LOSS].is_finite(), "the last step starts anew");
    assert!(plan::loss_accumulate(addr(0), 0, 3, true, addr(1)).is_err());
    assert!(plan::loss_accumulate(addr(0), 5, 0, true, addr(1)).is_err());
}

/// `clip_coefficient` (one thread, as `launch::clip_coefficient`) on norms below, at and
/// above `max_norm`, zero, infinite and NaN (a negative sum too), and limits of 0, `+∞` and
/// NaN: both outputs bitwise the twin's.
#[test]
fn clip_coefficient_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Norm, "clip_coefficient_is_its_twin") else {
        return;
    };
    let cases = [
        // The GPU test's.
        (0.25, 0.5, 1.0),
        (3.0, 1.0, 1.0),
        (0.5, 0.5, 1.0),
        (1e6, 2.5, 0.05),
        (f64::INFINITY, 0.0, 1.0),
        (f64::NAN, 1.0, 1.0),
        (4.0, 5.0, f64::INFINITY),
        // Norm 1 against 1: the 1e-6 makes it clip by a hair; a coefficient that rounds.
        (1.0, -0.0, 1.0),
        (0.7, 0.0011, 0.3),
        (0.0, 0.0, 1.0),
        (0.0, 0.0, 0.0),
        (9.0, 0.0, 0.0),
        (-1.0, 0.0, 1.0),
        (1.0, f64::NAN, 1.0),
        (1e308, 1e308, 1.0),
        (2.0, 2.0, f64::NAN),
    ];
    for (sharded, replicated, max_norm) in cases {
        let want = host::clip_coefficient(sharded, replicated, max_norm);
        let mut bufs = vec![bytes_of(&[sharded]), bytes_of(&[replicated]), garbage(2)];
        let launches = plan::clip_coefficient(addr(0), addr(1), max_norm, addr(2));
        emu.run_plan(&mut bufs, &launches);
        let what = format!("clip_coefficient({sharded}, {replicated}, {max_norm})");
        assert_bits(&values_of(&bufs[2]), &want, &what);
    }
}

/// The base steps of a decision with the count `count`: `count - back` (the choice `back`
/// when it is 0 or 1; past the choices, or a base above the count, a fault).
fn base_of(count: f64, back: i64) -> u64 {
    (count as i64 - back).max(0) as u64
}

fn scaler(growth_factor: f64, backoff_factor: f64, growth_interval: u32) -> ScalerRule {
    ScalerRule {
        growth_factor,
        backoff_factor,
        growth_interval,
    }
}

/// One step of a run: (its squares' scale, an odd tensor's squares, loss, max_norm, the base
/// steps back from the count).
type Step = (f64, Option<f64>, f64, Option<f64>, i64);

/// A run's rule: its scaler, the scaler's state at the start (scale, tracker, skips), the
/// skip limit.
type Run = (Option<ScalerRule>, Option<(f32, u32, u64)>, Option<u64>);

/// `step_decide` over runs of 16 steps whose scalars carry over, every rule and scaler: each
/// step's scalars bitwise the twin's (`plan::step_decide`: one thread, the rule's `None`s as
/// -1 — no clipping, no skip limit — or, without a scaler, its three settings 0).
#[test]
fn step_decide_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "step_decide_is_its_twin") else {
        return;
    };
    let tensors = 5;
    let inf = f64::INFINITY;
    let steps: [Step; 16] = [
        // Clipped; not clipped (choice 0, then 1); no clipping asked.
        (4.0, None, 2.5, Some(1.0), 0),
        (0.01, None, 2.4, Some(1.0), 0),
        (0.02, None, 2.3, Some(1.0), 1),
        (7.0, None, 2.3, None, 0),
        // A NaN loss; an infinite norm; a NaN norm (a tensor's squares NaN).
        (0.03, None, f64::NAN, Some(1.0), 0),
        (0.03, Some(inf), 2.2, Some(1.0), 1),
        (0.04, Some(f64::NAN), 2.2, None, 0),
        // A limit of 0 clips to 0; a fault (the count past the choices), a base above it.
        (0.05, None, 2.1, Some(0.0), 0),
        (0.05, None, 2.1, Some(1.0), 2),
        (0.05, None, 2.1, Some(1.0), -1),
        // A loss finite in f64 that overflows f32; an infinite norm and a NaN loss at once.
        (0.06, None, 1e39, Some(1.0), 0),
        (0.06, Some(inf), f64::NAN, Some(1.0), 0),
        // Applied steps in a row (the scaler's growth), clipped and not.
        (3.0, None, 2.0, Some(1.0), 0),
        (0.07, None, 1.9, Some(1.0), 1),
        (0.08, None, 1.9, Some(0.5), 0),
        (0.09, None, 1.8, None, 0),
    ];
    let configs: [Run; 7] = [
        // No scaler: halting past one non-finite step, or never.
        (None, None, Some(1)),
        (None, None, None),
        // A power-of-two scale growing every 2 steps; halting at the third non-finite step.
        (Some(scaler(2.0, 0.5, 2)), Some((65536.0, 0, 0)), Some(2)),
        // Not a power of two, growing every step, skips already counted; halting at once.
        (Some(scaler(2.0, 0.5, 1)), Some((1000.0, 0, 3)), Some(0)),
        // Growth past f32's range is not applied.
        (
            Some(scaler(2.0, 0.5, 1)),
            Some((f32::MAX / 1.5, 0, 0)),
            None,
        ),
        // Factors that round, an interval of 3 with a tracker already at 1.
        (Some(scaler(3.0, 0.3, 3)), Some((1000.5, 1, 0)), Some(3)),
        (Some(scaler(1.5, 0.75, 2)), Some((0.3, 0, 0)), None),
    ];
    for (c, (rule_scaler, start, skip)) in configs.into_iter().enumerate() {
        // Two slots past the rule's tensors hold NaN: the kernel must not read them.
        let mut want = host::step_scalars(tensors + 2, start);
        want[STEP_SQUARES + tensors] = f64::NAN;
        want[STEP_SQUARES + tensors + 1] = f64::NAN;
        let mut got = want.clone();
        for (k, (sq, odd, loss, max_norm, back)) in steps.into_iter().enumerate() {
            let rule = StepRule {
                tensors,
                max_norm,
                skip_nonfinite: skip,
                base_steps: base_of(want[STEP_COUNT], back),
                scaler: rule_scaler,
            };
            // The loss and the squares of this step, written into both (as loss_accumulate
            // and the norm kernels would).
            for s in [&mut want, &mut got] {
                s[STEP_LOSS] = loss;
                for i in 0..tensors {
                    s[STEP_SQUARES + i] = sq * (i + 1) as f64 / 3.0;
                }
                if let Some(v) = odd {
                    s[STEP_SQUARES + 2] = v;
                }
            }
            host::step_decide(&rule, &mut want).unwrap();
            let mut bufs = vec![bytes_of(&got)];
            emu.run_plan(&mut bufs, &plan::step_decide(&rule, addr(0)).unwrap());
            got = values_of(&bufs[0]);
            assert_bits(&got, &want, &format!("config {c}, step {k}: {rule:?}"));
        }
    }
}

/// `engine_decide` over runs of 18 steps and skips whose scalars carry over, with the scaler,
/// the non-finite rule (limits of 2, 0 and none), both and neither: each step's scalars
/// bitwise the twin's (`plan::engine_decide` over buffers [scalars, sharded, replicated,
/// loss], one thread; without the rule no loss is given, and the plan passes the sharded
/// part's address for it, as the launcher does). Invalid scalers, and the rule without a
/// loss, are refused.
#[test]
fn engine_decide_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Optim, "engine_decide_is_its_twin") else {
        return;
    };
    let nonfinite = |limit| Some(NonfiniteRule { skip_limit: limit });
    let configs: [(Option<ScalerRule>, Option<NonfiniteRule>, f32); 7] = [
        // The GPU test's: the scaler alone, with the rule, the rule alone (limited or not).
        (Some(scaler(3.0, 0.3, 2)), None, 1000.5),
        (Some(scaler(3.0, 0.3, 2)), nonfinite(Some(2)), 1000.5),
        (None, nonfinite(Some(2)), 1000.5),
        (None, nonfinite(None), 1000.5),
        // Neither; a power-of-two scaler that halts at once; growth past f32's range.
        (None, None, 1000.5),
        (Some(scaler(2.0, 0.5, 1)), nonfinite(Some(0)), 65536.0),
        (Some(scaler(2.0, 0.5, 1)), nonfinite(None), f32::MAX / 1.5),
    ];
    for (c, (rule_scaler, guard, scale)) in configs.into_iter().enumerate() {
        let mut want = host::step_scalars(0, Some((scale, 0, 0)));
        let mut got = want.clone();
        for i in 0..18u32 {
            // Parts: the sharded one infinite every 4th step, -inf and NaN once each; the
            // replicated one NaN and infinite once each.
            let sharded = match i {
                _ if i % 4 == 3 => f64::INFINITY,
                9 => f64::NEG_INFINITY,
                13 => f64::NAN,
                _ => f64::from(i) * 1.25,
            };
            let replicated = match i {
                5 => f64::NAN,
                10 => f64::INFINITY,
                _ => 0.25 + f64::from(i) * 1e-3,
            };
            // The loss NaN every 6th step, overflowing f32 once, infinite once.
            let loss = match i {
                _ if i % 6 == 5 => f64::NAN,
                8 => -1e39,
                14 => f64::INFINITY,
                _ => f64::from(i) * 0.5,
            };
            // Skipped every 5th step; the base the count, a step behind it, or a fault.
            let back = match i % 7 {
                2 => 1,
                4 => 2,
                6 => -1,
                _ => 0,
            };
            let d = EngineDecision {
                scaler: rule_scaler,
                nonfinite: guard,
                base_steps: base_of(want[STEP_COUNT], back),
                take: i % 5 != 4,
            };
            host::engine_decide(&d, &mut want, sharded, replicated, loss).unwrap();
            let mut bufs = vec![
                bytes_of(&got),
                bytes_of(&[sharded]),
                bytes_of(&[replicated]),
                bytes_of(&[loss]),
            ];
            let loss_at = d.nonfinite.map(|_| addr(3));
            let launches = plan::engine_decide(&d, addr(0), addr(1), addr(2), loss_at).unwrap();
            emu.run_plan(&mut bufs, &launches);
            got = values_of(&bufs[0]);
            assert_bits(&got, &want, &format!("config {c}, step {i}: {d:?}"));
        }
    }
    let d = EngineDecision {
        scaler: None,
        nonfinite: nonfinite(None),
        base_steps: 0,
        take: true,
    };
    assert!(plan::engine_decide(&d, addr(0), addr(1), addr(2), None).is_err());
    let d = EngineDecision {
        scaler: Some(scaler(1.0, 0.5, 1)),
        nonfinite: None,
        ..d
    };
    assert!(plan::engine_decide(&d, addr(0), addr(1), addr(2), None).is_err());
}
