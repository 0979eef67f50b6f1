//! [`host_task`]: a host function run as a task of a CPU stream over stream-ordered host
//! buffers — a kernel of a device's host twin, written in safe Rust.

use std::marker::PhantomData;

use crate::ordered_ops::{check_twin, twin_task};
use crate::{AccessMode, Buffer, DType, DeviceError, Element, Event, Stream};

/// A buffer read by a [`host_task`]: its elements, valid while the task runs.
pub struct TaskRead<'a> {
    ptr: usize,
    len: usize,
    dtype: DType,
    _task: PhantomData<&'a [u8]>,
}

/// A buffer written by a [`host_task`]: its elements, valid while the task runs.
pub struct TaskWrite<'a> {
    ptr: usize,
    len: usize,
    dtype: DType,
    _task: PhantomData<&'a mut [u8]>,
}

/// The check of a typed view: the element type and the alignment of the address.
fn check_view<T: Element>(dtype: DType, ptr: usize) -> Result<(), DeviceError> {
    if T::DTYPE != dtype {
        return Err(DeviceError::InvalidArgument(format!(
            "host_task: a buffer of {dtype} viewed as {}",
            T::DTYPE
        )));
    }
    if ptr % std::mem::align_of::<T>() != 0 {
        return Err(DeviceError::InvalidArgument(format!(
            "host_task: a buffer of {dtype} at the unaligned address {ptr:#x}"
        )));
    }
    Ok(())
}

impl TaskRead<'_> {
    /// The buffer's element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The buffer's elements as `T`.
    ///
    /// # Errors
    /// [`DeviceError::InvalidArgument`] when `T` is not the buffer's element type.
    pub fn as_slice<T: Element>(&self) -> Result<&[T], DeviceError> {
        check_view::<T>(self.dtype, self.ptr)?;
        // SAFETY: `len` aligned elements of `T` (checked above) of a live stream-ordered host
        // buffer that this task uses after the work writing it and before any later work on it
        // (`host_task`'s ordering), and that no write of the task overlaps (checked there).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len) })
    }
}

impl TaskWrite<'_> {
    /// The buffer's element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The buffer's elements as `T`, to write.
    ///
    /// # Errors
    /// [`DeviceError::InvalidArgument`] when `T` is not the buffer's element type.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T], DeviceError> {
        check_view::<T>(self.dtype, self.ptr)?;
        // SAFETY: as in `TaskRead::as_slice`, and exclusive: no other buffer of the task
        // overlaps this one (checked by `host_task`), and `&mut self` lends it once.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len) })
    }
}

