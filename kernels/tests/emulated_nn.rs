//! The layer norm's, GELU's and the bias's CUDA source (`cu/nn.cu`; `bias_add_f32` and
//! `bias_grad_f32` of `cu/nn_embed_heads.cu`; `Program::Nn`) run on the host
//! (`common::emulator`: the program as NVRTC compiles it, a block's threads as host threads),
//! each launched with its launcher's grid, block and parameters (`src/launch/nn.rs`,
//! `nn_heads.rs`), against its twin (`host::nn`, `host::nn_math`) **bitwise**, as
//! `tests/gpu_nn.rs` holds them on a GPU: layernorm_forward in f32 and its bf16 and f16
//! roundings (the statistics too), the input part of its backward (accumulating), gelu_forward
//! in f32, bf16 and f16, gelu_backward, bias_add, and the two column reductions,
//! layernorm_backward_params_f32 and bias_grad_f32 (two-dimensional blocks of 32 columns ×
//! `NN_COL_GROUPS` row groups, one per tile of 32 columns and chunk of `NN_COL_CHUNK` rows),
//! each chained with column_chunks_add_f32 as its launcher chains them: the chunk sums the
//! first kernel writes are what the second adds to the gradients' current values. Rows are
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
use common::emulator::{bytes_of, values_of, Arg, Emulator, Launch};
use fsdp_kernels::host::nn::{self, NN_BLOCK, NN_COL_CHUNK, NN_COL_GROUPS};
use fsdp_kernels::host::{f32_to_bf16, f32_to_f16};
use fsdp_kernels::{launch, Program};

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

fn ln_input(n: usize, c: usize) -> Vec<f32> {
    let mut x = data(n * c, 1, 4.0);
    if c == NN_BLOCK + 1 {
        x[..c].fill(1.5);
    }
    x
}

