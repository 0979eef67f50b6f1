//! Timing the device trainer, for the GPU benchmark (`benches/gpt_device.rs`) and its host-twin
//! check: [`time_steps`] trains a [`DeviceTrainer`] (or each rank's [`ShardedDeviceTrainer`])
//! for some steps and reports the median step
//! time after warm-up, tokens/s, the peak device memory counted and planned, and the model
//! FLOPs of a token ([`model_flops_per_token`]) from which MFU follows. The figures use the
//! definitions of `benches/torch_fsdp2_gpt.py`, so the two benchmarks compare like for like.

use std::time::{Duration, Instant};

use fsdp::engine::StepOutcome as EngineOutcome;
use fsdp_kernels::gpt::GptOps;

use crate::data::get_batch;
use crate::device_comm::DeviceComm;
use crate::device_config::DeviceTrainConfig;
use crate::device_sharded::ShardedDeviceTrainer;
use crate::device_train::{DeviceTrainError, DeviceTrainer, Reported, StepOutcome};
use crate::engine_gpt::EngineGpt;
use crate::engine_views::EngineViews;
use crate::model::GptConfig;

/// A trainer [`time_steps`] can time: [`DeviceTrainer`] (one rank) or
/// [`ShardedDeviceTrainer`] (one of several; every rank must be timed at once).
pub trait TimedTrainer {
    /// The settings (the global batch).
    fn config(&self) -> &DeviceTrainConfig;
    /// Enqueues step `step` and returns the outcome of the one before.
    ///
    /// # Errors
    /// The trainer's.
    fn enqueue_step(
        &mut self,
        tokens: &[u16],
        step: usize,
    ) -> Result<Option<Reported>, DeviceTrainError>;
    /// Runs step `step` to its outcome.
    ///
    /// # Errors
    /// The trainer's.
    fn step(&mut self, tokens: &[u16], step: usize) -> Result<StepOutcome, DeviceTrainError>;
    /// Reads the last step's outcome.
    ///
    /// # Errors
    /// The trainer's.
    fn flush(&mut self) -> Result<Option<Reported>, DeviceTrainError>;
}

impl<O: GptOps> TimedTrainer for DeviceTrainer<O> {
    fn config(&self) -> &DeviceTrainConfig {
        DeviceTrainer::config(self)
    }
    fn enqueue_step(
        &mut self,
        tokens: &[u16],
        step: usize,
    ) -> Result<Option<Reported>, DeviceTrainError> {
        DeviceTrainer::enqueue_step(self, tokens, step)
    }
    fn step(&mut self, tokens: &[u16], step: usize) -> Result<StepOutcome, DeviceTrainError> {
        DeviceTrainer::step(self, tokens, step)
    }
    fn flush(&mut self) -> Result<Option<Reported>, DeviceTrainError> {
        DeviceTrainer::flush(self)
    }
}

impl<O: GptOps, C: DeviceComm<O>> TimedTrainer for ShardedDeviceTrainer<O, C> {
    fn config(&self) -> &DeviceTrainConfig {
        ShardedDeviceTrainer::config(self)
    }
    fn enqueue_step(
        &mut self,
        tokens: &[u16],
        step: usize,
    ) -> Result<Option<Reported>, DeviceTrainError> {
        ShardedDeviceTrainer::enqueue_step(self, tokens, step)
    }
    fn step(&mut self, tokens: &[u16], step: usize) -> Result<StepOutcome, DeviceTrainError> {
        ShardedDeviceTrainer::step(self, tokens, step)
    }
    fn flush(&mut self) -> Result<Option<Reported>, DeviceTrainError> {
        ShardedDeviceTrainer::flush(self)
    }
}

