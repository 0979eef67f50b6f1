//! Training the tied-weight MLP example on the engine with its unsharded parameters and
//! gradients on a device (`Fsdp::new_on`) or in host memory, one rank's run: the adapter
//! [`OnDevice`] runs the host model on the device's buffers (each span copies its parameters to
//! host memory on the compute stream, computes there, and writes its gradients back: the model's
//! own additions on copies of the device's gradients, the host engine's arithmetic exactly).
//! Shared by `device_engine` (the host twin of a device) and `gpu_engine` (CUDA).

use std::time::Duration;

use fsdp::engine::{
    ComputeDevice, FsdpConfig, FsdpModel, MixedPrecisionPolicy, ParamInit, ScheduleEvent, Span,
};
use fsdp::wrap::plan_units;
use fsdp::{Fsdp, FsdpError, Grads, Params};
use fsdp_collectives::Communicator;
use fsdp_device::{AccessMode, Buffer, DType, Device, Stream};

use crate::common::{adamw, bits, Bits, Map, GLOBAL};
use crate::tied_mlp::{self, TiedMlp};

/// Optimizer steps of a run.
pub const STEPS: usize = 3;

/// A host model run on a device's buffers (module docs); with a `lag`, each span also leaves
/// work on the compute stream that reads its parameters for that long after it returned, as a
/// GPU's kernels still run when the host has moved on.
pub struct OnDevice<'m, M> {
    pub model: &'m M,
    pub lag: Option<Duration>,
}

/// A span's parameters as host `f32` vectors, with the views' policy.
struct HostCopies {
    map: Map,
    policy: Option<MixedPrecisionPolicy>,
}

impl Params for HostCopies {
    fn param(&self, name: &str) -> Result<&[f32], FsdpError> {
        self.map.param(name)
    }
    fn mixed_precision(&self) -> Option<MixedPrecisionPolicy> {
        self.policy
    }
}

/// A host buffer a device buffer on `device` copies to and from (pinned on CUDA).
fn host_buffer(device: Device, dtype: DType, len: usize) -> Result<Buffer, FsdpError> {
    #[cfg(feature = "cuda")]
    if matches!(device, Device::Cuda(_)) {
        return Ok(Buffer::pinned_zeros(dtype, len)?);
    }
    let _ = device;
    Ok(Buffer::zeros(dtype, len)?)
}

/// `buf` (f32, bf16 or f16) copied to host memory on `stream` and widened.
fn download(buf: &Buffer, stream: &Stream) -> Result<Vec<f32>, FsdpError> {
    let host = host_buffer(buf.device(), buf.dtype(), buf.len())?;
    buf.copy_to_host_async(&host, stream)?;
    Ok(match host.dtype() {
        DType::BF16 => host
            .to_vec::<half::bf16>()?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        DType::F16 => host
            .to_vec::<half::f16>()?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        _ => host.to_vec::<f32>()?,
    })
}

/// `values` copied into the f32 device buffer `buf` on `stream`.
fn upload(buf: &Buffer, values: &[f32], stream: &Stream) -> Result<(), FsdpError> {
    let host = host_buffer(buf.device(), DType::F32, values.len())?;
    host.copy_from_slice(values)?;
    buf.copy_from_host_async(&host, stream)?;
    Ok(())
}

impl<M: FsdpModel> OnDevice<'_, M> {
    fn names(&self, s: usize) -> Vec<String> {
        let mut names = self.model.spans()[s].params.clone();
        names.sort();
        names.dedup();
        names
    }

    fn params(&self, s: usize, p: &dyn Params) -> Result<(HostCopies, Stream), FsdpError> {
        let stream = p.compute_stream().expect("views on a device").clone();
        // On the device the parameters are buffers only.
        let first = &self.names(s)[0];
        let e = p.param(first).unwrap_err().to_string();
        assert!(e.contains("read it as a buffer"), "{e}");
        let mut map = Map::new();
        for n in self.names(s) {
            map.insert(n.clone(), download(&p.buffer(&n)?, &stream)?);
        }
        let policy = p.mixed_precision();
        Ok((HostCopies { map, policy }, stream))
    }

    /// With a lag: work on `stream` that reads the span's parameters for that long.
    fn linger(&self, s: usize, p: &dyn Params, stream: &Stream) -> Result<(), FsdpError> {
        let Some(lag) = self.lag else {
            return Ok(());
        };
        let uses = self
            .names(s)
            .iter()
            .map(|n| Ok(p.buffer(n)?.use_on(stream, AccessMode::Shared)?))
            .collect::<Result<Vec<_>, FsdpError>>()?;
        stream.enqueue(move || std::thread::sleep(lag))?;
        for u in uses {
            u.finish();
        }
        Ok(())
    }
}

