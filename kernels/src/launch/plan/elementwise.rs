//! The launches of the casts, the element-wise kernels and the ring's reductions
//! (`cu/cast.cu`, `cu/elementwise.cu`, `cu/reduce.cu`).

use super::{config, KernelLaunch, Param};
use crate::host::Compute;
use crate::host::{check_reduce, CastFloat, KernelFloat, ReduceKind};
use crate::{KernelError, Program};

/// [`launch::cast`](crate::launch::cast) of `n` elements from `src` to `dst`: f32 → bf16
/// four elements a thread (`cast_f32_bf16_x4`) where `src` is 16-byte and `dst` 8-byte
/// aligned, the scalar kernel for the rest (all of it otherwise).
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a cast of a type to itself.
pub fn cast<S: CastFloat, D: CastFloat>(
    src: u64,
    dst: u64,
    n: usize,
) -> Result<Vec<KernelLaunch>, KernelError> {
    if S::NAME == D::NAME {
        return Err(KernelError::InvalidArgument {
            kernel: "cast",
            reason: format!("a cast of {} to itself (copy instead)", S::NAME),
        });
    }
    let mut out = Vec::new();
    if n == 0 {
        return Ok(out);
    }
    let mut done = 0usize;
    if S::NAME == "f32" && D::NAME == "bf16" && src % 16 == 0 && dst % 8 == 0 && n >= 4 {
        let groups = n / 4;
        // `cast_f32_bf16_x4(const f32x4*, u32x2*, u64 groups)`: 4·groups elements.
        out.push(KernelLaunch::new(
            Program::Cast,
            "cast_f32_bf16_x4",
            config(groups),
            vec![Param::Ptr(src), Param::Ptr(dst), Param::U64(groups as u64)],
        ));
        done = 4 * groups;
    }
    if done < n {
        // `cast_<S>_<D>(const S*, D*, u64)` over the last `n − done` elements.
        out.push(KernelLaunch::new(
            Program::Cast,
            format!("cast_{}_{}", S::NAME, D::NAME),
            config(n - done),
            vec![
                Param::Ptr(src + (done * std::mem::size_of::<S>()) as u64),
                Param::Ptr(dst + (done * std::mem::size_of::<D>()) as u64),
                Param::U64((n - done) as u64),
            ],
        ));
    }
    Ok(out)
}

/// [`launch::axpby`](crate::launch::axpby): `y = alpha·x + beta·y` over `n` elements.
pub fn axpby<T: KernelFloat>(
    alpha: T::C,
    x: u64,
    beta: T::C,
    y: u64,
    n: usize,
) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `axpby_<T>(C, const T*, C, T*, u64)` with C = T's compute type.
    vec![KernelLaunch::new(
        Program::Elementwise,
        format!("axpby_{}", T::NAME),
        config(n),
        vec![
            alpha.param(),
            Param::Ptr(x),
            beta.param(),
            Param::Ptr(y),
            Param::U64(n as u64),
        ],
    )]
}

/// [`launch::div_scalar`](crate::launch::div_scalar): `y = y / d` over `n` elements.
pub fn div_scalar<T: KernelFloat>(d: T::C, y: u64, n: usize) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `div_scalar_<T>(C, T*, u64)`.
    vec![KernelLaunch::new(
        Program::Elementwise,
        format!("div_scalar_{}", T::NAME),
        config(n),
        vec![d.param(), Param::Ptr(y), Param::U64(n as u64)],
    )]
}

/// [`launch::scale_by`](crate::launch::scale_by): `x *= c[0]` over `n` f32.
pub fn scale_by(x: u64, c: u64, n: usize) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    // `scale_by_f32(float*, const double*, u64)`.
    vec![KernelLaunch::new(
        Program::Elementwise,
        "scale_by_f32",
        config(n),
        vec![Param::Ptr(x), Param::Ptr(c), Param::U64(n as u64)],
    )]
}

/// [`launch::memset`](crate::launch::memset): `n` elements of `dst` set to `value`.
pub fn memset<T: KernelFloat>(dst: u64, value: T, n: usize) -> Vec<KernelLaunch> {
    if n == 0 {
        return Vec::new();
    }
    let width = std::mem::size_of::<T>() * 8;
    let bits = value.bits();
    let v = match width {
        16 => Param::U16(bits as u16),
        32 => Param::U32(bits as u32),
        _ => Param::U64(bits),
    };
    // `memset_b<W>(uW*, uW, u64)`: the value passed with the element's width.
    vec![KernelLaunch::new(
        Program::Elementwise,
        format!("memset_b{width}"),
        config(n),
        vec![Param::Ptr(dst), v, Param::U64(n as u64)],
    )]
}

/// [`launch::reduce`](crate::launch::reduce): `dst = acc ⊕ x` over `n` elements (`dst` may
/// be `x` or `acc`); with `finish = Some(k)` an average's last step divides by `k`.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for `finish == Some(0)`.
pub fn reduce<T: KernelFloat>(
    op: ReduceKind,
    dst: u64,
    acc: u64,
    x: u64,
    n: usize,
    finish: Option<u32>,
) -> Result<Vec<KernelLaunch>, KernelError> {
    check_reduce("reduce", n, n, finish)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let finish_n = match (op, finish) {
        (ReduceKind::Avg, Some(k)) => k,
        _ => 0,
    };
    // `reduce_<op>_<T>(T*, const T*, const T*, u64, u32)`.
    Ok(vec![KernelLaunch::new(
        Program::Reduce,
        format!("reduce_{}_{}", op.kernel_op(), T::NAME),
        config(n),
        vec![
            Param::Ptr(dst),
            Param::Ptr(acc),
            Param::Ptr(x),
            Param::U64(n as u64),
            Param::U32(finish_n),
        ],
    )])
}
