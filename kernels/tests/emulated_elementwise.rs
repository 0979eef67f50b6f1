//! The casts', element-wise kernels' and ring reductions' CUDA source run on the host
//! (`common::emulator`: the programs as NVRTC compiles them, a block's threads as host
//! threads), each launched as its launcher launches it (`launch::plan`: the same kernels,
//! grids, parameters and offsets), against its twin bitwise: every cast (and the four-a-thread
//! f32 → bf16 one), axpby, div_scalar, scale_by, unscale_by and memset of every type, the
//! reductions of every operation and type (an average's last step too), gather_segments and
//! zero_segments with their segments passed by value. The inputs hold what rounding gets
//! wrong: NaN, infinities, zeros of both signs, subnormals and values halfway between 16-bit
//! neighbours. What this cannot check is the hardware itself: `tests/gpu.rs` does, on a GPU.

mod common;

use common::emulator::{addr, bytes_of, values_of, Emulator};
use fsdp_kernels::host::{self, KernelFloat, ReduceKind};
use fsdp_kernels::launch::plan::Param;
use fsdp_kernels::launch::{self, plan};
use fsdp_kernels::Program;
use half::{bf16, f16};

/// The element types the kernels take, to and from their bits.
trait Elem: KernelFloat {
    fn from_bits(b: u64) -> Self;
    /// An input value near `v` (any rounding: inputs only).
    fn near(v: f32) -> Self;
    const SIZE: usize;
}
impl Elem for f32 {
    fn from_bits(b: u64) -> Self {
        f32::from_bits(b as u32)
    }
    fn near(v: f32) -> Self {
        v
    }
    const SIZE: usize = 4;
}
impl Elem for f64 {
    fn from_bits(b: u64) -> Self {
        f64::from_bits(b)
    }
    fn near(v: f32) -> Self {
        // Below f32's last bits too, so that f64's own rounding is exercised.
        f64::from(v) * (1.0 + f64::EPSILON * 3.0)
    }
    const SIZE: usize = 8;
}
impl Elem for bf16 {
    fn from_bits(b: u64) -> Self {
        bf16::from_bits(b as u16)
    }
    fn near(v: f32) -> Self {
        bf16::from_f32(v)
    }
    const SIZE: usize = 2;
}
impl Elem for f16 {
    fn from_bits(b: u64) -> Self {
        f16::from_bits(b as u16)
    }
    fn near(v: f32) -> Self {
        f16::from_f32(v)
    }
    const SIZE: usize = 2;
}

fn to_bytes<T: Elem>(v: &[T]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| x.bits().to_le_bytes()[..T::SIZE].to_vec())
        .collect()
}

fn from_bytes<T: Elem>(b: &[u8]) -> Vec<T> {
    b.chunks_exact(T::SIZE)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..T::SIZE].copy_from_slice(c);
            T::from_bits(u64::from_le_bytes(w))
        })
        .collect()
}

/// Bitwise equality (NaNs' payloads too).
fn assert_bits<T: Elem>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.bits(), w.bits(), "{what}[{i}]: {g:?}, the twin {w:?}");
    }
}

/// `n` f32 values: random magnitudes across the exponent range and the hard cases.
fn hard_f32(n: usize, seed: u64) -> Vec<f32> {
    let special = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1.0e-40,
        -3.0e-39,
        f32::MIN_POSITIVE,
        65504.0,
        65520.0,
        f32::MAX,
        // Halfway between two bf16 values (ties to even both ways) and just past.
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x3f80_8001),
        // Halfway between two f16 values, and an f16 subnormal's halfway.
        f32::from_bits(0x3f80_1000),
        f32::from_bits(0x3380_0000),
        6.0e-8,
    ];
    let mut s = seed;
    (0..n)
        .map(|i| match special.get(i) {
            Some(&v) => v,
            None => {
                let r = common::splitmix64(&mut s);
                let mag = f32::from_bits(0x2000_0000 + (r as u32 % 0x3e00_0000));
                if r >> 63 == 1 {
                    -mag
                } else {
                    mag
                }
            }
        })
        .collect()
}

/// `n` values of `T` near [`hard_f32`]'s (the 16-bit types' own specials among them).
fn hard<T: Elem>(n: usize, seed: u64) -> Vec<T> {
    hard_f32(n, seed).into_iter().map(T::near).collect()
}

