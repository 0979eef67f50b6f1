//! cuBLAS products on the GPU ([`fsdp_kernels::gemm`]) against the row-major definition in f64:
//! a `Linear` layer's forward and both backward products (accumulating too) and attention's
//! batched products, for f32, bf16 and f16 inputs (f32 accumulation; output the input type or
//! f32).
//!
//! Tolerance, derived: inputs are exactly the values the reference multiplies (16-bit inputs
//! are rounded first and the reference uses the rounded values), so the only errors are f32
//! accumulation, at most `k·u·Σ|a·b|` with `u = 2⁻²⁴` for any summation order (cuBLAS may split
//! `k`), doubled for margin, plus the output's own rounding (`2⁻⁸` relative for bf16, `2⁻¹¹`
//! for f16, `2⁻²⁴` for f32). An accumulating product (`beta ≠ 0`) is rounded twice: cuBLAS
//! rounds `alpha·a·b` to the output type before adding `beta·c` (seen on an H100: a bf16
//! `c = -1.7265625` plus a product of 5.7057 gave 4, which is `bf16(c + bf16(a·b))`, where
//! the correctly rounded sum is 3.984375), so the bound adds one more output rounding of
//! `Σ|a·b| + |beta·c|`. Without a GPU (or cuBLAS) each test prints `skipped: ...` and passes.

mod common;

use std::sync::Arc;

use cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};
use fsdp_kernels::gemm::{Blas, BlasFloat, MatMul};
use half::{bf16, f16};

use common::gpu_stream;

fn gpu(test: &str) -> Option<(Arc<CudaStream>, Blas)> {
    let s = gpu_stream(test)?;
    match Blas::new(s.clone()) {
        Ok(b) => Some((s, b)),
        Err(e) => {
            println!("{test}: skipped: no cuBLAS ({e})");
            None
        }
    }
}

/// Pseudo-random values in [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 51) as f64 - 2.0
        })
        .collect()
}

trait Float: BlasFloat + DeviceRepr + ValidAsZeroBits + Copy {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// Relative rounding of a stored result.
    const ROUND: f64;
}

impl Float for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    const ROUND: f64 = 1.0 / (1u64 << 24) as f64;
}

impl Float for bf16 {
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    const ROUND: f64 = 1.0 / 256.0;
}

impl Float for f16 {
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    const ROUND: f64 = 1.0 / 2048.0;
}

/// Run `g` on the GPU with inputs `I`, output `O` (starting from `c0`), and check every element
/// against the f64 definition within the module's bound.
fn check<I: Float, O: Float>(s: &Arc<CudaStream>, blas: &Blas, g: MatMul, seed: u64) {
    let (ea, eb, ec) = g.extents();
    let a: Vec<I> = values(ea, seed).into_iter().map(I::from_f64).collect();
    let b: Vec<I> = values(eb, seed + 1).into_iter().map(I::from_f64).collect();
    let c0: Vec<O> = values(ec, seed + 2).into_iter().map(O::from_f64).collect();
    let (a64, b64): (Vec<f64>, Vec<f64>) = (
        a.iter().map(|x| x.to_f64()).collect(),
        b.iter().map(|x| x.to_f64()).collect(),
    );
    let abs = |v: &[f64]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
    let mut want: Vec<f64> = c0.iter().map(|x| x.to_f64()).collect();
    g.host(&a64, &b64, &mut want);
    // Σ|a·b| per element (and |beta·c|): the scale of the accumulation error.
    let mut scale: Vec<f64> = c0.iter().map(|x| x.to_f64().abs()).collect();
    MatMul {
        alpha: g.alpha.abs(),
        beta: g.beta.abs(),
        ..g
    }
    .host(&abs(&a64), &abs(&b64), &mut scale);

    let (da, db) = (s.clone_htod(&a).unwrap(), s.clone_htod(&b).unwrap());
    let mut dc = s.clone_htod(&c0).unwrap();
    blas.matmul::<I, O>(&g, &da, &db, &mut dc).unwrap();
    let got = s.clone_dtoh(&dc).unwrap();
    s.synchronize().unwrap();
    let u = 1.0 / (1u64 << 24) as f64;
    for (i, ((w, x), sc)) in want.iter().zip(&got).zip(&scale).enumerate() {
        let twice = if g.beta != 0.0 { O::ROUND * sc } else { 0.0 };
        let bound =
            2.0 * (g.k as f64 + 2.0) * u * sc + O::ROUND * w.abs() + twice + f64::MIN_POSITIVE;
        let x = x.to_f64();
        assert!(
            (x - w).abs() <= bound,
            "{} → {} {g:?}: element {i} is {x}, the definition gives {w} (bound {bound})",
            I::NAME,
            O::NAME
        );
    }
}

