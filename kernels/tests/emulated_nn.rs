//! The layer norm's, GELU's and the bias's CUDA source (`cu/nn.cu`; `bias_add_f32` and
//! `bias_grad_f32` of `cu/nn_embed_heads.cu`; `Program::Nn`) run on the host
//! (`common::emulator`: the program as NVRTC compiles it, a block's threads as host threads),
//! each launched as its launcher launches it (`launch::plan`: the same kernels, grids,
//! parameters and offsets), against its twin (`host::nn`, `host::nn_math`) **bitwise**, as
//! `tests/gpu_nn.rs` holds them on a GPU: layernorm_forward in f32 and its bf16 and f16
//! roundings (the statistics too), the input part of its backward (accumulating), gelu_forward
//! in f32, bf16 and f16, gelu_backward, bias_add, and the two column reductions,
//! layernorm_backward_params_f32 and bias_grad_f32 (two-dimensional blocks of 32 columns ×
//! `NN_COL_GROUPS` row groups, one per tile of 32 columns and chunk of `NN_COL_CHUNK` rows),
//! each chained with column_chunks_add_f32 as its launcher's plan chains them: the chunk sums
//! the first kernel writes are what the second adds to the gradients' current values. Rows are
//! shorter and longer than a block of 256 threads and not multiples of it or of a warp; a
//! constant row (zero variance) too; the column reductions run over one row, one partial chunk
//! and several chunks (the last partial), on columns that are not a multiple of 32; GELU's
//! inputs hold zeros of both signs, infinities, NaN, a subnormal and the tails; outputs and
//! scratch start as NaN so that an element left unwritten shows.
//!
//! What this cannot check: the hardware itself (`tests/gpu_nn.rs` does, on a GPU): the
//! emulator runs a block's threads as host threads and the blocks one after another, so
//! neither races between blocks, nor the memory model, nor the launch limits are exercised.

mod common;

use common::data;
use common::emulator::{addr, bytes_of, values_of, Emulator};
use fsdp_kernels::host::nn::{self, NN_BLOCK, NN_COL_CHUNK, NN_COL_GROUPS};
use fsdp_kernels::host::{f32_to_bf16, f32_to_f16};
use fsdp_kernels::launch::plan::{self, KernelLaunch};
use fsdp_kernels::Program;
use half::{bf16, f16};

/// The layer norm's epsilon in `tests/gpu_nn.rs`.
const EPS: f32 = 1e-5;

/// Bitwise equality (NaNs' payloads too).
#[track_caller]
fn same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}[{i}]: emulated {g:e} ({:#x}), the twin {w:e} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// A 16-bit kernel's output against the twin's f32 values rounded as the cast kernel rounds.
#[track_caller]
fn same_half(got: &[u8], want: &[f32], round: fn(f32) -> u16, what: &str) {
    let got: Vec<u16> = values_of(got);
    let want: Vec<u16> = want.iter().map(|&v| round(v)).collect();
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "{what}[{i}]: emulated {g:#06x}, the twin {w:#06x}");
    }
}

/// `n` f32 NaNs' bytes (a kernel must write every element).
fn nans(n: usize) -> Vec<u8> {
    bytes_of(&vec![f32::NAN; n])
}

/// `n` 16-bit NaNs' bytes (0xffff: a NaN in bf16 and f16).
fn half_nans(n: usize) -> Vec<u8> {
    vec![0xff; 2 * n]
}

/// Rows shorter than a block, longer than a block (not a multiple of it) and one element past
/// a block (its last thread folds two elements); the last case's first row constant (zero
/// variance: rstd = 1/sqrt(eps)).
const LN_SHAPES: [(usize, usize); 3] = [(33, 48), (5, 1000), (3, NN_BLOCK + 1)];

/// `plan::layernorm_forward` writing `y` as `Y` over buffers 0..6: x, w, b, y, mean, rstd.
fn layernorm_forward_plan<Y: fsdp_kernels::host::CastFloat>(
    n: usize,
    c: usize,
) -> Vec<KernelLaunch> {
    let a = |i| addr(i);
    plan::layernorm_forward::<Y>(a(0), a(1), a(2), EPS, a(3), a(4), a(5), n, c).unwrap()
}

fn ln_input(n: usize, c: usize) -> Vec<f32> {
    let mut x = data(n * c, 1, 4.0);
    if c == NN_BLOCK + 1 {
        x[..c].fill(1.5);
    }
    x
}

