//! The layer norm's, GELU's and the bias add's CUDA source (`cu/nn.cu`, `bias_add_f32` of
//! `cu/nn_embed_heads.cu`; `Program::Nn`) run on the host (`common::emulator`: the program as
//! NVRTC compiles it, a block's threads as host threads), each launched with its launcher's
//! grid, block and parameters (`src/launch/nn.rs`, `nn_heads.rs`), against its twin
//! (`host::nn`, `host::nn_math`) **bitwise**, as `tests/gpu_nn.rs` holds them on a GPU:
//! layernorm_forward in f32 and its bf16 and f16 roundings (the statistics too), the input
//! part of its backward (accumulating), gelu_forward in f32, bf16 and f16, gelu_backward,
//! bias_add, and column_chunks_add_f32, the last step of the column reductions, over several
//! chunks. Rows are shorter and longer than a block of 256 threads and not multiples of it or
//! of a warp; a constant row (zero variance) too; GELU's inputs hold zeros of both signs,
//! infinities, NaN, a subnormal and the tails; outputs start as NaN so that an element left
//! unwritten shows.
//!
//! What this cannot check: the hardware itself (`tests/gpu_nn.rs` does, on a GPU); and the
//! column reductions' first pass, `layernorm_backward_params_f32` and `bias_grad_f32`, whose
//! blocks are two-dimensional (32 columns × `NN_COL_GROUPS` row groups, `threadIdx.y` the
//! group): the emulator's launches have one-dimensional blocks (`Launch::threads`,
//! `threadIdx.y` always 0), so they cannot be launched as their launcher launches them. Their
//! chunk sums are formed here in the order `cu/nn.cu` documents, and column_chunks_add_f32
//! adds them as the launchers chain it, against the twins' `bias_grad` and
//! `layernorm_backward_params`.

mod common;

use common::data;
use common::emulator::{bytes_of, values_of, Arg, Emulator, Launch};
use fsdp_kernels::host::nn::{self, NN_BLOCK, NN_COL_CHUNK, NN_COL_GROUPS};
use fsdp_kernels::host::{f32_to_bf16, f32_to_f16};
use fsdp_kernels::Program;

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
            // `per_row`: grid (n), block (NN_BLOCK).
            let launch = Launch::new(kernel, (n as u32, 1), NN_BLOCK as u32, args);
            emu.run(&mut bufs, &[launch]);
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
        let launch = Launch::new(
            "layernorm_backward_input_f32",
            (n as u32, 1),
            NN_BLOCK as u32,
            args,
        );
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
/// order from zero into `part[q, j]`.
fn chunk_sums(n: usize, c: usize, term: impl Fn(usize, usize) -> f32) -> (Vec<f32>, usize) {
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
    (part, chunks)
}

/// column_chunks_add_f32 on the element-wise grid for `c` columns (`launch::nn::add_chunks`:
/// `config(c)`), parameters (part, acc, u32 chunks, u32 c): `acc` updated in place.
fn add_chunks(emu: &Emulator, part: &[f32], chunks: usize, acc: &[f32]) -> Vec<f32> {
    let c = acc.len();
    let mut bufs = vec![bytes_of(part), bytes_of(acc)];
    let args = vec![
        Arg::buf(0),
        Arg::buf(1),
        Arg::u32(chunks as u32),
        Arg::u32(c as u32),
    ];
    emu.run(
        &mut bufs,
        &[Launch::elementwise("column_chunks_add_f32", c, args)],
    );
    values_of(&bufs[1])
}

/// The column reductions' last step, column_chunks_add_f32, adding the chunk sums in chunk
/// order to the gradients' current values: the bias gradient's (the shapes of
/// `tests/gpu_nn.rs`: one row; a partial chunk; several chunks, the last partial, with a
/// partial tile of 32 columns) and the layer norm's weight and bias gradients (600 rows: three
/// chunks, the last of 88 rows), against the twins `bias_grad` and
/// `layernorm_backward_params`. The chunk sums come from [`chunk_sums`], not from the kernels
/// that write them on a GPU (their two-dimensional blocks are beyond the emulator).
#[test]
fn column_chunks_add_completes_the_twins_column_sums() {
    let Some(emu) = Emulator::build(
        Program::Nn,
        "column_chunks_add_completes_the_twins_column_sums",
    ) else {
        return;
    };
    for (n, c) in [(1usize, 33usize), (200, 64), (600, 40), (1025, 300)] {
        let (dy, db0) = (data(n * c, 51, 1.0), data(c, 52, 0.1));
        let mut db = db0.clone();
        nn::bias_grad(&dy, &mut db).unwrap();
        let (part, chunks) = chunk_sums(n, c, |r, j| dy[r * c + j]);
        assert_eq!(chunks, n.div_ceil(NN_COL_CHUNK));
        let got = add_chunks(emu, &part, chunks, &db0);
        same(
            &got,
            &db,
            &format!("bias grad {n}×{c} (column_chunks_add_f32)"),
        );
    }
    for (n, c) in [(33usize, 48usize), (600, 40)] {
        let x = data(n * c, 1, 4.0);
        let (w, b, dy) = (data(c, 2, 1.0), data(c, 3, 1.0), data(n * c, 4, 1.0));
        let (mut y, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        nn::layernorm_forward(&x, &w, &b, EPS, &mut y, &mut m, &mut r).unwrap();
        let (dw0, db0) = (data(c, 5, 1.0), data(c, 6, 1.0));
        let (mut dw, mut db) = (dw0.clone(), db0.clone());
        nn::layernorm_backward_params(&dy, &x, &m, &r, &mut dw, &mut db).unwrap();
        // The kernel's terms: fm(fm(d, fs(x, mean)), rstd) for the weight, d for the bias.
        let (pw, chunks) = chunk_sums(n, c, |i, j| (dy[i * c + j] * (x[i * c + j] - m[i])) * r[i]);
        let (pb, _) = chunk_sums(n, c, |i, j| dy[i * c + j]);
        let what = |p: &str| format!("layernorm {p} {n}×{c} (column_chunks_add_f32)");
        same(&add_chunks(emu, &pw, chunks, &dw0), &dw, &what("dweight"));
        same(&add_chunks(emu, &pb, chunks, &db0), &db, &what("dbias"));
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