fn shapes() -> Vec<MatMul> {
    let (rows, inputs, outputs) = (96, 64, 192);
    let (bh, t, hd) = (6, 32, 16);
    vec![
        MatMul::linear_forward(rows, inputs, outputs),
        MatMul::linear_grad_input(rows, inputs, outputs),
        MatMul::linear_grad_weight(rows, inputs, outputs, false),
        MatMul::linear_grad_weight(rows, inputs, outputs, true),
        // attention scores q·kᵀ·scale per (batch, head), then probabilities·v
        MatMul::new(t, t, hd, false, true)
            .batched(bh, t * hd, t * hd, t * t)
            .with_alpha(0.25),
        MatMul::new(t, hd, t, false, false).batched(bh, t * t, t * hd, t * hd),
        // a chunk of 2 pairs from pair 3 (`MatMul::at`: the chunked attention's parts)
        MatMul::new(t, t, hd, false, true)
            .batched(2, t * hd, t * hd, t * t)
            .at(3 * t * hd, 3 * t * hd, 0),
        MatMul::new(t, hd, t, true, false)
            .batched(2, t * t, t * hd, t * hd)
            .at(0, 3 * t * hd, 3 * t * hd),
        // odd sizes
        MatMul::new(7, 5, 3, true, true),
    ]
}

#[test]
fn f32_products_match_the_definition() {
    let Some((s, blas)) = gpu("f32_products_match_the_definition") else {
        return;
    };
    for (i, g) in shapes().into_iter().enumerate() {
        check::<f32, f32>(&s, &blas, g, 10 * i as u64);
    }
}

#[test]
fn bf16_and_f16_products_match_the_definition() {
    let Some((s, blas)) = gpu("bf16_and_f16_products_match_the_definition") else {
        return;
    };
    for (i, g) in shapes().into_iter().enumerate() {
        let seed = 100 + 10 * i as u64;
        check::<bf16, bf16>(&s, &blas, g, seed);
        check::<bf16, f32>(&s, &blas, g, seed + 3);
        check::<f16, f16>(&s, &blas, g, seed + 5);
        check::<f16, f32>(&s, &blas, g, seed + 7);
    }
}

#[test]
fn bad_products_are_refused_before_cublas() {
    let Some((s, blas)) = gpu("bad_products_are_refused_before_cublas") else {
        return;
    };
    let g = MatMul::linear_forward(4, 3, 2);
    let (a, b) = (
        s.alloc_zeros::<f32>(12).unwrap(),
        s.alloc_zeros::<f32>(6).unwrap(),
    );
    let mut short = s.alloc_zeros::<f32>(7).unwrap();
    let err = blas.matmul::<f32, f32>(&g, &a, &b, &mut short).unwrap_err();
    assert!(
        err.to_string().contains("c has 7 elements, expected 8"),
        "{err}"
    );
    let mut c16 = s.alloc_zeros::<bf16>(8).unwrap();
    let err = blas.matmul::<f32, bf16>(&g, &a, &b, &mut c16).unwrap_err();
    assert!(err.to_string().contains("f32 inputs give f32"), "{err}");
}