/// Two blocks of one launch writing one byte are refused: a plan whose `mean` points at the
/// end of `y`'s last row has blocks 0 to n − 2 write their means where block n − 1 writes that
/// row (and block n − 1 its own just past it, so that no two threads of one block write one
/// place: ThreadSanitizer, under `scripts/emulate-sanitized.sh thread`, would report that
/// first). On a GPU the blocks run concurrently, so whichever is written last is a race; the
/// emulator runs them one at a time and finds each byte a block changed. Not run on a GPU,
/// which has no such check (the result there is one of the two writes).
#[test]
fn two_blocks_writing_one_byte_are_refused() {
    let Some(emu) = Emulator::build(Program::Nn, "two_blocks_writing_one_byte_are_refused") else {
        return;
    };
    if emu.on_cuda() {
        println!("skipped: a GPU does not check this");
        return;
    }
    let (n, c) = (4, 48);
    let (x, w, b) = (ln_input(n, c), data(c, 2, 1.0), data(c, 3, 1.0));
    let bufs = || {
        vec![
            bytes_of(&x),
            bytes_of(&w),
            bytes_of(&b),
            nans(n * c + n),
            nans(n),
            nans(n),
        ]
    };
    // mean[r] is y's element n·c − (n − 1) + r.
    let at = n * c - (n - 1);
    let a = |i| addr(i);
    let overlapping = plan::layernorm_forward::<f32>(
        a(0),
        a(1),
        a(2),
        EPS,
        a(3),
        a(3) + 4 * at as u64,
        a(5),
        n,
        c,
    )
    .unwrap();
    let mut racy = bufs();
    let msg = emu.run_plan_refused(
        &mut racy,
        &overlapping,
        "the means of blocks 0 to n − 2 land in the row block n − 1 writes",
    );
    // Blocks 0 to n − 2 write y's elements n·c − (n − 1) … n·c − 1, which block n − 1 writes
    // too (the blocks run in a shuffled order, so the pair found first is any of them).
    let byte: usize = msg
        .split("both wrote byte ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{msg}"));
    assert!(
        msg.contains("layernorm_forward_f32: blocks (")
            && msg.contains(&format!("byte {byte} of buffer 3"))
            && (4 * at..4 * n * c).contains(&byte),
        "{msg}"
    );
    // The same launch with `mean` in its own buffer runs.
    let mut fine = bufs();
    emu.run_plan(&mut fine, &layernorm_forward_plan::<f32>(n, c));
}

/// layernorm_forward_f32, _bf16 and _f16 as `launch::layernorm_forward` launches them
/// (`plan::layernorm_forward`: one block of NN_BLOCK threads per row); y, mean and rstd the
/// twin's bits (y rounded as the cast kernel rounds for the 16-bit kernels).
#[test]
fn layernorm_forward_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Nn, "layernorm_forward_is_its_twin") else {
        return;
    };
    for (n, c) in LN_SHAPES {
        let x = ln_input(n, c);
        let (w, b) = (data(c, 2, 1.0), data(c, 3, 1.0));
        let (mut y, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        nn::layernorm_forward(&x, &w, &b, EPS, &mut y, &mut m, &mut r).unwrap();
        let what = |k: &str| format!("{k} {n}×{c}");
        let plans = [
            (layernorm_forward_plan::<f32>(n, c), "layernorm_forward_f32"),
            (
                layernorm_forward_plan::<bf16>(n, c),
                "layernorm_forward_bf16",
            ),
            (layernorm_forward_plan::<f16>(n, c), "layernorm_forward_f16"),
        ];
        for (launches, kernel) in plans {
            assert_eq!(launches.len(), 1);
            assert_eq!(launches[0].kernel, kernel, "the kernel writing y");
            let y0 = if kernel == "layernorm_forward_f32" {
                nans(n * c)
            } else {
                half_nans(n * c)
            };
            let mut bufs = vec![
                bytes_of(&x),
                bytes_of(&w),
                bytes_of(&b),
                y0,
                nans(n),
                nans(n),
            ];
            emu.run_plan(&mut bufs, &launches);
            match kernel {
                "layernorm_forward_f32" => same(&values_of(&bufs[3]), &y, &what(kernel)),
                "layernorm_forward_bf16" => same_half(&bufs[3], &y, f32_to_bf16, &what(kernel)),
                _ => same_half(&bufs[3], &y, f32_to_f16, &what(kernel)),
            }
            same(&values_of(&bufs[4]), &m, &what(&format!("{kernel} mean")));
            same(&values_of(&bufs[5]), &r, &what(&format!("{kernel} rstd")));
        }
    }
}

