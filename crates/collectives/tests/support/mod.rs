//! What the backends' tests share: deterministic inputs whose reductions are exact in every
//! element type, a naive host reference, order-sensitive random data, and one routine that runs
//! every collective on a communicator and checks each result.

// Each test binary uses a different part of this module.
#![allow(dead_code)]
#![allow(clippy::needless_range_loop)] // index arithmetic mirrors the collectives' definitions

pub mod cases;
pub mod procs;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fsdp_collectives::{CollectiveError, Communicator, ReduceOp, Work};
use fsdp_device::shared::SharedHostStorage;
use fsdp_device::{with_element, AccessMode, Buffer, DType, Element, HostStorage, Stream};

/// Element `i` of rank `rank`'s input for `op`: small integers (sums are exact in every element
/// type) or powers of two (so are products).
pub fn val(op: ReduceOp, rank: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Product => [1.0, -1.0, 2.0, 0.5][(rank * 3 + i) % 4],
        _ => ((rank * 7 + i * 13) % 17) as f64 - 8.0,
    }
}

static SHARED: AtomicBool = AtomicBool::new(false);

/// From now on, this process's data buffers ([`zeros`], [`make`]) live in
/// [`SharedHostStorage`], which the shared-memory transport's peers read in place.
pub fn use_shared_buffers() {
    SHARED.store(true, Ordering::Relaxed);
}

/// `len` zeros of `dtype`: ordinary host memory, or shared after [`use_shared_buffers`].
pub fn zeros(dtype: DType, len: usize) -> Buffer {
    if SHARED.load(Ordering::Relaxed) {
        let s = SharedHostStorage::zeroed(len * dtype.size_in_bytes()).unwrap();
        Buffer::from_storage(Box::new(s), dtype).unwrap()
    } else {
        Buffer::zeros(dtype, len).unwrap()
    }
}

/// A buffer of `dtype` holding `vals`, each rounded once.
pub fn make(dtype: DType, vals: &[f64]) -> Buffer {
    with_element!(dtype, T => {
        let v: Vec<T> = vals.iter().map(|&x| T::from_f64(x)).collect();
        let b = zeros(dtype, v.len());
        b.copy_from_slice(&v).unwrap();
        b
    })
}

/// The buffer's elements as f64.
pub fn read(buf: &Buffer) -> Vec<f64> {
    with_element!(buf.dtype(), T => buf.to_vec::<T>().unwrap().into_iter().map(|x| x.to_f64()).collect())
}

/// The reduction of element `i` over `world` ranks, computed in the element type.
pub fn reduced(dtype: DType, op: ReduceOp, world: usize, i: usize) -> f64 {
    with_element!(dtype, T => {
        let mut acc = T::from_f64(val(op, 0, i));
        for r in 1..world {
            acc = op.combine(acc, T::from_f64(val(op, r, i)));
        }
        op.finish(acc, world).to_f64()
    })
}