fn emulator(test: &str, p: Program) -> Option<&'static Emulator> {
    Emulator::build(p, test)
}

/// Every cast through its kernel, and f32 → bf16 four a thread (from a 16-byte-aligned
/// source, as the launcher takes it) with the rest by the scalar kernel.
#[test]
fn casts_are_their_twins() {
    let Some(emu) = emulator("casts_are_their_twins", Program::Cast) else {
        return;
    };
    let n = 1003;
    fn case<S: Elem + host::CastFloat, D: Elem + host::CastFloat>(emu: &Emulator, n: usize) {
        let src: Vec<S> = hard(n, 7);
        let mut want = vec![D::default(); n];
        host::cast(&src, &mut want).unwrap();
        let mut bufs = vec![to_bytes(&src), vec![0xAB; n * D::SIZE]];
        let launches = plan::cast::<S, D>(addr(0), addr(1), n).unwrap();
        emu.run_plan(&mut bufs, &launches);
        assert_bits(&from_bytes::<D>(&bufs[1]), &want, &launches[0].kernel);
    }
    case::<f32, bf16>(emu, n);
    case::<f32, f16>(emu, n);
    case::<bf16, f32>(emu, n);
    case::<f16, f32>(emu, n);
    case::<bf16, f16>(emu, n);
    case::<f16, bf16>(emu, n);
    assert!(plan::cast::<bf16, bf16>(addr(0), addr(1), n).is_err());
    // f32 → bf16 from aligned addresses: n / 4 groups by the x4 kernel, the last n % 4 by
    // the scalar one. From a source only 4-byte aligned: the scalar kernel alone.
    let src = hard_f32(n + 1, 11);
    for (offset, launches) in [(0, 2), (1, 1)] {
        let mut want = vec![bf16::default(); n];
        host::cast(&src[offset..offset + n], &mut want).unwrap();
        let mut bufs = vec![bytes_of(&src), vec![0xAB; n * 2]];
        let plan = plan::cast::<f32, bf16>(addr(0) + 4 * offset as u64, addr(1), n).unwrap();
        assert_eq!(plan.len(), launches, "{plan:?}");
        assert_eq!(
            plan[0].kernel,
            ["cast_f32_bf16_x4", "cast_f32_bf16"][offset]
        );
        emu.run_plan(&mut bufs, &plan);
        assert_bits(&from_bytes::<bf16>(&bufs[1]), &want, "cast_f32_bf16 (x4)");
    }
    // The x4 kernel given that 4-byte-aligned source is refused, as a GPU faults on it. Not on
    // a GPU itself: a misaligned address there poisons the context for every later test.
    if !emu.on_cuda() {
        let mut bad = plan::cast::<f32, bf16>(addr(0), addr(1), n).unwrap();
        let Param::Ptr(src) = &mut bad[0].params[0] else {
            panic!("{bad:?}")
        };
        *src += 4;
        let mut bufs = vec![bytes_of(&hard_f32(n + 1, 11)), vec![0xAB; n * 2]];
        let msg = emu.run_plan_refused(&mut bufs, &bad, "a misaligned f32x4 pointer");
        assert!(
            msg.contains("parameter 0 is misaligned: buffer 0 + 4 bytes, where its type needs 16"),
            "{msg}"
        );
    }
}

/// A block that reads what another block of its launch writes is refused: `axpby` with `x`
/// one block's span ahead of `y` in the same buffer has block b read the elements block b + 1
/// writes, which on a GPU it may read before or after that write. The emulator runs the launch
/// with every block seeing the launch's start and again one block after another, and the two
/// differ. Not run on a GPU, which has no such check.
#[test]
fn a_block_reading_another_blocks_writes_is_refused() {
    let Some(emu) = emulator(
        "a_block_reading_another_blocks_writes_is_refused",
        Program::Elementwise,
    ) else {
        return;
    };
    if emu.on_cuda() {
        println!("skipped: a GPU does not check this");
        return;
    }
    let (n, span) = (8 * 256, 256usize);
    let bufs = || vec![bytes_of(&hard_f32(n + span, 5))];
    let ahead = plan::axpby::<f32>(0.5, addr(0) + 4 * span as u64, 2.0, addr(0), n);
    assert!(ahead[0].config.grid_dim.0 > 1, "{ahead:?}");
    let mut racy = bufs();
    let msg = emu.run_plan_refused(&mut racy, &ahead, "block b reads what block b + 1 writes");
    assert!(
        msg.contains("axpby_f32: a block read what another block of the launch wrote"),
        "{msg}"
    );
    // `x` where `y` is (each element read and written by one thread) runs, and is the twin's.
    let mut in_place = bufs();
    let x = values_of::<f32>(&in_place[0]);
    let mut want = x.clone();
    host::axpby(0.5, &x, 2.0, &mut want).unwrap();
    emu.run_plan(
        &mut in_place,
        &plan::axpby::<f32>(0.5, addr(0), 2.0, addr(0), n + span),
    );
    assert_bits(&values_of::<f32>(&in_place[0]), &want, "axpby_f32 in place");
}

