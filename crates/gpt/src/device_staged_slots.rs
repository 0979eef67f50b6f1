//! [`StagedComm`](super::StagedComm)'s staging buffers: the kept buffers (an input and an
//! output of f32, one of f64 for the step's scalars, the prefetch's pair, bf16 pairs for
//! reductions, gathers and prefetches in bf16, and an f16 pair for reductions in f16), which
//! one a collective uses, and the
//! all-gathers in flight.

use fsdp_collectives::{Communicator, Work};
use fsdp_device::{Buffer, DType, Device};
use fsdp_kernels::gpt::{Counted, PeerPtr, StagingOps};

use super::StagedComm;
use crate::device_config::DeviceTrainError;

/// An all-gather issued ahead of its use.
pub(super) struct Prefetched {
    /// The shards' addresses and lengths: the next all-gather of these (in the same dtypes)
    /// completes it.
    pub(super) key: Vec<PeerPtr>,
    pub(super) dtypes: Vec<DType>,
    pub(super) gathers: Vec<Gather>,
}

/// One collective of an all-gather: the unit's tensors of one dtype.
pub(super) struct Gather {
    /// Whether they move in bf16.
    pub(super) half: bool,
    /// The unit's tensors it gathers, in order.
    pub(super) idx: Vec<usize>,
    pub(super) output: Buffer,
    pub(super) work: Work,
}

/// The kept staging buffers.
#[derive(Default)]
pub(super) struct Staging {
    pub(super) input: Option<Counted<Buffer>>,
    pub(super) output: Option<Counted<Buffer>>,
    pub(super) scalars: Option<Counted<Buffer>>,
    pub(super) prefetch_input: Option<Counted<Buffer>>,
    pub(super) prefetch_output: Option<Counted<Buffer>>,
    /// A reduction's or an all-gather's input and output in bf16.
    pub(super) half_input: Option<Counted<Buffer>>,
    pub(super) half_output: Option<Counted<Buffer>>,
    /// A reduction's input and output in f16 (made only by a run that reduces in f16).
    pub(super) f16_input: Option<Counted<Buffer>>,
    pub(super) f16_output: Option<Counted<Buffer>>,
    /// A prefetched all-gather's in bf16.
    pub(super) prefetch_half_input: Option<Counted<Buffer>>,
    pub(super) prefetch_half_output: Option<Counted<Buffer>>,
}

/// Which staging buffer.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    Input,
    Output,
    Scalars,
    PrefetchInput,
    PrefetchOutput,
    /// Of bf16 or f16 (each type its own kept buffer).
    HalfInput(DType),
    HalfOutput(DType),
    PrefetchHalfInput,
    PrefetchHalfOutput,
}

impl Slot {
    /// The input and output slots of an all-gather in bf16 (`half`) or f32, prefetched or
    /// not.
    pub(super) fn gather(prefetch: bool, half: bool) -> (Slot, Slot) {
        match (prefetch, half) {
            (false, false) => (Slot::Input, Slot::Output),
            (false, true) => (Slot::HalfInput(DType::BF16), Slot::HalfOutput(DType::BF16)),
            (true, false) => (Slot::PrefetchInput, Slot::PrefetchOutput),
            (true, true) => (Slot::PrefetchHalfInput, Slot::PrefetchHalfOutput),
        }
    }

    /// The input and output slots of a reduction in `half` (bf16 or f16), or f32 (`None`).
    pub(super) fn reduction(half: Option<DType>) -> (Slot, Slot) {
        match half {
            Some(h) => (Slot::HalfInput(h), Slot::HalfOutput(h)),
            None => (Slot::Input, Slot::Output),
        }
    }
}

impl<C: Communicator + ?Sized> StagedComm<C> {
    /// The bytes of the staging buffers held now (device memory beside the operations' on a
    /// GPU; [`DeviceComm::held_bytes`](crate::device_comm::DeviceComm::held_bytes)). They grow to the largest unit in the first step and
    /// stay.
    pub fn staging_bytes(&self) -> usize {
        let s = self.staging.borrow();
        [
            &s.input,
            &s.output,
            &s.scalars,
            &s.prefetch_input,
            &s.prefetch_output,
            &s.half_input,
            &s.half_output,
            &s.f16_input,
            &s.f16_output,
            &s.prefetch_half_input,
            &s.prefetch_half_output,
        ]
        .into_iter()
        .flatten()
        .map(|b| b.byte_len())
        .sum()
    }

    /// `len` elements of the staging buffer `slot`, grown (replaced, zeroed) when shorter: in
    /// device memory, zeroed on `ops`' stream, where the communicator's stream is on a GPU;
    /// else in host memory.
    pub(super) fn buffer<O: StagingOps>(
        &self,
        ops: &O,
        slot: Slot,
        len: usize,
    ) -> Result<Buffer, DeviceTrainError> {
        let mut s = self.staging.borrow_mut();
        let (kept, dtype) = match slot {
            Slot::Input => (&mut s.input, DType::F32),
            Slot::Output => (&mut s.output, DType::F32),
            Slot::Scalars => (&mut s.scalars, DType::F64),
            Slot::PrefetchInput => (&mut s.prefetch_input, DType::F32),
            Slot::PrefetchOutput => (&mut s.prefetch_output, DType::F32),
            Slot::HalfInput(DType::F16) => (&mut s.f16_input, DType::F16),
            Slot::HalfOutput(DType::F16) => (&mut s.f16_output, DType::F16),
            Slot::HalfInput(_) => (&mut s.half_input, DType::BF16),
            Slot::HalfOutput(_) => (&mut s.half_output, DType::BF16),
            Slot::PrefetchHalfInput => (&mut s.prefetch_half_input, DType::BF16),
            Slot::PrefetchHalfOutput => (&mut s.prefetch_half_output, DType::BF16),
        };
        if kept.as_ref().is_none_or(|b| b.len() < len) {
            // The old buffer is released first: it is counted until then.
            *kept = None;
            let buf = match (self.comm.device(), ops.device_stream()) {
                // Operations that touch no memory: sizes only, for plans.
                _ if ops.is_meta() => Buffer::meta(dtype, len.max(1))?,
                (Device::Cuda(_), Some(stream)) => Buffer::cuda_zeros(dtype, len.max(1), stream)?,
                (d, None) if d != Device::Cpu => return Err(self.misplaced(d, ops)),
                _ => Buffer::zeros(dtype, len.max(1))?,
            };
            let bytes = buf.byte_len() as u64;
            *kept = Some(ops.count(buf, bytes));
        }
        let buf = kept.as_ref().expect("kept above");
        Ok(buf.slice(0..len)?)
    }
}