/// Run `f` as a task of the CPU stream `stream` over stream-ordered host buffers
/// ([`Buffer::stream_ordered`]): the stream first waits for the work that writes `reads` and
/// for every use of `writes`, and the task is recorded as their newest use (a read of `reads`,
/// a write of `writes`), so work issued later on any stream is ordered after it. `f` gets the
/// buffers' elements in the order given. This is how a device's host twin runs its kernels:
/// the same host code, ordered as the GPU's kernel would be. An error returned by `f` becomes
/// the stream's sticky error ([`Stream::error`]). Returns the task's event.
///
/// ```
/// use fsdp_device::{host_task, Buffer, DType, HostStorage, Stream};
///
/// let ordered = |v: &[f32]| -> Buffer {
///     let mem = HostStorage::zeroed(v.len() * 4).unwrap();
///     let b = Buffer::stream_ordered(Box::new(mem), DType::F32).unwrap();
///     let host = Buffer::from_slice(v).unwrap();
///     b.copy_from_host_async(&host, &Stream::cpu("upload")).unwrap();
///     b
/// };
/// let (x, y) = (ordered(&[1.0, 2.0]), ordered(&[10.0, 20.0]));
/// let stream = Stream::cpu("compute");
/// // y += x, after the uploads (on another stream) wrote both.
/// host_task(&stream, &[&x], &[&y], |r, w| {
///     let x = r[0].as_slice::<f32>().map_err(|e| e.to_string())?;
///     for (y, x) in w[0].as_mut_slice::<f32>().map_err(|e| e.to_string())?.iter_mut().zip(x) {
///         *y += x;
///     }
///     Ok(())
/// })
/// .unwrap();
/// let out = Buffer::zeros(DType::F32, 2).unwrap();
/// y.copy_to_host_async(&out, &stream).unwrap();
/// assert_eq!(out.to_vec::<f32>().unwrap(), vec![11.0, 22.0]);
/// ```
///
/// # Errors
/// [`DeviceError::InvalidArgument`] for a buffer that is not stream-ordered host memory, a
/// stream that is not a CPU stream, or a written buffer that overlaps another buffer of the
/// task; the stream's errors.
pub fn host_task(
    stream: &Stream,
    reads: &[&Buffer],
    writes: &[&Buffer],
    f: impl FnOnce(&[TaskRead<'_>], &mut [TaskWrite<'_>]) -> Result<(), String> + Send + 'static,
) -> Result<Event, DeviceError> {
    for b in reads.iter().chain(writes) {
        check_twin(b, stream, "host_task")?;
    }
    if let Some((w, o)) = Buffer::overlapping_write(reads, writes) {
        return Err(DeviceError::InvalidArgument(format!(
            "host_task: a written buffer of {} elements overlaps another of {} elements",
            w.len(),
            o.len()
        )));
    }
    let shapes: Vec<(usize, DType)> = reads
        .iter()
        .chain(writes)
        .map(|b| (b.len(), b.dtype()))
        .collect();
    let n_reads = reads.len();
    let uses: Vec<(&Buffer, AccessMode)> = reads
        .iter()
        .map(|b| (*b, AccessMode::Shared))
        .chain(writes.iter().map(|b| (*b, AccessMode::Exclusive)))
        .collect();
    twin_task(stream, &uses, None, move |ptrs, _| {
        let r: Vec<TaskRead<'_>> = ptrs[..n_reads]
            .iter()
            .zip(&shapes)
            .map(|(&ptr, &(len, dtype))| TaskRead {
                ptr,
                len,
                dtype,
                _task: PhantomData,
            })
            .collect();
        let mut w: Vec<TaskWrite<'_>> = ptrs[n_reads..]
            .iter()
            .zip(&shapes[n_reads..])
            .map(|(&ptr, &(len, dtype))| TaskWrite {
                ptr,
                len,
                dtype,
                _task: PhantomData,
            })
            .collect();
        if let Err(e) = f(&r, &mut w) {
            panic!("host_task failed: {e}");
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostStorage;

    fn ordered(v: &[f32]) -> Buffer {
        let b = Buffer::stream_ordered(
            Box::new(HostStorage::zeroed(v.len() * 4).unwrap()),
            DType::F32,
        )
        .unwrap();
        b.copy_from_host_async(&Buffer::from_slice(v).unwrap(), &Stream::cpu("up"))
            .unwrap();
        b
    }

    fn host(b: &Buffer, s: &Stream) -> Vec<f32> {
        let out = Buffer::zeros(b.dtype(), b.len()).unwrap();
        b.copy_to_host_async(&out, s).unwrap();
        out.to_vec::<f32>().unwrap()
    }

    #[test]
    fn tasks_on_two_streams_are_ordered_by_the_buffers() {
        let (a, b) = (ordered(&[1.0; 4]), ordered(&[0.0; 4]));
        let (s1, s2) = (Stream::cpu("one"), Stream::cpu("two"));
        let slow = |r: &[TaskRead<'_>], w: &mut [TaskWrite<'_>]| -> Result<(), String> {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let x = r[0].as_slice::<f32>().map_err(|e| e.to_string())?;
            let y = w[0].as_mut_slice::<f32>().map_err(|e| e.to_string())?;
            for (y, x) in y.iter_mut().zip(x) {
                *y += 2.0 * x;
            }
            Ok(())
        };
        // b = 2a on s1 (slow), then a = b + a on s2: s2 waits for s1's write of b.
        host_task(&s1, &[&a], &[&b], slow).unwrap();
        host_task(&s2, &[&b], &[&a], |r, w| {
            let x = r[0].as_slice::<f32>().map_err(|e| e.to_string())?;
            for (y, x) in w[0]
                .as_mut_slice::<f32>()
                .map_err(|e| e.to_string())?
                .iter_mut()
                .zip(x)
            {
                *y += x;
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(host(&a, &s1), vec![3.0; 4]);
        assert_eq!(host(&b, &s1), vec![2.0; 4]);
    }

    #[test]
    fn refusals_and_failures_name_what_is_wrong() {
        let a = ordered(&[1.0; 4]);
        let s = Stream::cpu("s");
        let plain = Buffer::zeros(DType::F32, 4).unwrap();
        let e = host_task(&s, &[&plain], &[&a], |_, _| Ok(())).unwrap_err();
        assert!(e.to_string().contains("access tickets"), "{e}");
        let half = a.slice(1..3).unwrap();
        let e = host_task(&s, &[&half], &[&a], |_, _| Ok(())).unwrap_err();
        assert!(e.to_string().contains("overlaps"), "{e}");
        // Reads may overlap each other.
        host_task(&s, &[&half, &a], &[], |_, _| Ok(())).unwrap();
        // A wrong element type, then an error of the task: the stream's sticky error.
        host_task(&s, &[], &[&a], |_, w| {
            w[0].as_mut_slice::<f64>()
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
        .unwrap();
        assert!(s.synchronize().is_err());
        let e = s.error().expect("a sticky error");
        assert!(e.to_string().contains("viewed as float64"), "{e}");
    }
}
