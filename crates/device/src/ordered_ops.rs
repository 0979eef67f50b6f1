//! Asynchronous copies, zeroing and casts of stream-ordered buffers: on CUDA (feature `cuda`:
//! `cuMemcpy*Async`, `cuMemsetD8Async`), or on host memory made stream-ordered
//! ([`Buffer::stream_ordered`]) with CPU streams — the host twin of a device, where each
//! operation is a task of the stream and does what the GPU would.
//!
//! Every operation orders itself by the buffers' [`StreamOrder`](crate::StreamOrder)s (the
//! stream first waits for the work it conflicts with, and the operation is recorded as their
//! newest use) and returns its event. The host side of a copy is a buffer ordered by access
//! tickets: its ticket is taken at the call, in program order, and held until the copy ran,
//! so host reads and writes of it issued after the call wait for the copy. On CUDA it must be
//! page-locked ([`Buffer::pinned_zeros`]).

use std::time::Duration;

use crate::{AccessGuard, AccessMode, AccessTicket, Buffer, DType, Device, DeviceError, Element};
use crate::{Event, Stream};

impl Buffer {
    /// Copy this stream-ordered device buffer into the host buffer `dst` (same element type
    /// and length) on `stream`, after the work that wrote this buffer; `dst` stays under an
    /// exclusive access ticket until the copy ran, so `dst.read()` after this call sees the
    /// copied data. Returns the copy's event.
    ///
    /// # Errors
    /// [`DeviceError::InvalidArgument`] for a source that is not stream-ordered, a stream of
    /// another device, a `dst` that is not host memory ordered by tickets (on CUDA: not
    /// pinned) or differs in element type or length; [`DeviceError::Timeout`] when `dst` stays
    /// busy (CUDA); [`DeviceError::Cuda`] when the copy fails.
    pub fn copy_to_host_async(&self, dst: &Buffer, stream: &Stream) -> Result<Event, DeviceError> {
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) {
            return self.cuda_copy_to_host_async(dst, stream);
        }
        check_twin_copy(self, dst, stream, "copy_to_host_async")?;
        let bytes = self.byte_len();
        twin_task(
            stream,
            &[(self, AccessMode::Shared)],
            Some(dst.access(AccessMode::Exclusive)),
            move |p, g| {
                if let Some(g) = g {
                    // SAFETY: `bytes` bytes of this buffer, after its last write, into the
                    // host buffer's `bytes` bytes under an exclusive guard (distinct storages).
                    unsafe { std::ptr::copy_nonoverlapping(p[0] as *const u8, g.as_ptr(), bytes) }
                }
            },
        )
    }

    /// Copy the host buffer `src` (same element type and length) into this stream-ordered
    /// device buffer on `stream`, after the work that uses this buffer; `src` stays under a
    /// shared access ticket until the copy ran, so host writes to it issued after this call
    /// wait for the copy. Returns the copy's event.
    ///
    /// # Errors
    /// As [`copy_to_host_async`](Buffer::copy_to_host_async).
    pub fn copy_from_host_async(
        &self,
        src: &Buffer,
        stream: &Stream,
    ) -> Result<Event, DeviceError> {
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) {
            return self.cuda_copy_from_host_async(src, stream);
        }
        check_twin_copy(self, src, stream, "copy_from_host_async")?;
        let bytes = self.byte_len();
        twin_task(
            stream,
            &[(self, AccessMode::Exclusive)],
            Some(src.access(AccessMode::Shared)),
            move |p, g| {
                if let Some(g) = g {
                    // SAFETY: `bytes` bytes of the host buffer under a shared guard into this
                    // buffer's `bytes` bytes, used only by this task (distinct storages).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            g.as_ptr().cast_const(),
                            p[0] as *mut u8,
                            bytes,
                        )
                    }
                }
            },
        )
    }

    /// Zero this stream-ordered buffer on `stream`, after its earlier uses. Returns the event.
    ///
    /// # Errors
    /// [`DeviceError::InvalidArgument`] for a buffer that is not stream-ordered or a stream of
    /// another device; [`DeviceError::Cuda`] when the memset fails.
    pub fn zero_async(&self, stream: &Stream) -> Result<Event, DeviceError> {
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) {
            return self.cuda_zero_async(stream);
        }
        check_twin(self, stream, "zero_async")?;
        let bytes = self.byte_len();
        twin_task(
            stream,
            &[(self, AccessMode::Exclusive)],
            None,
            move |p, _| {
                // SAFETY: this buffer's `bytes` bytes, used only by this task.
                unsafe { std::ptr::write_bytes(p[0] as *mut u8, 0, bytes) }
            },
        )
    }

    /// Copy the stream-ordered buffer `src` (same element type, length and device) into this
    /// one on `stream`, ordered by both buffers' stream orders. They may be views of one
    /// storage only if they do not overlap. Returns the copy's event.
    ///
    /// # Errors
    /// [`DeviceError::InvalidArgument`] for mismatched buffers, overlapping views or a stream of
    /// another device; [`DeviceError::Cuda`] when the copy fails.
    pub fn copy_from_device_async(
        &self,
        src: &Buffer,
        stream: &Stream,
    ) -> Result<Event, DeviceError> {
        if src.dtype() != self.dtype() || src.len() != self.len() || src.device() != self.device() {
            return Err(DeviceError::InvalidArgument(format!(
                "copy_from_device_async: {} elements of {} on {} into {} elements of {} on {}",
                src.len(),
                src.dtype(),
                src.device(),
                self.len(),
                self.dtype(),
                self.device()
            )));
        }
        if self.overlaps(src) && self.byte_len() > 0 {
            return Err(DeviceError::InvalidArgument(
                "copy_from_device_async between overlapping views".into(),
            ));
        }
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) {
            return self.cuda_copy_from_device_async(src, stream);
        }
        check_twin(self, stream, "copy_from_device_async")?;
        check_twin(src, stream, "copy_from_device_async")?;
        let bytes = self.byte_len();
        twin_task(
            stream,
            &[(src, AccessMode::Shared), (self, AccessMode::Exclusive)],
            None,
            move |p, _| {
                // SAFETY: `bytes` bytes of each buffer, not overlapping (checked), used only by
                // this task.
                unsafe { std::ptr::copy_nonoverlapping(p[0] as *const u8, p[1] as *mut u8, bytes) }
            },
        )
    }

    /// Cast the stream-ordered host buffer `src` (same length, any element type) into this one
    /// on a CPU stream, each value rounded once to this buffer's type (to nearest even, as
    /// `half`'s conversions and the CUDA cast kernels of `fsdp-kernels`, which do this on a GPU).
    /// Returns the event.
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] for CUDA buffers (use `fsdp_kernels`' cast kernels);
    /// [`DeviceError::InvalidArgument`] for buffers that are not stream-ordered host memory, of
    /// other lengths, overlapping, or a stream of another device.
    pub fn cast_from_async(&self, src: &Buffer, stream: &Stream) -> Result<Event, DeviceError> {
        if matches!(self.device(), Device::Cuda(_)) {
            return Err(DeviceError::Unsupported {
                op: "cast_from_async of device buffers (the casts on a GPU are fsdp-kernels')",
                device: self.device().to_string(),
            });
        }
        check_twin(self, stream, "cast_from_async")?;
        check_twin(src, stream, "cast_from_async")?;
        if src.len() != self.len() || (self.overlaps(src) && self.byte_len() > 0) {
            return Err(DeviceError::InvalidArgument(format!(
                "cast_from_async: {} elements into {} (or overlapping views)",
                src.len(),
                self.len()
            )));
        }
        let (s, d, n) = (src.dtype(), self.dtype(), self.len());
        twin_task(
            stream,
            &[(src, AccessMode::Shared), (self, AccessMode::Exclusive)],
            None,
            move |p, _| {
                // SAFETY: `n` elements of `s` and of `d` at distinct addresses, used only by
                // this task.
                unsafe { cast_raw(s, p[0], d, p[1], n) }
            },
        )
    }
}