/// layernorm_backward_input_f32 (accumulating into dx, which starts as x / 10 as in
/// `tests/gpu_nn.rs`) as `launch::layernorm_backward_input` launches it
/// (`plan::layernorm_backward_input`: one block per row).
#[test]
fn layernorm_backward_input_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Nn, "layernorm_backward_input_is_its_twin") else {
        return;
    };
    for (n, c) in LN_SHAPES {
        let x = ln_input(n, c);
        let (w, b, dy) = (data(c, 2, 1.0), data(c, 3, 1.0), data(n * c, 4, 1.0));
        let (mut y, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        nn::layernorm_forward(&x, &w, &b, EPS, &mut y, &mut m, &mut r).unwrap();
        let dx0: Vec<f32> = x.iter().map(|v| v * 0.1).collect();
        let mut dx = dx0.clone();
        nn::layernorm_backward_input(&dy, &x, &w, &m, &r, &mut dx).unwrap();
        let mut bufs = vec![
            bytes_of(&dy),
            bytes_of(&x),
            bytes_of(&w),
            bytes_of(&m),
            bytes_of(&r),
            bytes_of(&dx0),
        ];
        let a = |i| addr(i);
        let launches =
            plan::layernorm_backward_input(a(0), a(1), a(2), a(3), a(4), a(5), n, c).unwrap();
        emu.run_plan(&mut bufs, &launches);
        same(
            &values_of(&bufs[5]),
            &dx,
            &format!("layernorm_backward_input_f32 {n}×{c}"),
        );
    }
}

/// The chunk sums of a column reduction over `n` rows of `c` columns as `cu/nn.cu` documents
/// the first pass (`bias_grad_f32`, `layernorm_backward_params_f32`): for chunk `q` of
/// NN_COL_CHUNK rows and column `j`, row group `g` of NN_COL_GROUPS folds the chunk's rows
/// `g, g + NN_COL_GROUPS, …` from zero in order, then the group partials are folded in group
/// order from zero into `part[q, j]`. Not what the chains below are held to (the twins are):
/// the scratch the first kernel writes is compared with it as well, so that a failure says
/// which of the two kernels is at fault, and so that the chunk sums themselves are pinned (a
/// wrong split between the chunks could still round to the twin's total).
fn chunk_sums(n: usize, c: usize, term: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let chunks = n.div_ceil(NN_COL_CHUNK);
    let mut part = vec![0.0f32; chunks * c];
    for q in 0..chunks {
        let (r0, r1) = (q * NN_COL_CHUNK, n.min((q + 1) * NN_COL_CHUNK));
        for j in 0..c {
            let mut t = 0.0f32;
            for g in 0..NN_COL_GROUPS {
                let mut a = 0.0f32;
                for r in (r0 + g..r1).step_by(NN_COL_GROUPS) {
                    a += term(r, j);
                }
                t += a;
            }
            part[q * c + j] = t;
        }
    }
    part
}