/// Model FLOPs of one token of a training step (forward and backward), as nanoGPT estimates
/// them and `torch_fsdp2_gpt.py` reports MFU: 6 per parameter without the position embedding
/// (a lookup; the token embedding counts once and stands for the tied head's product), plus
/// attention's `12 · n_layer · block_size · n_embd`.
pub fn model_flops_per_token(cfg: &GptConfig) -> f64 {
    let params = cfg.num_params() as f64;
    let position = (cfg.block_size * cfg.n_embd) as f64;
    6.0 * (params - position) + 12.0 * (cfg.n_layer * cfg.block_size * cfg.n_embd) as f64
}

/// What [`time_steps`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimes {
    /// Wall time of every step (each ends with the loss on the host, so it is the real time).
    pub steps: Vec<Duration>,
    /// Steps left out of the median at the start.
    pub warmup: usize,
    /// Tokens of one step (all micro-batches).
    pub tokens_per_step: usize,
    /// Every step's loss.
    pub losses: Vec<f32>,
    /// With [`Reads::AtOnce`], each step's two parts: the host's time enqueuing it (until
    /// `enqueue_step` returns), and the time it then waited for the step's outcome — the
    /// device's work still queued. Empty with [`Reads::OneLate`], whose enqueuing overlaps
    /// the step before.
    ///
    /// The second tells who sets the pace: a host that runs behind the device leaves it a
    /// kernel or two to finish (well under a millisecond); a device that runs behind leaves
    /// much of the step queued, the host having been held back only by the driver's launch
    /// queue filling up.
    pub enqueue: Vec<Duration>,
    /// See [`enqueue`](Self::enqueue).
    pub drain: Vec<Duration>,
}

/// The median of `t` after its first `warmup` (all of them when there are no more).
fn median_after(t: &[Duration], warmup: usize) -> Duration {
    let mut t: Vec<Duration> = match t.get(warmup..) {
        Some(rest) if !rest.is_empty() => rest.to_vec(),
        _ => t.to_vec(),
    };
    t.sort();
    match t.len() {
        0 => Duration::ZERO,
        n if n % 2 == 1 => t[n / 2],
        n => (t[n / 2 - 1] + t[n / 2]) / 2,
    }
}

impl StepTimes {
    /// The median of the steps after warm-up (all of them when there are no more).
    pub fn median(&self) -> Duration {
        median_after(&self.steps, self.warmup)
    }

    /// With [`Reads::AtOnce`], the medians after warm-up of the host's enqueuing and of the
    /// wait that followed it ([`enqueue`](Self::enqueue)); `None` otherwise.
    pub fn split_medians(&self) -> Option<(Duration, Duration)> {
        (!self.enqueue.is_empty()).then(|| {
            (
                median_after(&self.enqueue, self.warmup),
                median_after(&self.drain, self.warmup),
            )
        })
    }

    /// Tokens per second at the median step.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens_per_step as f64 / self.median().as_secs_f64()
    }

    /// Model TFLOP/s at the median step for `cfg` ([`model_flops_per_token`]).
    pub fn tflops(&self, cfg: &GptConfig) -> f64 {
        model_flops_per_token(cfg) * self.tokens_per_s() / 1e12
    }
}

/// How [`time_steps`] reads the steps' outcomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// Each step enqueued while the device runs the one before, its outcome read one step
    /// late ([`DeviceTrainer::enqueue_step`]): what `fsdp train --device` does.
    OneLate,
    /// Each step's outcome read before the next is enqueued ([`DeviceTrainer::step`]): the
    /// host waits for the device every step (the baseline of the one-late reads).
    AtOnce,
}

