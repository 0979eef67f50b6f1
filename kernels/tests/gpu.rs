//! Every kernel on the GPU against its host twin: bitwise for casts, axpby, division by a
//! scalar, clipping (its coefficient and the scaling), the engine's grad scaler (unscaling,
//! its decision, SGD as decided), memset (and many
//! buffers zeroed at once), the ring's reductions, SGD and the sum of squares (NaN results:
//! both NaN), AdamW within 1 ulp (0 expected: the kernels round every operation as the twin
//! does). Without a GPU each test prints `skipped: no GPU (<reason>)` and passes; with one,
//! NVRTC must be found (`fsdp_device::cuda::libs`).

mod common;

use std::sync::Arc;

use common::{down, gpu_stream, splitmix64, up};
use cudarc::driver::CudaStream;
use fsdp_kernels::host::{self, AdamW, AdamWScalars, KernelFloat, ReduceKind, Sgd, SgdScalars};
use fsdp_kernels::{launch, KernelError};
use half::{bf16, f16};

/// Values with every kind of exponent, signs, zeros, infinities, NaNs and subnormals.
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut state = seed;
    (0..n)
        .map(|i| {
            let z = splitmix64(&mut state);
            match i % 101 {
                0 => 0.0,
                1 => -0.0,
                2 => f64::INFINITY,
                3 => f64::NAN,
                4 => 3e-6,  // an f16 subnormal
                5 => 1e-40, // an f32 subnormal
                _ => {
                    let unit = (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                    unit * 2f64.powi(((z & 0x3f) as i32) - 32)
                }
            }
        })
        .collect()
}

fn as_t<T: KernelFloat>(v: &[f64]) -> Vec<T> {
    v.iter()
        .map(|&x| {
            if T::NAME == "f64" {
                T::store(<T::C as host::Compute>::from_f64(x))
            } else {
                T::store(<T::C as host::Compute>::from_f64(x as f32 as f64))
            }
        })
        .collect()
}

fn assert_same<T: KernelFloat>(what: &str, gpu: &[T], host: &[T]) {
    assert_eq!(gpu.len(), host.len());
    for (i, (a, b)) in gpu.iter().zip(host).enumerate() {
        assert!(
            a.bits() == b.bits() || (a.is_nan() && b.is_nan()),
            "{what} [{i}]: GPU {a:?} ({:#x}) vs host {b:?} ({:#x})",
            a.bits(),
            b.bits()
        );
    }
}

fn cast_pair<S: host::CastFloat, D: host::CastFloat>(s: &Arc<CudaStream>) {
    let src: Vec<S> = as_t(&values(100_003, 11));
    let mut want = vec![D::default(); src.len()];
    host::cast(&src, &mut want).unwrap();
    let d_src = up(s, &src);
    let mut d_dst = s.alloc_zeros::<D>(src.len()).unwrap();
    launch::cast(s, &d_src, &mut d_dst).unwrap();
    let got = down(s, &d_dst);
    // Casts are integer operations on the bits: equal bits, NaNs included.
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.bits(), b.bits(), "cast {}->{} [{i}]", S::NAME, D::NAME);
    }
}

