//! The fused attention's kernels (`cu/attention.cu`, flash attention on tensor cores) on the
//! GPU against their host twins (`fsdp_kernels::host::attention`, themselves held to f64
//! attention in the crate's unit tests), and a GPT step with `Attention::Fused` on CUDA
//! against the same step on the twins. Not bitwise: the tensor cores sum in their own order,
//! and the kernels round the probabilities to 16 bits relative to a running maximum (flash
//! attention's online softmax) where the twins use the row's maximum. Both move a value by
//! at most about one 16-bit rounding of the terms it sums (2⁻⁹ relative for bf16, 2⁻¹² for
//! f16), so outputs and gradients are held within 4 such units of their largest value (the
//! sums mix signs and many terms, so most errors cancel), `lse` within 1e-5 relative (f32
//! sums of exponentials). Shapes: one token, `t` not a multiple of the 64-row tile, several
//! tiles and pairs, GPT-2's 1024 tokens, and sharp scores that move the running maximum;
//! heads of 64 and of 32 values.
//! Without a GPU each test prints `skipped: no GPU (<reason>)` and passes.

mod common;

use std::sync::Arc;

use common::flash::{check_lse, rel, twin};
use common::{down, gpu_stream, up};
use cudarc::driver::{CudaSlice, CudaStream};
use fsdp_kernels::host::attention::FusedAttention;
use fsdp_kernels::host::CastFloat;
use fsdp_kernels::launch;
use half::{bf16, f16};

fn upload<H: CastFloat>(s: &Arc<CudaStream>, v: &[f32]) -> CudaSlice<H> {
    let h: Vec<H> = v.iter().map(|&x| H::store(x)).collect();
    up(s, &h)
}

/// Forward and backward of `a` on the GPU against the twins; returns the worst relative
/// differences of `[y, dq, dk, dv]` and checks `lse`.
fn compare<H: CastFloat>(s: &Arc<CudaStream>, a: FusedAttention, sharp: f32) -> [f64; 4] {
    let n = a.len();
    let w = twin::<H>(&a, sharp);
    let (gq, gk, gv) = (
        upload::<H>(s, &w.q),
        upload::<H>(s, &w.k),
        upload::<H>(s, &w.v),
    );
    let mut gy = up(s, &vec![f32::NAN; n]);
    let mut glse = up(s, &vec![f32::NAN; a.rows()]);
    launch::flash_forward::<H>(s, &a, &gq, &gk, &gv, &mut gy, &mut glse).unwrap();
    check_lse(&a, &down(s, &glse), &w.lse);
    let (grows, gdout) = (upload::<H>(s, &w.rows), upload::<H>(s, &w.dout));
    let nan = || up(s, &vec![f32::NAN; n]);
    let (mut gdq, mut gdk, mut gdv) = (nan(), nan(), nan());
    launch::flash_backward::<H>(
        s, &a, &w.layout, &gq, &gk, &gv, &grows, &gdout, &glse, &mut gdq, &mut gdk, &mut gdv,
    )
    .unwrap();
    [
        rel(&down(s, &gy), &w.y),
        rel(&down(s, &gdq), &w.grads[0]),
        rel(&down(s, &gdk), &w.grads[1]),
        rel(&down(s, &gdv), &w.grads[2]),
    ]
}

fn shapes() -> Vec<(FusedAttention, f32)> {
    let a = |pairs, t, d: usize| FusedAttention {
        pairs,
        t,
        d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    vec![
        (a(1, 1, 64), 1.0),
        (a(3, 37, 64), 1.0),
        (a(2, 64, 64), 1.0),
        (a(2, 130, 64), 1.0),
        (a(4, 200, 64), 8.0),
        (a(12, 1024, 64), 1.0),
        (a(3, 37, 32), 1.0),
        (a(2, 150, 32), 8.0),
    ]
}

fn each_shape<H: CastFloat>(test: &str, unit: f64) {
    let Some(s) = gpu_stream(test) else {
        return;
    };
    for (a, sharp) in shapes() {
        let e = compare::<H>(&s, a, sharp);
        println!(
            "{test}: pairs {} t {} d {} sharp {sharp}: y {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}",
            a.pairs, a.t, a.d, e[0], e[1], e[2], e[3]
        );
        for (what, e) in ["y", "dq", "dk", "dv"].iter().zip(e) {
            assert!(e <= 4.0 * unit, "{a:?}, sharp {sharp}: {what} {e:e}");
        }
    }
}

#[test]
fn flash_bf16_equals_its_twin_within_bf16_rounding() {
    each_shape::<bf16>(
        "flash_bf16_equals_its_twin_within_bf16_rounding",
        2f64.powi(-9),
    );
}

#[test]
fn flash_f16_equals_its_twin_within_f16_rounding() {
    each_shape::<f16>(
        "flash_f16_equals_its_twin_within_f16_rounding",
        2f64.powi(-12),
    );
}

#[test]
fn what_the_kernels_do_not_take_is_refused_by_name() {
    let Some(s) = gpu_stream("what_the_kernels_do_not_take_is_refused_by_name") else {
        return;
    };
    let a = FusedAttention {
        pairs: 2,
        t: 8,
        d: 48,
        scale: 0.1,
    };
    let x: CudaSlice<bf16> = up(&s, &vec![bf16::ZERO; a.len()]);
    let (mut y, mut lse) = (
        up(&s, &vec![0.0f32; a.len()]),
        up(&s, &vec![0.0f32; a.rows()]),
    );
    let err = launch::flash_forward::<bf16>(&s, &a, &x, &x, &x, &mut y, &mut lse).unwrap_err();
    assert!(
        err.to_string().contains("heads of 32 or 64 values, not 48"),
        "{err}"
    );
    let a = FusedAttention { d: 64, ..a };
    let x: CudaSlice<f32> = up(&s, &vec![0.0f32; a.len()]);
    let (mut y, mut lse) = (
        up(&s, &vec![0.0f32; a.len()]),
        up(&s, &vec![0.0f32; a.rows()]),
    );
    let err = launch::flash_forward::<f32>(&s, &a, &x, &x, &x, &mut y, &mut lse).unwrap_err();
    assert!(err.to_string().contains("bf16 or f16 operands"), "{err}");
}

#[path = "gpu_attention/model.rs"]
mod model;