/// layernorm_forward_f32, _bf16 and _f16: one block of NN_BLOCK threads per row
/// (`launch::nn::per_row`), parameters (x, w, b, y, mean, rstd, u32 c, f32 eps)
/// (`launch::layernorm_forward`); y, mean and rstd the twin's bits (y rounded as the cast
/// kernel rounds for the 16-bit kernels).
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
        for (kernel, y_bytes) in [
            ("layernorm_forward_f32", 4),
            ("layernorm_forward_bf16", 2),
            ("layernorm_forward_f16", 2),
        ] {
            let y0 = if y_bytes == 4 {
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
            let args = vec![
                Arg::buf(0),
                Arg::buf(1),
                Arg::buf(2),
                Arg::buf(3),
                Arg::buf(4),
                Arg::buf(5),
                Arg::u32(c as u32),
                Arg::f32(EPS),
            ];
            // The launcher's `per_row`: grid (n), block (NN_BLOCK).
            let cfg = launch::per_row("layernorm_forward", n).unwrap();
            emu.run(&mut bufs, &[Launch::from_config(kernel, &cfg, args)]);
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
/// `tests/gpu_nn.rs`): one block per row, parameters (dy, x, w, mean, rstd, dx, u32 c)
/// (`launch::layernorm_backward_input`).
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
        let args = vec![
            Arg::buf(0),
            Arg::buf(1),
            Arg::buf(2),
            Arg::buf(3),
            Arg::buf(4),
            Arg::buf(5),
            Arg::u32(c as u32),
        ];
        let cfg = launch::per_row("layernorm_backward_input", n).unwrap();
        let launch = Launch::from_config("layernorm_backward_input_f32", &cfg, args);
        emu.run(&mut bufs, &[launch]);
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

/// The block of a column reduction's first kernel, the launcher's (`launch::per_column_tile`):
/// 32 columns × NN_COL_GROUPS row groups (`threadIdx.y` the group).
fn col_block() -> (u32, u32) {
    let b = launch::per_column_tile(1, 1).block_dim;
    assert_eq!(b, (32, NN_COL_GROUPS as u32, 1));
    (b.0, b.1)
}

/// The grid of a column reduction's first kernel over `n` rows of `c` columns, the
/// launcher's (`launch::per_column_tile(c, n)`): one block per tile of 32 columns (at most
/// 2^16) and chunk of NN_COL_CHUNK rows (at most 65535).
fn per_column_tile(c: usize, n: usize) -> (u32, u32) {
    let g = launch::per_column_tile(c, n).grid_dim;
    (g.0, g.1)
}

/// The grids the first kernels run on here: the launcher's (`per_column_tile`), and one of a
/// single tile column and two chunk rows of blocks, smaller than the work, so that the
/// kernels' grid-stride loops over tiles and chunks run (and a block past the last chunk
/// writes nothing): on the launcher's grid they run only past 2^16 tiles or 65535 chunks,
/// sizes the emulator cannot afford. The second is not a grid a launcher uses; the kernels
/// document both loops, and the twin's bits must not depend on the grid.
fn column_grids(c: usize, n: usize) -> [((u32, u32), &'static str); 2] {
    [
        (per_column_tile(c, n), "the launcher's grid"),
        ((1, 2), "grid (1, 2), grid-stride"),
    ]
}

/// column_chunks_add_f32 as `launch::nn::add_chunks` launches it: the element-wise grid for
/// `c` columns (`config(c)`), parameters (part, acc, u32 chunks, u32 c) with `part` and `acc`
/// buffers `part` and `acc` (updated in place) and `chunks` = ⌈n / NN_COL_CHUNK⌉, unclamped
/// (`launch::nn::chunk_sums`).
fn add_chunks(part: usize, acc: usize, chunks: usize, c: usize) -> Launch {
    let args = vec![
        Arg::buf(part),
        Arg::buf(acc),
        Arg::u32(chunks as u32),
        Arg::u32(c as u32),
    ];
    Launch::elementwise("column_chunks_add_f32", c, args)
}

/// bias_grad_f32 chained with column_chunks_add_f32 as `launch::bias_grad` chains them (one
/// run over the same buffers: dy; the scratch of ⌈n / NN_COL_CHUNK⌉ × c chunk sums the first
/// writes and the second reads; db, accumulated): bias_grad_f32 on `per_column_tile(c, n)`'s
/// grid and block (32, NN_COL_GROUPS), parameters (dy, part, u32 n, u32 c); db against the
/// twin `bias_grad` bitwise. Shapes of `tests/gpu_nn.rs` (its 1025 × 1000 narrowed to 300
/// columns, ten tiles, for time): one row; one partial chunk; three chunks (the last of 88
/// rows) on two tiles, the second partial; five chunks (the last of one row) on ten tiles,
/// the last partial. This chain replaces the earlier test of column_chunks_add_f32 over chunk
/// sums formed here ([`chunk_sums`] now only checks the scratch in between).
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
        let chunks = n.div_ceil(NN_COL_CHUNK);
        for (grid, how) in column_grids(c, n) {
            let mut bufs = vec![bytes_of(&dy), nans(chunks * c), bytes_of(&db0)];
            let args = vec![
                Arg::buf(0),
                Arg::buf(1),
                Arg::u32(n as u32),
                Arg::u32(c as u32),
            ];
            let first = Launch::new_2d("bias_grad_f32", grid, col_block(), args);
            emu.run(&mut bufs, &[first, add_chunks(1, 2, chunks, c)]);
            let what = |p: &str| format!("bias_grad_f32 {p} {n}×{c} ({how})");
            same(&values_of(&bufs[1]), &part, &what("chunk sums"));
            same(&values_of(&bufs[2]), &db, &what("db"));
        }
    }
}

/// layernorm_backward_params_f32 chained with column_chunks_add_f32 as
/// `launch::layernorm_backward_params` chains them (one run over the same buffers: dy, x,
/// mean, rstd; the two scratches of chunk sums, pw and pb; dw and db, accumulated):
/// layernorm_backward_params_f32 on `per_column_tile(c, n)`'s grid and block
/// (32, NN_COL_GROUPS), parameters (dy, x, mean, rstd, pw, pb, u32 n, u32 c), then
/// column_chunks_add_f32 (pw, dw) and (pb, db); dw and db against the twin
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
        let chunks = n.div_ceil(NN_COL_CHUNK);
        for (grid, how) in column_grids(c, n) {
            let mut bufs = vec![
                bytes_of(&dy),
                bytes_of(&x),
                bytes_of(&m),
                bytes_of(&r),
                nans(chunks * c),
                nans(chunks * c),
                bytes_of(&dw0),
                bytes_of(&db0),
            ];
            let args = vec![
                Arg::buf(0),
                Arg::buf(1),
                Arg::buf(2),
                Arg::buf(3),
                Arg::buf(4),
                Arg::buf(5),
                Arg::u32(n as u32),
                Arg::u32(c as u32),
            ];
            let first = Launch::new_2d("layernorm_backward_params_f32", grid, col_block(), args);
            let chain = [
                first,
                add_chunks(4, 6, chunks, c),
                add_chunks(5, 7, chunks, c),
            ];
            emu.run(&mut bufs, &chain);
            let what = |p: &str| format!("layernorm_backward_params_f32 {p} {n}×{c} ({how})");
            same(&values_of(&bufs[4]), &pw, &what("dweight chunk sums"));
            same(&values_of(&bufs[5]), &pb, &what("dbias chunk sums"));
            same(&values_of(&bufs[6]), &dw, &what("dweight"));
            same(&values_of(&bufs[7]), &db, &what("dbias"));
        }
    }
}

