//! [`CudaOps`]' side of a training step decided on the device: the step's scalars and their
//! copy to the host in page-locked memory, which the host reads without waiting for work
//! enqueued after the copy.

use std::sync::Mutex;

use cudarc::driver::{sys, CudaEvent, CudaSlice, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};
use fsdp_device::Event;

use super::cuda::{copy_error, CudaBuf, CudaOps};
use super::memory::Counted;
use super::ops::DecidedTensor;
use crate::host::{AdamWChoice, AnyPrecision, AnyPrecisionChoice};
use crate::{launch, KernelError};

/// The scalars of a step on the device ([`GptOps::Scalars`](super::GptOps::Scalars) of
/// [`CudaOps`]): a `CudaSlice<f64>` counted in its operations' memory.
pub type CudaScalars = Counted<CudaSlice<f64>>;

/// A copy of [`CudaScalars`] on its way to page-locked host memory
/// ([`GptOps::ScalarsCopy`](super::GptOps::ScalarsCopy) of [`CudaOps`]).
pub struct CudaScalarsCopy {
    host: PinnedHostSlice<f64>,
    /// Recorded after the copy on the operations' stream.
    arrived: Event,
}

/// Page-locked buffers of finished copies, reused (allocating and freeing page-locked memory
/// can synchronise the device).
#[derive(Default)]
pub(super) struct PinnedPool(Mutex<Vec<PinnedHostSlice<f64>>>);

impl CudaOps {
    /// `len` zeros of `T` in page-locked host memory of the operations' context, cached
    /// (flags 0: the host reads and writes it at full speed; write-combined memory is slow to
    /// read).
    fn zeroed_pinned<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<PinnedHostSlice<T>, KernelError> {
        // SAFETY: zeroed below, through a raw pointer, before any reference to it exists.
        let mut host = unsafe { self.cuda.context().alloc_pinned_with_flags::<T>(len, 0) }
            .map_err(|e| copy_error("cuMemHostAlloc", e))?;
        let p = host
            .as_mut_ptr()
            .map_err(|e| copy_error("cuEventSynchronize", e))?;
        // SAFETY: `p` points at `len` elements of page-locked memory this slice owns, not yet
        // shared with any copy; `T` is valid as all-zero bytes (`ValidAsZeroBits`).
        unsafe { std::ptr::write_bytes(p, 0, len) };
        Ok(host)
    }

    pub(super) fn upload_scalars(&self, values: &[f64]) -> Result<CudaScalars, KernelError> {
        self.upload_slice(values)
    }

    pub(super) fn sum_of_squares_into(
        &self,
        x: &CudaBuf,
        scalars: &mut CudaScalars,
        slot: usize,
    ) -> Result<(), KernelError> {
        let len = scalars.len();
        let mut out =
            scalars
                .try_slice_mut(slot..slot + 1)
                .ok_or_else(|| KernelError::InvalidArgument {
                    kernel: "sum_of_squares",
                    reason: format!("slot {slot} of {len} scalars"),
                })?;
        launch::sum_of_squares(&self.cuda, x, &mut out)
    }

    pub(super) fn sum_of_squares_many_into(
        &self,
        xs: &[&CudaBuf],
        scalars: &mut CudaScalars,
        first: usize,
    ) -> Result<(), KernelError> {
        let xs: Vec<&CudaSlice<f32>> = xs.iter().map(|x| &***x).collect();
        launch::sum_of_squares_many(&self.cuda, &xs, scalars, first)
    }