/// axpby, div_scalar and memset of every type; scale_by and unscale_by (a factor of 1 leaves
/// the values alone).
#[test]
fn elementwise_kernels_are_their_twins() {
    let Some(emu) = emulator("elementwise_kernels_are_their_twins", Program::Elementwise) else {
        return;
    };
    let n = 777;
    fn case<T: Elem>(emu: &Emulator, n: usize, alpha: T::C, beta: T::C, d: T::C, fill: T) {
        let (x, y): (Vec<T>, Vec<T>) = (hard(n, 3), hard(n, 4));
        let mut want = y.clone();
        host::axpby(alpha, &x, beta, &mut want).unwrap();
        let mut bufs = vec![to_bytes(&x), to_bytes(&y)];
        emu.run_plan(
            &mut bufs,
            &plan::axpby::<T>(alpha, addr(0), beta, addr(1), n),
        );
        assert_bits(&from_bytes::<T>(&bufs[1]), &want, "axpby");

        let mut want = y.clone();
        host::div_scalar(d, &mut want);
        let mut bufs = vec![to_bytes(&y)];
        emu.run_plan(&mut bufs, &plan::div_scalar::<T>(d, addr(0), n));
        assert_bits(&from_bytes::<T>(&bufs[0]), &want, "div_scalar");

        let mut want = y.clone();
        host::memset(&mut want, fill);
        let mut bufs = vec![to_bytes(&y)];
        emu.run_plan(&mut bufs, &plan::memset(addr(0), fill, n));
        assert_bits(&from_bytes::<T>(&bufs[0]), &want, "memset");
    }
    case::<f32>(emu, n, 0.3, -1.7, 3.0, -0.0);
    case::<f64>(emu, n, 0.3, -1.7, 3.0, f64::MIN_POSITIVE);
    case::<bf16>(emu, n, 0.3, -1.7, 3.0, bf16::from_f32(-2.5));
    case::<f16>(emu, n, 0.3, -1.7, 7.0, f16::from_f32(1e-7));

    for (kernel, c) in [
        ("scale_by_f32", 0.123_456_789_f64),
        ("scale_by_f32", 1.0),
        ("unscale_by_f32", 65536.0 * 3.0),
        ("unscale_by_f32", 1.0),
    ] {
        let x = hard_f32(n, 5);
        let mut want = x.clone();
        if kernel == "scale_by_f32" {
            host::scale_by(&mut want, c);
        } else {
            host::unscale_by(&mut want, c);
        }
        let mut bufs = vec![bytes_of(&x), bytes_of(&[c])];
        let launches = if kernel == "scale_by_f32" {
            plan::scale_by(addr(0), addr(1), n)
        } else {
            plan::unscale_by(addr(0), addr(1), n)
        };
        assert_eq!(launches[0].kernel, kernel);
        emu.run_plan(&mut bufs, &launches);
        assert_bits(&values_of::<f32>(&bufs[0]), &want, kernel);
    }
}