/// `n` elements of `s` at `sp` cast to `d` at `dp`.
///
/// # Safety
/// The addresses must hold `n` aligned elements of their types, not overlap, and be touched by
/// nothing else meanwhile.
unsafe fn cast_raw(s: DType, sp: usize, d: DType, dp: usize, n: usize) {
    /// Widen `n` elements of `T` at `sp` to f32.
    ///
    /// # Safety
    /// As `cast_raw`.
    unsafe fn widen<T: Element>(sp: usize, n: usize) -> Vec<f32> {
        // SAFETY: the caller's contract.
        let src = unsafe { std::slice::from_raw_parts(sp as *const T, n) };
        src.iter().map(|v| v.to_f32()).collect()
    }
    /// Store f32 values as `T` at `dp`.
    ///
    /// # Safety
    /// As `cast_raw`.
    unsafe fn store<T: Element>(dp: usize, v: &[f32]) {
        // SAFETY: the caller's contract.
        let dst = unsafe { std::slice::from_raw_parts_mut(dp as *mut T, v.len()) };
        for (d, &x) in dst.iter_mut().zip(v) {
            *d = T::from_f32(x);
        }
    }
    // SAFETY: the caller's contract, for the types matched (f64 narrows through f32, which
    // the engine never asks of it: its casts are among f32, bf16 and f16).
    unsafe {
        let wide = match s {
            DType::F32 => widen::<f32>(sp, n),
            DType::BF16 => widen::<half::bf16>(sp, n),
            DType::F16 => widen::<half::f16>(sp, n),
            DType::F64 => widen::<f64>(sp, n),
        };
        match d {
            DType::F32 => store::<f32>(dp, &wide),
            DType::BF16 => store::<half::bf16>(dp, &wide),
            DType::F16 => store::<half::f16>(dp, &wide),
            DType::F64 => store::<f64>(dp, &wide),
        }
    }
}