/// A column reduction's plan (its chunk kernel, then column_chunks_add_f32 for each
/// gradient) as planned, on the launcher's grid (`plan::per_column_tile(c, n)`: one block of
/// 32 columns × NN_COL_GROUPS row groups per tile of 32 columns, at most 2^16, and chunk of
/// NN_COL_CHUNK rows, at most 65535), and with the chunk kernel on a grid of a single tile
/// column and two chunk rows of blocks, smaller than the work, so that the kernels'
/// grid-stride loops over tiles and chunks run (and a block past the last chunk writes
/// nothing): on the launcher's grid they run only past 2^16 tiles or 65535 chunks, sizes the
/// emulator cannot afford. The second is not a grid a launcher uses; the kernels document both
/// loops, and the twin's bits must not depend on the grid.
fn column_grids(
    launches: Vec<KernelLaunch>,
    c: usize,
    n: usize,
) -> [(Vec<KernelLaunch>, &'static str); 2] {
    let first = &launches[0].config;
    assert_eq!(first.block_dim, (32, NN_COL_GROUPS as u32, 1));
    assert_eq!(first.grid_dim, plan::per_column_tile(c, n).grid_dim);
    let mut strided = launches.clone();
    strided[0].config.grid_dim = (1, 2, 1);
    [
        (launches, "the launcher's grid"),
        (strided, "grid (1, 2), grid-stride"),
    ]
}

/// bias_grad_f32 chained with column_chunks_add_f32 as `launch::bias_grad` chains them
/// (`plan::bias_grad`, one run over the same buffers: dy; the scratch of ⌈n / NN_COL_CHUNK⌉ ×
/// c chunk sums the first writes and the second reads, `plan::bias_grad_scratch` long; db,
/// accumulated); db against the twin `bias_grad` bitwise. Shapes of `tests/gpu_nn.rs` (its
/// 1025 × 1000 narrowed to 300 columns, ten tiles, for time): one row; one partial chunk;
/// three chunks (the last of 88 rows) on two tiles, the second partial; five chunks (the last
/// of one row) on ten tiles, the last partial. This chain replaces the earlier test of
/// column_chunks_add_f32 over chunk sums formed here ([`chunk_sums`] now only checks the
/// scratch in between).
#[test]
fn bias_grad_chain_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Nn, "bias_grad_chain_is_its_twin") else {
        return;
    };
    for (n, c) in [(1usize, 33usize), (200, 64), (600, 40), (1025, 300)] {
        let (dy, db0) = (data(n * c, 51, 1.0), data(c, 52, 0.1));
        let mut db = db0.clone();
        nn::bias_grad(&dy, &mut db).unwrap();
        let part = chunk_sums(n, c, |r, j| dy[r * c + j]);
        let scratch = plan::bias_grad_scratch(n, c).unwrap();
        let launches = plan::bias_grad(addr(0), addr(1), addr(2), n, c).unwrap();
        for (launches, how) in column_grids(launches, c, n) {
            let mut bufs = vec![bytes_of(&dy), nans(scratch), bytes_of(&db0)];
            emu.run_plan(&mut bufs, &launches);
            let what = |p: &str| format!("bias_grad_f32 {p} {n}×{c} ({how})");
            same(&values_of(&bufs[1]), &part, &what("chunk sums"));
            same(&values_of(&bufs[2]), &db, &what("db"));
        }
    }
}

/// layernorm_backward_params_f32 chained with column_chunks_add_f32 as
/// `launch::layernorm_backward_params` chains them (`plan::layernorm_backward_params`, one run
/// over the same buffers: dy, x, mean, rstd; the two scratches of chunk sums, pw and pb, each
/// `plan::layernorm_backward_params_scratch` long; dw and db, accumulated): the chunk kernel,
/// then column_chunks_add_f32 (pw, dw) and (pb, db); dw and db against the twin
/// `layernorm_backward_params` bitwise, the statistics the twin's forward (the emulated
/// forward's bits, `layernorm_forward_is_its_twin`). Shapes of `tests/gpu_nn.rs`: 33 × 48 (one
/// partial chunk, two tiles, the second partial) and 600 × 40 (three chunks, the last of 88
/// rows). This chain replaces the earlier test of column_chunks_add_f32 over chunk sums formed
/// here ([`chunk_sums`] now only checks the scratches in between).
#[test]
fn layernorm_backward_params_chain_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Nn, "layernorm_backward_params_chain_is_its_twin")
    else {
        return;
    };
    for (n, c) in [(33usize, 48usize), (600, 40)] {
        let x = data(n * c, 1, 4.0);
        let (w, b, dy) = (data(c, 2, 1.0), data(c, 3, 1.0), data(n * c, 4, 1.0));
        let (mut y, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        nn::layernorm_forward(&x, &w, &b, EPS, &mut y, &mut m, &mut r).unwrap();
        let (dw0, db0) = (data(c, 5, 1.0), data(c, 6, 1.0));
        let (mut dw, mut db) = (dw0.clone(), db0.clone());
        nn::layernorm_backward_params(&dy, &x, &m, &r, &mut dw, &mut db).unwrap();
        // The kernel's terms: fm(fm(d, fs(x, mean)), rstd) for the weight, d for the bias.
        let pw = chunk_sums(n, c, |i, j| (dy[i * c + j] * (x[i * c + j] - m[i])) * r[i]);
        let pb = chunk_sums(n, c, |i, j| dy[i * c + j]);
        let scratch = plan::layernorm_backward_params_scratch(n, c).unwrap();
        let a = |i| addr(i);
        let launches =
            plan::layernorm_backward_params(a(0), a(1), a(2), a(3), a(4), a(5), a(6), a(7), n, c)
                .unwrap();
        for (launches, how) in column_grids(launches, c, n) {
            let mut bufs = vec![
                bytes_of(&dy),
                bytes_of(&x),
                bytes_of(&m),
                bytes_of(&r),
                nans(scratch),
                nans(scratch),
                bytes_of(&dw0),
                bytes_of(&db0),
            ];
            emu.run_plan(&mut bufs, &launches);
            let what = |p: &str| format!("layernorm_backward_params_f32 {p} {n}×{c} ({how})");
            same(&values_of(&bufs[4]), &pw, &what("dweight chunk sums"));
            same(&values_of(&bufs[5]), &pb, &what("dbias chunk sums"));
            same(&values_of(&bufs[6]), &dw, &what("dweight"));
            same(&values_of(&bufs[7]), &db, &what("dbias"));
        }
    }
}