/// Run every collective once on `comm` (all issued before any is waited for) and check this
/// rank's results against the host reference.
pub fn check_every_collective(
    comm: &dyn Communicator,
    dtype: DType,
    len: usize,
    op: ReduceOp,
    root: usize,
) {
    let world = comm.world_size();
    let r = comm.rank();
    let mine: Vec<f64> = (0..len).map(|i| val(op, r, i)).collect();

    // all_gather_base: output[q*len + i] = val(q, i)
    let input = make(dtype, &mine);
    let output = zeros(dtype, world * len);
    let ag = comm.all_gather_base(&input, &output).unwrap();

    // reduce_scatter_base: each rank contributes world*len values val(r, j)
    let rs_in = make(
        dtype,
        &(0..world * len).map(|j| val(op, r, j)).collect::<Vec<_>>(),
    );
    let rs_out = zeros(dtype, len);
    let rs = comm.reduce_scatter_base(&rs_in, &rs_out, op).unwrap();

    // all_reduce over a length not divisible by the world size
    let ar = make(dtype, &mine);
    let ar_w = comm.all_reduce(&ar, op).unwrap();

    // broadcast from root, reduce to root
    let bc = make(dtype, &mine);
    let bc_w = comm.broadcast(&bc, root).unwrap();
    let red = make(dtype, &mine);
    let red_w = comm.reduce(&red, op, root).unwrap();

    // unequal all_gather: rank q contributes len + q elements
    let sizes: Vec<usize> = (0..world).map(|q| len + q).collect();
    let ug_in = make(
        dtype,
        &(0..sizes[r]).map(|i| val(op, r, i)).collect::<Vec<_>>(),
    );
    let ug_out: Vec<Buffer> = sizes.iter().map(|&s| zeros(dtype, s)).collect();
    let ug = comm.all_gather(&ug_in, &ug_out).unwrap();

    let bar = comm.barrier().unwrap();
    for w in [&ag, &rs, &ar_w, &bc_w, &red_w, &ug, &bar] {
        w.wait().unwrap();
    }

    let got = read(&output);
    for q in 0..world {
        for i in 0..len {
            let want = with_element!(dtype, T => T::from_f64(val(op, q, i)).to_f64());
            assert_eq!(
                got[q * len + i],
                want,
                "all_gather_base rank {r} block {q} elem {i}"
            );
        }
    }
    let got = read(&rs_out);
    for i in 0..len {
        assert_eq!(
            got[i],
            reduced(dtype, op, world, r * len + i),
            "reduce_scatter rank {r} elem {i}"
        );
    }
    let got = read(&ar);
    for i in 0..len {
        assert_eq!(
            got[i],
            reduced(dtype, op, world, i),
            "all_reduce rank {r} elem {i}"
        );
    }
    let got = read(&bc);
    for i in 0..len {
        assert_eq!(got[i], val(op, root, i), "broadcast rank {r} elem {i}");
    }
    let got = read(&red);
    for i in 0..len {
        let want = if r == root {
            reduced(dtype, op, world, i)
        } else {
            val(op, r, i)
        };
        assert_eq!(got[i], want, "reduce rank {r} elem {i}");
    }
    for (q, o) in ug_out.iter().enumerate() {
        let got = read(o);
        assert_eq!(got.len(), sizes[q]);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, val(op, q, i), "all_gather rank {r} from {q} elem {i}");
        }
    }
}