#[test]
fn casts_equal_their_twins() {
    let Some(s) = gpu_stream("casts_equal_their_twins") else {
        return;
    };
    cast_pair::<f32, bf16>(&s);
    cast_pair::<f32, f16>(&s);
    cast_pair::<bf16, f32>(&s);
    cast_pair::<f16, f32>(&s);
    cast_pair::<bf16, f16>(&s);
    cast_pair::<f16, bf16>(&s);
    // f32 → bf16 runs four elements a thread where the addresses allow it: every tail length,
    // and views whose first element is not 16-byte (source) or 8-byte (destination) aligned.
    let src: Vec<f32> = as_t(&values(1031, 12));
    let mut want = vec![bf16::ZERO; src.len()];
    host::cast(&src, &mut want).unwrap();
    let d_src = up(&s, &src);
    for (from, to) in [
        (0, 1031),
        (0, 1),
        (0, 3),
        (0, 4),
        (0, 7),
        (1, 1031),
        (2, 1030),
        (4, 1031),
    ] {
        for shift in [0, 1, 4] {
            let mut d_dst = s.alloc_zeros::<bf16>(to - from + shift).unwrap();
            let view = d_src.slice(from..to);
            launch::cast(&s, &view, &mut d_dst.slice_mut(shift..)).unwrap();
            let got = down(&s, &d_dst);
            for (i, (a, b)) in got[shift..].iter().zip(&want[from..to]).enumerate() {
                assert_eq!(
                    a.bits(),
                    b.bits(),
                    "cast f32->bf16 of [{from}..{to}) at +{shift}: [{i}]"
                );
            }
        }
    }
    let (a, mut b) = (up(&s, &[1.0f32; 4]), s.alloc_zeros::<bf16>(3).unwrap());
    assert!(matches!(
        launch::cast(&s, &a, &mut b),
        Err(KernelError::Length { .. })
    ));
}

fn reduce_type<T: KernelFloat>(s: &Arc<CudaStream>) {
    let n = 70_001;
    let acc: Vec<T> = as_t(&values(n, 21));
    let x: Vec<T> = as_t(&values(n, 22));
    let (d_acc, d_x) = (up(s, &acc), up(s, &x));
    for op in ReduceKind::ALL {
        for finish in [None, Some(3u32)] {
            let mut want = vec![T::default(); n];
            host::reduce(op, &mut want, &acc, &x, finish).unwrap();
            let mut d_dst = s.alloc_zeros::<T>(n).unwrap();
            launch::reduce(s, op, &mut d_dst, &d_acc, &d_x, finish).unwrap();
            assert_same(
                &format!("{op:?} {finish:?} {}", T::NAME),
                &down(s, &d_dst),
                &want,
            );
            let mut d_in = up(s, &x);
            launch::reduce_in_place(s, op, &mut d_in, &d_acc, finish).unwrap();
            assert_same(
                &format!("in place {op:?} {}", T::NAME),
                &down(s, &d_in),
                &want,
            );
        }
    }
}

#[test]
fn ring_reductions_equal_their_twins() {
    let Some(s) = gpu_stream("ring_reductions_equal_their_twins") else {
        return;
    };
    reduce_type::<f32>(&s);
    reduce_type::<f64>(&s);
    reduce_type::<bf16>(&s);
    reduce_type::<f16>(&s);
}

fn axpby_memset_type<T: KernelFloat>(s: &Arc<CudaStream>) {
    let n = 50_000;
    let x: Vec<T> = as_t(&values(n, 31));
    let y: Vec<T> = as_t(&values(n, 32));
    let alpha = <T::C as host::Compute>::from_f64(0.37);
    let beta = <T::C as host::Compute>::from_f64(-1.3);
    let mut want = y.clone();
    host::axpby(alpha, &x, beta, &mut want).unwrap();
    let (d_x, mut d_y) = (up(s, &x), up(s, &y));
    launch::axpby(s, alpha, &d_x, beta, &mut d_y).unwrap();
    assert_same(&format!("axpby {}", T::NAME), &down(s, &d_y), &want);
    let d = <T::C as host::Compute>::from_f64(3.0);
    host::div_scalar(d, &mut want);
    launch::div_scalar(s, d, &mut d_y).unwrap();
    assert_same(&format!("div_scalar {}", T::NAME), &down(s, &d_y), &want);
    let v = T::store(<T::C as host::Compute>::from_f64(-2.75));
    launch::memset(s, &mut d_y, v).unwrap();
    assert_same(&format!("memset {}", T::NAME), &down(s, &d_y), &vec![v; n]);
}

#[test]
fn axpby_and_memset_equal_their_twins() {
    let Some(s) = gpu_stream("axpby_and_memset_equal_their_twins") else {
        return;
    };
    axpby_memset_type::<f32>(&s);
    axpby_memset_type::<f64>(&s);
    axpby_memset_type::<bf16>(&s);
    axpby_memset_type::<f16>(&s);
}