/// gelu_forward_f32, _bf16 and _f16 and gelu_backward_f32 (writing) as `launch::gelu_forward`
/// and `launch::gelu_backward` launch them (`plan::gelu_forward`, `plan::gelu_backward`: the
/// element-wise grid): random values in [-12, 12) (both tails)
/// and the special values of `tests/gpu_nn.rs`, 2 ^ 11 + 13 of them (not a multiple of 256).
#[test]
fn gelu_kernels_are_their_twins() {
    let Some(emu) = Emulator::build(Program::Nn, "gelu_kernels_are_their_twins") else {
        return;
    };
    let mut x = data(2048 + 5, 11, 12.0);
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-40,
        -30.0,
        30.0,
    ]);
    let n = x.len();
    let dy = data(n, 12, 3.0);
    let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
    nn::gelu_forward(&x, &mut y).unwrap();
    nn::gelu_backward(&x, &dy, &mut dx).unwrap();
    let plans = [
        (
            plan::gelu_forward::<f32>(addr(0), addr(1), n),
            "gelu_forward_f32",
        ),
        (
            plan::gelu_forward::<bf16>(addr(0), addr(1), n),
            "gelu_forward_bf16",
        ),
        (
            plan::gelu_forward::<f16>(addr(0), addr(1), n),
            "gelu_forward_f16",
        ),
    ];
    for (launches, kernel) in plans {
        let launches = launches.unwrap();
        assert_eq!(launches.len(), 1);
        assert_eq!(launches[0].kernel, kernel, "the kernel writing y");
        let y0 = if kernel == "gelu_forward_f32" {
            nans(n)
        } else {
            half_nans(n)
        };
        let mut bufs = vec![bytes_of(&x), y0];
        emu.run_plan(&mut bufs, &launches);
        match kernel {
            "gelu_forward_f32" => same(&values_of(&bufs[1]), &y, kernel),
            "gelu_forward_bf16" => same_half(&bufs[1], &y, f32_to_bf16, kernel),
            _ => same_half(&bufs[1], &y, f32_to_f16, kernel),
        }
    }
    let mut bufs = vec![bytes_of(&x), bytes_of(&dy), nans(n)];
    emu.run_plan(
        &mut bufs,
        &plan::gelu_backward(addr(0), addr(1), addr(2), n),
    );
    same(&values_of(&bufs[2]), &dx, "gelu_backward_f32");
}

/// bias_add_f32 (in place) as `launch::bias_add` launches it (`plan::bias_add`: the
/// element-wise grid for the `n·c` elements): the shapes of `tests/gpu_nn.rs` (a row longer than a block too) and rows of a column.
#[test]
fn bias_add_is_its_twin() {
    let Some(emu) = Emulator::build(Program::Nn, "bias_add_is_its_twin") else {
        return;
    };
    for (n, c) in [(7usize, 96usize), (3, 1000), (300, 1)] {
        let (y0, b) = (data(n * c, 51, 2.0), data(c, 52, 1.0));
        let mut y = y0.clone();
        nn::bias_add(&mut y, &b).unwrap();
        let mut bufs = vec![bytes_of(&y0), bytes_of(&b)];
        emu.run_plan(&mut bufs, &plan::bias_add(addr(0), addr(1), n * c, c));
        same(&values_of(&bufs[0]), &y, &format!("bias_add_f32 {n}×{c}"));
    }
}