/// Deterministic values of very different magnitudes and signs, so that the result of a
/// reduction depends on its order; a few NaNs and infinities too.
pub fn noisy(seed: u64, i: usize) -> f64 {
    let mut x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    match x % 211 {
        0 => f64::NAN,
        1 => f64::INFINITY,
        _ => {
            let mant = (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            mant * 2f64.powi(((x >> 3) % 24) as i32 - 12)
        }
    }
}

/// The raw bits of every element.
pub fn bits(buf: &Buffer) -> Vec<u64> {
    match buf.dtype() {
        DType::F32 => buf
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::F64 => buf
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => buf
            .to_vec::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::F16 => buf
            .to_vec::<half::f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
    }
}

/// Every reducing collective for every element type and op on random data; the bits of each
/// result, in call order.
pub fn reductions(comm: &dyn Communicator, len: usize) -> Vec<Vec<u64>> {
    let (r, world) = (comm.rank(), comm.world_size());
    let mut out = Vec::new();
    for (di, dtype) in DType::ALL.into_iter().enumerate() {
        for (oi, op) in ReduceOp::ALL.into_iter().enumerate() {
            let seed = (r as u64 + 1) * 1000 + di as u64 * 10 + oi as u64;
            let data = |n: usize, salt: u64| -> Vec<f64> {
                (0..n).map(|i| noisy(seed ^ (salt << 32), i)).collect()
            };
            let ar = make(dtype, &data(len, 1));
            let rs_in = make(dtype, &data(world * len, 2));
            let rs_out = zeros(dtype, len);
            let red = make(dtype, &data(len, 3));
            let w1 = comm.all_reduce(&ar, op).unwrap();
            let w2 = comm.reduce_scatter_base(&rs_in, &rs_out, op).unwrap();
            let w3 = comm.reduce(&red, op, world - 1).unwrap();
            for w in [w1, w2, w3] {
                w.wait().unwrap();
            }
            out.push(bits(&ar));
            out.push(bits(&rs_out));
            out.push(bits(&red));
        }
    }
    out
}

/// A buffer maker: host buffers for the backends that move data, meta (or host) buffers for the
/// dry run.
pub type MakeBuffer<'a> = &'a dyn Fn(DType, usize) -> Buffer;

/// Host buffers of zeros.
pub fn host_buffer(dtype: DType, len: usize) -> Buffer {
    Buffer::zeros(dtype, len).unwrap()
}

/// Buffers on the meta device.
pub fn meta_buffer(dtype: DType, len: usize) -> Buffer {
    Buffer::meta(dtype, len).unwrap()
}

/// Issue, on a group of at least 2 ranks, every kind of call that breaks a rule of the
/// arguments (each rank issues the same kind, with its own rank's geometry), and return each
/// case's name and error. Each must fail on the issuing rank with
/// [`CollectiveError::InvalidArgument`], on every backend, with the same reason.
pub fn invalid_calls(
    comm: &dyn Communicator,
    buf: MakeBuffer<'_>,
) -> Vec<(&'static str, CollectiveError)> {
    let (w, r) = (comm.world_size(), comm.rank());
    assert!(w >= 2, "the overlap cases need another rank's block");
    let f32s = |n| buf(DType::F32, n);
    let other = (r + 1) % w;
    let mut out = Vec::new();
    let mut case = |name: &'static str, res: Result<Work, CollectiveError>| match res {
        Ok(_) => panic!("rank {r}: {name} was accepted"),
        Err(e) => out.push((name, e)),
    };

    case(
        "all_gather_base: output size",
        comm.all_gather_base(&f32s(4), &f32s(4 * w + 1)),
    );
    case(
        "all_gather_base: element types",
        comm.all_gather_base(&f32s(4), &buf(DType::BF16, 4 * w)),
    );
    let ag_out = f32s(4 * w);
    case(
        "all_gather_base: input overlaps another rank's block",
        comm.all_gather_base(&ag_out.slice(other * 4..other * 4 + 4).unwrap(), &ag_out),
    );
    case(
        "reduce_scatter_base: input size",
        comm.reduce_scatter_base(&f32s(4 * w + 2), &f32s(4), ReduceOp::Sum),
    );
    case(
        "reduce_scatter_base: element types",
        comm.reduce_scatter_base(&buf(DType::F64, 4 * w), &f32s(4), ReduceOp::Avg),
    );
    let rs_in = f32s(4 * w);
    case(
        "reduce_scatter_base: output overlaps another rank's chunk",
        comm.reduce_scatter_base(
            &rs_in,
            &rs_in.slice(other * 4..other * 4 + 4).unwrap(),
            ReduceOp::Max,
        ),
    );
    case("broadcast: root", comm.broadcast(&f32s(3), w));
    case("reduce: root", comm.reduce(&f32s(3), ReduceOp::Sum, w + 3));
    let short: Vec<Buffer> = (0..w - 1).map(|_| f32s(2)).collect();
    case(
        "all_gather: one output per rank",
        comm.all_gather(&f32s(2), &short),
    );
    let mut outs: Vec<Buffer> = (0..w).map(|_| f32s(2)).collect();
    outs[r] = f32s(3);
    case(
        "all_gather: this rank's output length",
        comm.all_gather(&f32s(2), &outs),
    );
    let mut outs: Vec<Buffer> = (0..w).map(|_| f32s(2)).collect();
    outs[other] = outs[r].clone();
    case(
        "all_gather: overlapping outputs",
        comm.all_gather(&f32s(2), &outs),
    );
    let mut outs: Vec<Buffer> = (0..w).map(|_| f32s(2)).collect();
    outs[other] = buf(DType::F16, 2);
    case(
        "all_gather: element types",
        comm.all_gather(&f32s(2), &outs),
    );
    out
}