impl<M: FsdpModel> FsdpModel for OnDevice<'_, M> {
    type Batch = M::Batch;
    type Tape = M::Tape;

    fn spans(&self) -> Vec<Span> {
        self.model.spans()
    }

    fn forward(
        &self,
        s: usize,
        p: &dyn Params,
        b: &M::Batch,
        t: &mut M::Tape,
    ) -> Result<(), FsdpError> {
        let (params, stream) = self.params(s, p)?;
        self.model.forward(s, &params, b, t)?;
        self.linger(s, p, &stream)
    }

    fn loss(&self, t: &M::Tape) -> Result<f32, FsdpError> {
        self.model.loss(t)
    }

    fn backward(
        &self,
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        b: &M::Batch,
        t: &mut M::Tape,
    ) -> Result<(), FsdpError> {
        let (params, stream) = self.params(s, p)?;
        let first = &self.names(s)[0];
        let e = g.grad_mut(first).unwrap_err().to_string();
        assert!(e.contains("write it as a buffer"), "{e}");
        let mut grads = Map::new();
        for n in self.names(s) {
            grads.insert(n.clone(), download(&g.grad_buffer(&n)?, &stream)?);
        }
        self.model.backward(s, &params, &mut grads, b, t)?;
        for n in self.names(s) {
            upload(&g.grad_buffer(&n)?, &grads[&n], &stream)?;
        }
        self.linger(s, p, &stream)
    }
}

/// What a rank's run gives: the losses, the final parameters (bits), the schedule, the host
/// pool's peak allocated bytes and the device's.
pub struct Outcome {
    pub losses: Vec<u32>,
    pub params: Bits,
    pub schedule: Vec<ScheduleEvent>,
    pub host_peak: u64,
    pub device_peak: Option<u64>,
    /// How often the limiter waited for a freed unit's work on the device.
    pub limiter_waits: u64,
}

/// One rank's run of `world`: `STEPS` steps of `micro` micro-batches each (the first ones under
/// `no_sync`) on the host engine (`device` `None`) or on `device`, the model's spans on it
/// lingering for `lag` ([`OnDevice`]). On a device, its memory is checked to be all released
/// once the deferred frees ran.
pub fn train_rank(
    comm: Box<dyn Communicator>,
    device: Option<ComputeDevice>,
    lag: Option<Duration>,
    world: usize,
    config: FsdpConfig,
    micro: usize,
) -> Outcome {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let model = TiedMlp {
        global: GLOBAL * micro,
    };
    let rank = comm.rank();
    let init = ParamInit::Full(&init);
    let on_device = device.is_some();
    let mut fsdp = match device {
        Some(dev) => Fsdp::new_on(comm, dev, &plan, init, config, adamw()).unwrap(),
        None => Fsdp::new(comm, &plan, init, config, adamw()).unwrap(),
    };
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let mut loss = 0.0;
        for m in 0..micro {
            let batch = tied_mlp::batch(GLOBAL * micro, rank + m * world, world * micro);
            fsdp.set_no_sync(m + 1 < micro);
            loss += if on_device {
                let on = OnDevice { model: &model, lag };
                fsdp.forward_backward(&on, &batch).unwrap()
            } else {
                fsdp.forward_backward(&model, &batch).unwrap()
            };
        }
        fsdp.optimizer_step().unwrap();
        losses.push(loss.to_bits());
    }
    let device_peak = fsdp.device_memory_stats().map(|s| {
        fsdp_device::wait_for_releases(Duration::from_secs(30)).unwrap();
        let now = fsdp.device_memory_stats().unwrap();
        assert_eq!(
            now.allocated_bytes.all.current, 0,
            "rank {rank}: device memory still allocated after the steps"
        );
        s.allocated_bytes.all.peak
    });
    Outcome {
        losses,
        params: bits(&fsdp.full_state_dict().unwrap()),
        schedule: fsdp.schedule().to_vec(),
        host_peak: fsdp.memory_stats().allocated_bytes.all.peak,
        device_peak,
        limiter_waits: fsdp.limiter_free_waits(),
    }
}