fn grads(n: usize, seed: u64) -> Vec<f32> {
    values(n, seed)
        .into_iter()
        .map(|v| {
            if v.is_finite() {
                (v * 1e3) as f32
            } else {
                0.25
            }
        })
        .collect()
}

fn ulps(a: f32, b: f32) -> u32 {
    let key = |x: f32| {
        let i = x.to_bits() as i32;
        if i < 0 {
            i32::MIN.wrapping_sub(i)
        } else {
            i
        }
    };
    key(a).wrapping_sub(key(b)).unsigned_abs()
}

fn adamw_state<S: host::MomentFloat>(s: &Arc<CudaStream>) -> u32 {
    let n = 100_000;
    let cfg = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut p = grads(n, 41);
    let (mut m, mut v) = (vec![S::default(); n], vec![S::default(); n]);
    let (mut dp, mut dm, mut dv) = (up(s, &p), up(s, &m), up(s, &v));
    let mut worst = 0;
    for step in 1..=5 {
        let g = grads(n, 50 + step);
        let sc = AdamWScalars::new(&cfg, step).unwrap();
        host::adamw(&sc, &mut p, &g, &mut m, &mut v).unwrap();
        launch::adamw(s, &sc, &mut dp, &up(s, &g), &mut dm, &mut dv).unwrap();
        let gp = down(s, &dp);
        for i in 0..n {
            worst = worst.max(ulps(gp[i], p[i]));
        }
        assert!(worst <= 1, "AdamW ({}) differs by {worst} ulps", S::NAME);
        assert_same("exp_avg", &down(s, &dm), &m);
        assert_same("exp_avg_sq", &down(s, &dv), &v);
    }
    worst
}

#[test]
fn optimizers_equal_their_twins() {
    let Some(s) = gpu_stream("optimizers_equal_their_twins") else {
        return;
    };
    let w32 = adamw_state::<f32>(&s);
    let w16 = adamw_state::<bf16>(&s);
    println!("AdamW: at most {w32} ulps (f32 state), {w16} ulps (bf16 state)");
    let n = 30_000;
    for (momentum, wd, nesterov) in [(0.0, 0.0, false), (0.9, 0.01, false), (0.9, 0.0, true)] {
        let cfg = Sgd {
            lr: 0.1,
            momentum,
            dampening: 0.0,
            weight_decay: wd,
            nesterov,
        };
        let (mut p, mut b) = (grads(n, 61), vec![0.0f32; n]);
        let (mut dp, mut db) = (up(&s, &p), up(&s, &b));
        for step in 1..=3 {
            let g = grads(n, 70 + step);
            let sc = SgdScalars::new(&cfg, step).unwrap();
            host::sgd(&sc, &mut p, &g, &mut b).unwrap();
            launch::sgd(&s, &sc, &mut dp, &up(&s, &g), &mut db).unwrap();
            assert_same(&format!("sgd {cfg:?}"), &down(&s, &dp), &p);
            assert_same("momentum", &down(&s, &db), &b);
        }
    }
}

#[test]
fn sum_of_squares_equals_its_twin() {
    let Some(s) = gpu_stream("sum_of_squares_equals_its_twin") else {
        return;
    };
    for n in [0usize, 1, 4095, 4096, 4097, 1_000_003, 1 << 24] {
        let x = grads(n, 81);
        let want = host::sum_of_squares(&x);
        let mut out = s.alloc_zeros::<f64>(1).unwrap();
        launch::sum_of_squares(&s, &up(&s, &x), &mut out).unwrap();
        let got = down(&s, &out)[0];
        assert_eq!(got.to_bits(), want.to_bits(), "n {n}: {got} vs {want}");
    }
}