/// A stream-ordered host buffer used on a CPU stream.
pub(crate) fn check_twin(buf: &Buffer, stream: &Stream, op: &str) -> Result<(), DeviceError> {
    if buf.device() != Device::Cpu || buf.stream_order().is_none() {
        return Err(DeviceError::InvalidArgument(format!(
            "{op}: a buffer on {}{}, not a stream-ordered buffer (Buffer::stream_ordered, \
             Buffer::cuda_zeros)",
            buf.device(),
            if buf.stream_order().is_none() {
                " ordered by access tickets"
            } else {
                ""
            }
        )));
    }
    if stream.device() != Device::Cpu {
        return Err(DeviceError::InvalidArgument(format!(
            "{op}: a buffer on cpu used on stream `{}` of {}",
            stream.name(),
            stream.device()
        )));
    }
    Ok(())
}

/// The checks of a host twin's copy: `dev` stream-ordered on the CPU, `host` host memory of
/// the same type and length ordered by tickets.
fn check_twin_copy(
    dev: &Buffer,
    host: &Buffer,
    stream: &Stream,
    op: &str,
) -> Result<(), DeviceError> {
    check_twin(dev, stream, op)?;
    if host.device() != Device::Cpu || host.stream_order().is_some() {
        return Err(DeviceError::InvalidArgument(format!(
            "{op}: the host side must be host memory ordered by access tickets, not a buffer \
             on {}{}",
            host.device(),
            if host.stream_order().is_some() {
                " ordered by streams"
            } else {
                ""
            }
        )));
    }
    if host.dtype() != dev.dtype() || host.len() != dev.len() {
        return Err(DeviceError::InvalidArgument(format!(
            "{op}: {} elements of {} on the device side vs {} elements of {} on the host",
            dev.len(),
            dev.dtype(),
            host.len(),
            host.dtype()
        )));
    }
    Ok(())
}

/// One operation of the host twin: a task on `stream` using `uses` (stream-ordered buffers, in
/// their modes: the stream first waits for their conflicting work, and the task is recorded as
/// their newest use) and, when given, a host buffer's access ticket (taken by the caller in
/// program order, acquired by the task within the stream's timeout). `f` gets the buffers'
/// addresses in order and the host guard (`None` when no ticket was given). A ticket that
/// cannot be acquired makes the task panic before `f`, so the failure becomes the stream's
/// sticky error. Returns the event of the last use.
pub(crate) fn twin_task(
    stream: &Stream,
    uses: &[(&Buffer, AccessMode)],
    host: Option<AccessTicket>,
    f: impl FnOnce(&[usize], Option<&AccessGuard>) + Send + 'static,
) -> Result<Event, DeviceError> {
    let used = uses
        .iter()
        .map(|(b, m)| b.use_on(stream, *m))
        .collect::<Result<Vec<_>, _>>()?;
    let ptrs: Vec<usize> = used.iter().map(|u| u.device_ptr() as usize).collect();
    let timeout: Duration = stream.timeout();
    stream.enqueue(move || match host.map(|t| t.acquire(timeout)) {
        Some(Err(e)) => panic!("the host buffer of a copy stayed busy: {e}"),
        Some(Ok(g)) => f(&ptrs, Some(&g)),
        None => f(&ptrs, None),
    })?;
    let mut last = None;
    for u in used {
        last = Some(u.finish());
    }
    Ok(last.unwrap_or_else(|| stream.record_event()))
}