/// Train `trainer` for `steps` steps of `tokens` (step numbers from 0), reading their outcomes
/// as `reads` says and timing each: a step's time is the time between its outcome and the one
/// before it arriving (the first's from the start); with one-late reads, once the host runs
/// ahead, the device's step time.
///
/// # Errors
/// The trainer's errors; a step that is not finite (a benchmark of skipped steps would time
/// something else), naming the step.
pub fn time_steps<T: TimedTrainer>(
    trainer: &mut T,
    tokens: &[u16],
    steps: usize,
    warmup: usize,
    reads: Reads,
) -> Result<StepTimes, DeviceTrainError> {
    let c = trainer.config();
    let tokens_per_step = c.batch_size * c.cfg.block_size;
    let mut times = StepTimes {
        steps: Vec::with_capacity(steps),
        warmup,
        tokens_per_step,
        losses: Vec::with_capacity(steps),
        enqueue: Vec::new(),
        drain: Vec::new(),
    };
    let mut split = Vec::new();
    let mut last = Instant::now();
    let mut arrived = |r: Reported| {
        let now = Instant::now();
        times.steps.push(now - last);
        last = now;
        let o = r.outcome;
        // A grad scaler's skip of an overflow is training as usual (f16 products).
        if !o.applied && !o.overflow {
            return Err(DeviceTrainError::NotFinite {
                step: r.step,
                loss: o.loss,
                grad_norm: o.grad_norm,
            });
        }
        times.losses.push(o.loss);
        Ok(())
    };
    for step in 0..steps {
        match reads {
            Reads::OneLate => {
                if let Some(r) = trainer.enqueue_step(tokens, step)? {
                    arrived(r)?;
                }
            }
            Reads::AtOnce => {
                // `step` in its two parts, each timed.
                let t0 = Instant::now();
                if let Some(r) = trainer.enqueue_step(tokens, step)? {
                    // A step enqueued before this call, read now.
                    arrived(r)?;
                }
                let t1 = Instant::now();
                let r = trainer.flush()?.ok_or(DeviceTrainError::Unread { step })?;
                split.push((t1 - t0, t1.elapsed()));
                arrived(r)?;
            }
        }
    }
    if let Some(r) = trainer.flush()? {
        arrived(r)?;
    }
    (times.enqueue, times.drain) = split.into_iter().unzip();
    Ok(times)
}

/// Train `gpt` (the GPT's pass driven by the engine's hooks, world 1) for `steps` steps of
/// `rows` sequences of `block_size` tokens from `tokens`, each step
/// [`EngineGpt::train_step`]: a forward and backward, the gradients clipped to a norm of
/// `clip` when given, and the engine's optimizer step if the step is finite, all decided on
/// the device without the host waiting. Each is timed as [`time_steps`] does with
/// [`Reads::OneLate`]: a step's outcome arrives when the next step has been issued, and a
/// step's time runs from the previous outcome's arrival to its own.
///
/// # Errors
/// The engine's and the operations' errors; a step whose loss is not finite, naming it.
pub fn time_engine_steps<O: EngineViews>(
    gpt: &mut EngineGpt<O>,
    tokens: &[u16],
    rows: usize,
    steps: usize,
    warmup: usize,
    clip: Option<f64>,
) -> Result<StepTimes, DeviceTrainError> {
    let t = gpt.pass().dims().block_size;
    let mut times = StepTimes {
        steps: Vec::with_capacity(steps),
        warmup,
        tokens_per_step: rows * t,
        losses: Vec::with_capacity(steps),
        enqueue: Vec::new(),
        drain: Vec::new(),
    };
    let mut last = Instant::now();
    let mut step = 0;
    let mut arrived = |o: EngineOutcome| {
        let now = Instant::now();
        times.steps.push(now - last);
        last = now;
        step += 1;
        if o.nonfinite() {
            return Err(DeviceTrainError::NotFinite {
                step: step - 1,
                loss: o.loss,
                grad_norm: o.grad_norm,
            });
        }
        times.losses.push(o.loss);
        Ok(())
    };
    for k in 0..steps {
        let b = get_batch(tokens, k as u64, rows, t, 0, 1)?;
        for o in gpt.train_step(std::slice::from_ref(&b), rows * t, clip)? {
            arrived(o)?;
        }
    }
    for o in gpt.flush_steps()? {
        arrived(o)?;
    }
    Ok(times)
}