/// `clip_coefficient` on norms below, at and above `max_norm`, infinite and NaN (and `+∞` as
/// `max_norm`), then `scale_by_f32` with each coefficient: the norm, the coefficient and every
/// scaled gradient bitwise their twins'.
#[test]
fn clipping_on_the_device_equals_its_twin() {
    let Some(s) = gpu_stream("clipping_on_the_device_equals_its_twin") else {
        return;
    };
    let x = grads(100_003, 91);
    let cases = [
        (0.25, 0.5, 1.0),
        (3.0, 1.0, 1.0),
        (0.5, 0.5, 1.0),
        (1e6, 2.5, 0.05),
        (f64::INFINITY, 0.0, 1.0),
        (f64::NAN, 1.0, 1.0),
        (4.0, 5.0, f64::INFINITY),
    ];
    for (sharded, replicated, max_norm) in cases {
        let want = host::clip_coefficient(sharded, replicated, max_norm);
        let mut out = s.alloc_zeros::<f64>(2).unwrap();
        let (d_s, d_r) = (up(&s, &[sharded]), up(&s, &[replicated]));
        launch::clip_coefficient(&s, &d_s, &d_r, max_norm, &mut out).unwrap();
        let got = down(&s, &out);
        let what = format!("clip_coefficient({sharded}, {replicated}, {max_norm})");
        assert_same(&what, &got, &want);
        let mut want_x = x.clone();
        host::scale_by(&mut want_x, want[1]);
        let mut d_x = up(&s, &x);
        launch::scale_by(&s, &mut d_x, &out.slice(1..2)).unwrap();
        assert_same(&format!("scale_by after {what}"), &down(&s, &d_x), &want_x);
    }
}

/// `gather_segments`: 200 copies (three launches) of f32 and of bf16 widened, at odd offsets
/// and lengths (zero among them), into one f32 buffer; every element bitwise the host's copy,
/// the rest of the buffer untouched.
#[test]
fn gathered_copies_equal_the_hosts() {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let Some(s) = gpu_stream("gathered_copies_equal_the_hosts") else {
        return;
    };
    let f = as_t::<f32>(&values(5000, 91));
    let h = as_t::<bf16>(&values(5000, 92));
    let (gf, gh) = (up(&s, &f), up(&s, &h));
    let total = 200 * 40;
    let mut want = vec![f32::from_bits(0x7fc0_1234); total];
    let mut gout = up(&s, &want);
    let mut copies = Vec::new();
    {
        let (pf, _a) = gf.device_ptr(&s);
        let (ph, _b) = gh.device_ptr(&s);
        let (po, _c) = gout.device_ptr_mut(&s);
        for k in 0..200usize {
            let (len, src_at, dst_at) = (k % 37, (k * 131) % 4900, k * 40 + k % 3);
            let widen = k % 2 == 1;
            for j in 0..len {
                want[dst_at + j] = if widen {
                    h[src_at + j].to_f32()
                } else {
                    f[src_at + j]
                };
            }
            let (base, size) = if widen { (ph, 2) } else { (pf, 4) };
            copies.push(launch::GatherCopy {
                src: base + (src_at * size) as u64,
                dst: po + (dst_at * 4) as u64,
                len,
                widen,
            });
        }
        // SAFETY: every range lies in its buffer (offsets and lengths chosen above), the
        // destinations are disjoint, and the buffers outlive the stream's work (downloaded
        // below on the same stream).
        unsafe { launch::gather_copies(&s, &copies) }.unwrap();
    }
    assert_same("gathered copies", &down(&s, &gout), &want);
}

/// 200 buffers zeroed in three launches (`zero_segments`): every element +0, the last
/// element of each tail and a buffer left out of the list untouched.
#[test]
fn zeroed_buffers_are_zero() {
    let Some(s) = gpu_stream("zeroed_buffers_are_zero") else {
        return;
    };
    let lens: Vec<usize> = (0..200).map(|i| 1 + (i * 7919) % 70_000).collect();
    let mut bufs: Vec<_> = lens.iter().map(|&n| up(&s, &vec![7.5f32; n])).collect();
    let kept = up(&s, &[7.5f32; 33]);
    let mut list: Vec<_> = bufs.iter_mut().collect();
    launch::fill_zero_many(&s, &mut list).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        let v = down(&s, b);
        assert!(
            v.iter().all(|x| x.to_bits() == 0),
            "buffer {i} ({})",
            lens[i]
        );
    }
    launch::fill_zero_many(&s, &mut []).unwrap();
    assert!(down(&s, &kept).iter().all(|&x| x == 7.5));
}