/// The ring's reductions: every operation of every type, and an average's last step divided
/// by the ranks, rounded as the twin rounds.
#[test]
fn reductions_are_their_twins() {
    let Some(emu) = emulator("reductions_are_their_twins", Program::Reduce) else {
        return;
    };
    let n = 515;
    fn case<T: Elem>(emu: &Emulator, n: usize) {
        let (acc, x): (Vec<T>, Vec<T>) = (hard(n, 21), hard(n, 22));
        for (op, name, finish) in [
            (ReduceKind::Sum, "sum", None),
            (ReduceKind::Avg, "sum", Some(3u32)),
            (ReduceKind::Min, "min", None),
            (ReduceKind::Max, "max", None),
            (ReduceKind::Product, "prod", None),
        ] {
            let mut want = vec![T::default(); n];
            host::reduce(op, &mut want, &acc, &x, finish).unwrap();
            let kernel = format!("reduce_{name}_{}", T::NAME);
            let mut bufs = vec![vec![0xCD; n * T::SIZE], to_bytes(&acc), to_bytes(&x)];
            let launches = plan::reduce::<T>(op, addr(0), addr(1), addr(2), n, finish).unwrap();
            assert_eq!(launches[0].kernel, kernel);
            emu.run_plan(&mut bufs, &launches);
            assert_bits(
                &from_bytes::<T>(&bufs[0]),
                &want,
                &format!("{kernel} {op:?}"),
            );
        }
    }
    case::<f32>(emu, n);
    case::<f64>(emu, n);
    case::<bf16>(emu, n);
    case::<f16>(emu, n);
}

/// gather_segments copies (or widens from bf16) each segment, as `launch::gather_copies`
/// plans it (its segments by value, an empty copy left out, a row of blocks per segment);
/// zero_segments likewise (96 destinations, 96 lengths). Elements outside the segments stay.
#[test]
fn segment_kernels_copy_and_zero_their_segments() {
    let Some(emu) = emulator(
        "segment_kernels_copy_and_zero_their_segments",
        Program::Elementwise,
    ) else {
        return;
    };
    // (length, widen): a long one (several blocks), short ones, an empty one.
    let segs = [
        (5000usize, false),
        (17, true),
        (0, false),
        (2049, true),
        (1, false),
    ];
    let srcs: Vec<Vec<u8>> = segs
        .iter()
        .enumerate()
        .map(|(k, &(n, widen))| {
            let v = hard_f32(n, 40 + k as u64);
            if widen {
                let mut h = vec![bf16::default(); n];
                host::cast(&v, &mut h).unwrap();
                to_bytes(&h)
            } else {
                bytes_of(&v)
            }
        })
        .collect();
    let sentinel = -7.25f32;
    // Buffers: the sources, then the destinations (one element of sentinel past each end).
    let mut bufs: Vec<Vec<u8>> = srcs.clone();
    for &(n, _) in &segs {
        bufs.push(bytes_of(&vec![sentinel; n + 1]));
    }
    let count = segs.len();
    let copies: Vec<launch::GatherCopy> = segs
        .iter()
        .enumerate()
        .map(|(k, &(len, widen))| launch::GatherCopy {
            src: addr(k),
            dst: addr(count + k),
            len,
            widen,
        })
        .collect();
    // The empty copy is left out of the struct.
    let gather = plan::gather_copies(&copies);
    assert_eq!(gather.len(), 1);
    emu.run_plan(&mut bufs, &gather);
    for (k, &(_, widen)) in segs.iter().enumerate() {
        let got: Vec<f32> = values_of(&bufs[count + k]);
        let mut want = if widen {
            from_bytes::<bf16>(&srcs[k])
                .iter()
                .map(|h| h.to_f32())
                .collect::<Vec<f32>>()
        } else {
            values_of(&srcs[k])
        };
        want.push(sentinel);
        assert_bits(&got, &want, &format!("gather_segments, segment {k}"));
    }
    // zero_segments over the destinations (`launch::fill_zero_many`): zeros (+0), the
    // sentinel past each end kept.
    let dsts: Vec<(u64, usize)> = segs
        .iter()
        .enumerate()
        .map(|(k, &(n, _))| (addr(count + k), n))
        .collect();
    let zero = plan::fill_zero_many(&dsts);
    assert_eq!(zero.len(), 1);
    emu.run_plan(&mut bufs, &zero);
    for (k, &(n, _)) in segs.iter().enumerate() {
        let got: Vec<f32> = values_of(&bufs[count + k]);
        let mut want = vec![0.0f32; n];
        want.push(sentinel);
        assert_bits(&got, &want, &format!("zero_segments, segment {k}"));
    }
}
