//! The fused attention's twins on random inputs, for the tests that hold its kernels to them
//! (`gpu_attention.rs` on a GPU, `attention_emulated.rs` on the host).

use fsdp_kernels::host::attention::{self, FusedAttention};
use fsdp_kernels::host::nn::{heads_merge, HeadsLayout};
use fsdp_kernels::host::CastFloat;

/// Uniform values in [-amp, amp) from a splitmix64 stream, rounded to `H`.
pub fn values<H: CastFloat>(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            let z = super::splitmix64(&mut state);
            let u = ((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32;
            H::store(u * amp).load()
        })
        .collect()
}

/// One case's inputs and the twins' outputs.
pub struct Twin {
    /// `q` (its values times `sharp`), `k`, `v` and the heads' output gradient.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub dout: Vec<f32>,
    /// Forward's output as the projection's operand: one sequence of `pairs` heads in token
    /// rows (`layout`), rounded to `H`; backward reads it.
    pub rows: Vec<f32>,
    pub layout: HeadsLayout,
    pub y: Vec<f32>,
    pub lse: Vec<f32>,
    /// `[dq, dk, dv]`.
    pub grads: [Vec<f32>; 3],
}

/// The twins' forward and backward of `a` on random inputs in `H`, `q` scaled by `sharp`.
pub fn twin<H: CastFloat>(a: &FusedAttention, sharp: f32) -> Twin {
    let n = a.len();
    let q = values::<H>(n, 1, sharp);
    let (k, v, dout) = (
        values::<H>(n, 2, 1.0),
        values::<H>(n, 3, 1.0),
        values::<H>(n, 4, 1.0),
    );
    let (mut y, mut lse) = (vec![0.0; n], vec![0.0; a.rows()]);
    attention::flash_forward::<H>(a, &q, &k, &v, &mut y, &mut lse).unwrap();
    let layout = HeadsLayout {
        b: 1,
        t: a.t,
        h: a.pairs,
        d: a.d,
        row: a.pairs * a.d,
        offset: 0,
    };
    let mut rows = vec![0.0f32; layout.rows_len()];
    heads_merge(&y, layout, &mut rows).unwrap();
    let rows: Vec<f32> = rows.iter().map(|&x| H::store(x).load()).collect();
    let mut dsum = vec![0.0; a.rows()];
    attention::flash_backward_dot(&layout, &dout, &rows, &mut dsum).unwrap();
    let mut grads = [vec![0.0; n], vec![0.0; n], vec![0.0; n]];
    let [dq, dk, dv] = &mut grads;
    attention::flash_backward::<H>(a, &q, &k, &v, &dout, &lse, &dsum, dq, dk, dv).unwrap();
    Twin {
        q,
        k,
        v,
        dout,
        rows,
        layout,
        y,
        lse,
        grads,
    }
}

/// The largest `|got − want|` over the largest `|want|` (NaN when a difference is NaN).
pub fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    super::max_abs_diff(got, want) / super::max_abs(want).max(1e-30)
}

/// `got` (a kernel's `lse`) within 1e-5 relative of the twin's (1e-5 absolute below 1).
#[track_caller]
pub fn check_lse(a: &FusedAttention, got: &[f32], want: &[f32]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{a:?}: lse[{i}] {g} vs {w}"
        );
    }
}