/// Issue every collective with valid arguments (the in-place forms included, empty buffers and
/// every element type), and return each call's name and work.
pub fn valid_calls(comm: &dyn Communicator, buf: MakeBuffer<'_>) -> Vec<(String, Work)> {
    let (w, r) = (comm.world_size(), comm.rank());
    let mut out = Vec::new();
    for dtype in DType::ALL {
        for n in [0, 5] {
            let name = |op: &str| format!("{op}({dtype}, {n})");
            let mut call = |op: &str, res: Result<Work, CollectiveError>| {
                out.push((
                    name(op),
                    res.unwrap_or_else(|e| panic!("{}: {e}", name(op))),
                ));
            };
            call(
                "all_gather_base",
                comm.all_gather_base(&buf(dtype, n), &buf(dtype, w * n)),
            );
            let full = buf(dtype, w * n);
            call(
                "all_gather_base in place",
                comm.all_gather_base(&full.slice(r * n..(r + 1) * n).unwrap(), &full),
            );
            call(
                "reduce_scatter_base",
                comm.reduce_scatter_base(&buf(dtype, w * n), &buf(dtype, n), ReduceOp::Sum),
            );
            let full = buf(dtype, w * n);
            call(
                "reduce_scatter_base in place",
                comm.reduce_scatter_base(
                    &full,
                    &full.slice(r * n..(r + 1) * n).unwrap(),
                    ReduceOp::Avg,
                ),
            );
            call("all_reduce", comm.all_reduce(&buf(dtype, n), ReduceOp::Max));
            call("broadcast", comm.broadcast(&buf(dtype, n), w - 1));
            call("reduce", comm.reduce(&buf(dtype, n), ReduceOp::Product, 0));
            let outs: Vec<Buffer> = (0..w).map(|q| buf(dtype, n + q)).collect();
            call("all_gather", comm.all_gather(&buf(dtype, n + r), &outs));
        }
    }
    out.push(("barrier".into(), comm.barrier().unwrap()));
    out
}

/// A stream-ordered host buffer of `len` f32.
pub fn ordered(len: usize) -> Buffer {
    Buffer::stream_ordered(Box::new(HostStorage::zeroed(len * 4).unwrap()), DType::F32).unwrap()
}

/// Write `values` into `buf` on `stream`, late (after a sleep), as a GPU kernel would.
pub fn write_late(stream: &Stream, buf: &Buffer, values: Vec<f32>) {
    let u = buf.use_on(stream, AccessMode::Exclusive).unwrap();
    let p = u.device_ptr() as usize;
    stream
        .enqueue(move || {
            std::thread::sleep(Duration::from_millis(30));
            // SAFETY: `values.len()` f32 of the buffer, used by this stream's work only, alive
            // until it completed (held references).
            let dst = unsafe { std::slice::from_raw_parts_mut(p as *mut f32, values.len()) };
            dst.copy_from_slice(&values);
        })
        .unwrap();
    u.finish();
}

/// Copy `buf` out on `stream` (after what it waits for), then wait on the host.
pub fn read_on(stream: &Stream, buf: &Buffer) -> Vec<f32> {
    let out = Buffer::zeros(DType::F32, buf.len()).unwrap();
    let u = buf.use_on(stream, AccessMode::Shared).unwrap();
    let (src, n, dst) = (
        u.device_ptr() as usize,
        buf.len(),
        out.access(AccessMode::Exclusive),
    );
    stream
        .enqueue(move || {
            let dst = dst.acquire(Duration::from_secs(20)).unwrap();
            // SAFETY: `n` f32 read after the collective that wrote them (the stream waited for
            // its event), into `n` host f32 under an exclusive guard.
            unsafe { std::ptr::copy_nonoverlapping(src as *const f32, dst.as_ptr().cast(), n) }
        })
        .unwrap();
    u.finish();
    out.to_vec::<f32>().unwrap()
}