/// The engine's grad scaler on the device: `unscale_by_f32` at scales that round,
/// `engine_decide` over a run of steps and skips with overflows and non-finite losses, with the
/// scaler, the non-finite rule or both (every scalar bitwise), and `sgd_decided_f32`
/// applied or not, with each choice and a decided gradient — bitwise their twins.
#[test]
fn grad_scaler_kernels_equal_their_twins() {
    use host::{EngineDecision, NonfiniteRule, ScalerRule, SgdChoice};
    use host::{STEP_APPLIED, STEP_CHOICE, STEP_UNSCALE};
    let Some(s) = gpu_stream("grad_scaler_kernels_equal_their_twins") else {
        return;
    };
    let x = grads(100_003, 93);
    for scale in [65536.0, 1000.5, 3.0, 1.0, 0.3] {
        let mut want = x.clone();
        host::unscale_by(&mut want, scale);
        let mut d_x = up(&s, &x);
        launch::unscale_by(&s, &mut d_x, &up(&s, &[scale])).unwrap();
        assert_same(&format!("unscale_by {scale}"), &down(&s, &d_x), &want);
    }
    let rule = ScalerRule {
        growth_factor: 3.0,
        backoff_factor: 0.3,
        growth_interval: 2,
    };
    // With the scaler alone, the scaler and the non-finite rule, the rule alone (a limit
    // reached at the third non-finite step, or none).
    let nonfinite = |limit| Some(NonfiniteRule { skip_limit: limit });
    for (scaler, guard) in [
        (Some(rule), None),
        (Some(rule), nonfinite(Some(2))),
        (None, nonfinite(Some(2))),
        (None, nonfinite(None)),
    ] {
        let mut want = host::step_scalars(0, Some((1000.5, 0, 0)));
        let mut got = up(&s, &want);
        for i in 0..12u32 {
            let sharded = if i % 4 == 3 {
                f64::INFINITY
            } else {
                f64::from(i)
            };
            let loss = if i % 6 == 5 {
                f64::NAN
            } else {
                f64::from(i) * 0.5
            };
            let d = EngineDecision {
                scaler,
                nonfinite: guard,
                base_steps: u64::from(i / 2),
                take: i % 5 != 4,
            };
            host::engine_decide(&d, &mut want, sharded, 0.25, loss).unwrap();
            let (d_s, d_r, d_l) = (up(&s, &[sharded]), up(&s, &[0.25]), up(&s, &[loss]));
            let l = guard.map(|_| &d_l);
            launch::engine_decide(&s, &d, &mut got, &d_s, &d_r, l).unwrap();
            let what = format!("engine_decide {scaler:?} {guard:?} step {i}");
            assert_same(&what, &down(&s, &got), &want);
        }
    }
    let cfg = Sgd {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.01,
        nesterov: true,
    };
    let choice = SgdChoice([
        SgdScalars::new(&cfg, 1).unwrap(),
        SgdScalars::new(&cfg, 2).unwrap(),
    ]);
    let n = 30_001;
    let (mut p, mut b) = (grads(n, 95), grads(n, 96));
    let (mut dp, mut db) = (up(&s, &p), up(&s, &b));
    for (applied, k, unscale) in [(0.0, 0.0, 0.0), (1.0, 0.0, 0.0), (1.0, 1.0, 0.125)] {
        let mut sc = host::step_scalars(0, None);
        sc[STEP_APPLIED] = applied;
        sc[STEP_CHOICE] = k;
        sc[STEP_UNSCALE] = unscale;
        let g = grads(n, 97);
        host::sgd_decided(&choice, &sc, &mut p, &g, &mut b).unwrap();
        launch::sgd_decided(&s, &choice, &up(&s, &sc), &mut dp, &up(&s, &g), &mut db).unwrap();
        assert_same(&format!("sgd_decided {applied} {k}"), &down(&s, &dp), &p);
        assert_same("momentum", &down(&s, &db), &b);
    }
}