/// gelu_forward_f32, _bf16 and _f16 and gelu_backward_f32 (writing) on the element-wise grid
/// (`launch::config(n)`), parameters (x, y, u64 n) and (x, dy, dx, u64 n)
/// (`launch::gelu_forward`, `launch::gelu_backward`): random values in [-12, 12) (both tails)
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
    for kernel in ["gelu_forward_f32", "gelu_forward_bf16", "gelu_forward_f16"] {
        let y0 = if kernel == "gelu_forward_f32" {
            nans(n)
        } else {
            half_nans(n)
        };
        let mut bufs = vec![bytes_of(&x), y0];
        let args = vec![Arg::buf(0), Arg::buf(1), Arg::u64(n as u64)];
        emu.run(&mut bufs, &[Launch::elementwise(kernel, n, args)]);
        match kernel {
            "gelu_forward_f32" => same(&values_of(&bufs[1]), &y, kernel),
            "gelu_forward_bf16" => same_half(&bufs[1], &y, f32_to_bf16, kernel),
            _ => same_half(&bufs[1], &y, f32_to_f16, kernel),
        }
    }
    let mut bufs = vec![bytes_of(&x), bytes_of(&dy), nans(n)];
    let args = vec![Arg::buf(0), Arg::buf(1), Arg::buf(2), Arg::u64(n as u64)];
    emu.run(
        &mut bufs,
        &[Launch::elementwise("gelu_backward_f32", n, args)],
    );
    same(&values_of(&bufs[2]), &dx, "gelu_backward_f32");
}

/// bias_add_f32 (in place) on the element-wise grid for the `n·c` elements
/// (`launch::nn_heads::bias_add`: `config(n·c)`), parameters (y, b, u64 n·c, u32 c): the
/// shapes of `tests/gpu_nn.rs` (a row longer than a block too) and rows of a column.
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
        let args = vec![
            Arg::buf(0),
            Arg::buf(1),
            Arg::u64((n * c) as u64),
            Arg::u32(c as u32),
        ];
        emu.run(
            &mut bufs,
            &[Launch::elementwise("bias_add_f32", n * c, args)],
        );
        same(&values_of(&bufs[0]), &y, &format!("bias_add_f32 {n}×{c}"));
    }
}