    pub(super) fn adamw_many(
        &self,
        choices: &[AdamWChoice; 2],
        scalars: &CudaScalars,
        tensors: &mut [DecidedTensor<'_, CudaBuf>],
    ) -> Result<(), KernelError> {
        launch::adamw_decided_many(&self.cuda, choices, scalars, &mut launch_list(tensors))
    }

    pub(super) fn anyprecision_many(
        &self,
        choices: &[AnyPrecisionChoice; 2],
        kind: AnyPrecision,
        scalars: &CudaScalars,
        tensors: &mut [DecidedTensor<'_, CudaBuf>],
    ) -> Result<(), KernelError> {
        let mut list = launch_list(tensors);
        launch::anyprecision_decided_many(&self.cuda, choices, kind, scalars, &mut list)
    }

    pub(super) fn write_scalars_at(
        &self,
        scalars: &mut CudaScalars,
        at: usize,
        values: &[f64],
    ) -> Result<(), KernelError> {
        let end = super::ops::scalar_slots(scalars.len(), at, values.len())?;
        self.cuda
            .memcpy_htod(values, &mut scalars.slice_mut(at..end))
            .map_err(|e| copy_error("cuMemcpyHtoDAsync", e))
    }

    pub(super) fn start_scalars_copy(
        &self,
        scalars: &CudaScalars,
    ) -> Result<CudaScalarsCopy, KernelError> {
        let len = scalars.len();
        let reused = {
            let mut pool = self.pinned.0.lock().unwrap_or_else(|e| e.into_inner());
            pool.iter()
                .position(|p| p.len() == len)
                .map(|i| pool.swap_remove(i))
        };
        let mut host = match reused {
            Some(h) => h,
            None => self.zeroed_pinned::<f64>(len)?,
        };
        self.cuda
            .memcpy_dtoh(&**scalars, &mut host)
            .map_err(|e| copy_error("cuMemcpyDtoHAsync", e))?;
        let arrived = self.stream().record_event();
        Ok(CudaScalarsCopy { host, arrived })
    }

    pub(super) fn finish_scalars_copy(
        &self,
        copy: CudaScalarsCopy,
    ) -> Result<Vec<f64>, KernelError> {
        copy.arrived.synchronize()?;
        // The copy has run (the event after it was reached), so this does not block.
        let v = copy
            .host
            .as_slice()
            .map_err(|e| copy_error("cuEventSynchronize", e))?
            .to_vec();
        self.pinned
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(copy.host);
        Ok(v)
    }
}

/// CPU offload's staging memory of [`CudaOps`] ([`GptOps::Staging`](super::GptOps::Staging)):
/// page-locked host memory, so that copies to and from it run on the stream without the host
/// waiting, and the event after the last such copy.
pub struct CudaStaging {
    host: PinnedHostSlice<f32>,
    /// Recorded on the stream after the last copy into or out of `host`.
    last: Option<Event>,
}

impl CudaStaging {
    fn wait(&self) -> Result<(), KernelError> {
        if let Some(e) = &self.last {
            e.synchronize()?;
        }
        Ok(())
    }

    /// The values, once the last copy has finished.
    pub(super) fn values(&self) -> Result<&[f32], KernelError> {
        self.wait()?;
        // The copy has run (the event after it was reached), so this does not block.
        self.host
            .as_slice()
            .map_err(|e| copy_error("cuEventSynchronize", e))
    }

    /// The values to write, once the last copy has finished.
    pub(super) fn values_mut(&mut self) -> Result<&mut [f32], KernelError> {
        self.wait()?;
        self.host
            .as_mut_slice()
            .map_err(|e| copy_error("cuEventSynchronize", e))
    }
}

impl CudaOps {
    pub(super) fn new_staging(&self, len: usize) -> Result<CudaStaging, KernelError> {
        let host = self.zeroed_pinned::<f32>(len)?;
        Ok(CudaStaging { host, last: None })
    }

    pub(super) fn staging_copy_out(
        &self,
        buf: &CudaBuf,
        dst: &mut CudaStaging,
    ) -> Result<(), KernelError> {
        crate::host::same_len("copy_out", "staging", buf.len(), dst.host.len())?;
        self.cuda
            .memcpy_dtoh(&**buf, &mut dst.host)
            .map_err(|e| copy_error("cuMemcpyDtoHAsync", e))?;
        dst.last = Some(self.stream().record_event());
        Ok(())
    }

    pub(super) fn staging_copy_in(
        &self,
        src: &mut CudaStaging,
        buf: &mut CudaBuf,
    ) -> Result<(), KernelError> {
        crate::host::same_len("copy_in", "buffer", src.host.len(), buf.len())?;
        self.cuda
            .memcpy_htod(&src.host, &mut **buf)
            .map_err(|e| copy_error("cuMemcpyHtoDAsync", e))?;
        src.last = Some(self.stream().record_event());
        Ok(())
    }
}

/// A point of [`CudaOps`]' timeline ([`GptOps::Mark`](super::GptOps::Mark)): a CUDA event
/// recorded with timing.
pub struct CudaMark(CudaEvent);

impl CudaMark {
    /// Microseconds from this mark to `to`, both reached (never waits).
    pub(super) fn elapsed_us(&self, to: &CudaMark) -> Result<f64, KernelError> {
        if !self.0.is_complete() || !to.0.is_complete() {
            return Err(KernelError::InvalidArgument {
                kernel: "elapsed",
                reason: "a mark the device has not reached yet".into(),
            });
        }
        // Both events are complete, so the driver's waits inside return at once.
        let ms = self
            .0
            .elapsed_ms(&to.0)
            .map_err(|e| copy_error("cuEventElapsedTime", e))?;
        Ok(f64::from(ms) * 1e3)
    }
}

impl CudaOps {
    pub(super) fn new_mark(&self) -> Result<CudaMark, KernelError> {
        self.cuda
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map(CudaMark)
            .map_err(|e| copy_error("cuEventRecord", e))
    }
}

/// The launchers' form of a step's tensors.
fn launch_list<'a>(tensors: &'a mut [DecidedTensor<'_, CudaBuf>]) -> Vec<launch::AdamWTensor<'a>> {
    tensors
        .iter_mut()
        .map(|t| launch::AdamWTensor {
            param: t.param,
            grad: t.grad,
            exp_avg: t.exp_avg,
            exp_avg_sq: t.exp_avg_sq,
            compensation: t.compensation.as_deref_mut().map(|c| &mut **c),
            decay: t.decay,
        })
        .collect()
}
