//! The engine's device tests' model (`device_steady_state`, `device_grad_scaler` include this
//! file with `#[path]`): `y = w2 ⊙ (w1 ⊙ x)` over two units, whose spans run as tasks of the
//! host twin's compute stream on a device (its loss left in device memory) and as plain slices
//! on the host, with the same arithmetic; its weights, batches and parameter specs, and the
//! check that a collective failed on one rank is reported on both.

// The model's loops index several vectors alike, on the host and in the device's tasks.
#![allow(clippy::needless_range_loop)]
// Each test uses what it needs.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use fsdp::engine::{FsdpModel, Span};
use fsdp::units::{ParamSpec, UnitPlan, UnitSpec};
use fsdp::{Fsdp, FsdpError, Grads, Params};
use fsdp_collectives::{ring, Communicator};
use fsdp_device::{host_task, Buffer, DType, HostStorage, Stream};

/// Elements of each parameter.
pub const N: usize = 8;

/// `y = w2 ⊙ (w1 ⊙ x)`, loss `½·Σ(y − t)² / global`, over vectors of `N`: two units. On a
/// device every span is a task of the compute stream, and the loss a device buffer
/// (`FsdpModel::loss_buffer`); on the host the same arithmetic on slices.
pub struct Chain {
    pub global: f32,
    /// Hand the engine a host buffer as the loss (refused by name).
    pub bad_loss: bool,
}

/// The activations: host vectors, or device buffers.
#[derive(Default)]
pub struct Tape {
    h: Vec<f32>,
    y: Vec<f32>,
    dh: Vec<f32>,
    dev: Option<[Buffer; 3]>,
    loss: f32,
    dev_loss: Option<Buffer>,
}

/// (x, t): this rank's input and target.
pub type Batch = (Vec<f32>, Vec<f32>);

/// A stream-ordered buffer of the twin: zeroed host memory ordered by streams.
pub fn ordered(n: usize) -> Result<Buffer, FsdpError> {
    let mem = HostStorage::zeroed(n * 4)?;
    Ok(Buffer::stream_ordered(Box::new(mem), DType::F32)?)
}

pub fn y_of(w2: &[f32], h: &[f32]) -> Vec<f32> {
    w2.iter().zip(h).map(|(w, h)| w * h).collect()
}

pub fn dy_of(y: f32, t: f32, global: f32) -> f32 {
    (y - t) / global
}

pub fn loss_of(y: &[f32], t: &[f32], global: f32) -> f32 {
    y.iter()
        .zip(t)
        .map(|(y, t)| 0.5 * (y - t) * (y - t))
        .sum::<f32>()
        / global
}

/// Run `f` on the device's compute stream over `reads` and `writes` (f32 buffers).
pub fn on_device(
    stream: &Stream,
    reads: &[&Buffer],
    writes: &[&Buffer],
    f: impl FnOnce(&[&[f32]], &mut [&mut [f32]]) + Send + 'static,
) -> Result<(), FsdpError> {
    host_task(stream, reads, writes, move |r, w| {
        let r: Vec<&[f32]> = r
            .iter()
            .map(|r| r.as_slice::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let mut w: Vec<&mut [f32]> = w
            .iter_mut()
            .map(|w| w.as_mut_slice::<f32>())
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        f(&r, &mut w);
        Ok(())
    })?;
    Ok(())
}

impl FsdpModel for Chain {
    type Batch = Batch;
    type Tape = Tape;
    fn spans(&self) -> Vec<Span> {
        vec![Span::new("l1", ["w1"]), Span::new("l2", ["w2"])]
    }
    fn forward(&self, s: usize, p: &dyn Params, b: &Batch, t: &mut Tape) -> Result<(), FsdpError> {
        let Some(stream) = p.compute_stream() else {
            if s == 0 {
                t.h = p
                    .param("w1")?
                    .iter()
                    .zip(&b.0)
                    .map(|(w, x)| w * x)
                    .collect();
            } else {
                t.y = y_of(p.param("w2")?, &t.h);
                t.loss = loss_of(&t.y, &b.1, self.global);
            }
            return Ok(());
        };
        if s == 0 {
            t.dev = Some([ordered(N)?, ordered(N)?, ordered(N)?]);
        }
        let [h, y, _] = t.dev.as_ref().ok_or_else(|| FsdpError::InvalidFsdpConfig {
            reason: "no tape".into(),
        })?;
        if s == 0 {
            let x = b.0.clone();
            on_device(stream, &[&p.buffer("w1")?], &[h], move |r, w| {
                for ((h, w1), x) in w[0].iter_mut().zip(r[0]).zip(&x) {
                    *h = w1 * x;
                }
            })
        } else {
            let (target, global) = (b.1.clone(), self.global);
            let loss = ordered(1)?;
            on_device(stream, &[&p.buffer("w2")?, h], &[y, &loss], move |r, w| {
                let v = y_of(r[0], r[1]);
                w[1][0] = loss_of(&v, &target, global);
                w[0].copy_from_slice(&v);
            })?;
            t.dev_loss = Some(loss);
            Ok(())
        }
    }
    fn loss(&self, t: &Tape) -> Result<f32, FsdpError> {
        // On the device the loss stays there (`loss_buffer`); 0 is returned.
        Ok(t.loss)
    }

    fn loss_buffer(&self, t: &Tape) -> Result<Option<Buffer>, FsdpError> {
        if self.bad_loss {
            return Ok(Some(Buffer::zeros(DType::F32, 1)?));
        }
        Ok(t.dev_loss.clone())
    }
    fn backward(
        &self,
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        b: &Batch,
        t: &mut Tape,
    ) -> Result<(), FsdpError> {
        let global = self.global;
        let Some(stream) = p.compute_stream().cloned() else {
            if s == 1 {
                let w2 = p.param("w2")?;
                let dy: Vec<f32> =
                    t.y.iter()
                        .zip(&b.1)
                        .map(|(y, t)| dy_of(*y, *t, global))
                        .collect();
                let gw2 = g.grad_mut("w2")?;
                for i in 0..N {
                    gw2[i] += dy[i] * t.h[i];
                }
                t.dh = dy.iter().zip(w2).map(|(d, w)| d * w).collect();
            } else {
                let gw1 = g.grad_mut("w1")?;
                for i in 0..N {
                    gw1[i] += t.dh[i] * b.0[i];
                }
            }
            return Ok(());
        };
        let [h, y, dh] = t.dev.as_ref().ok_or_else(|| FsdpError::InvalidFsdpConfig {
            reason: "no tape".into(),
        })?;
        if s == 1 {
            let target = b.1.clone();
            let (w2, gw2) = (p.buffer("w2")?, g.grad_buffer("w2")?);
            on_device(&stream, &[&w2, h, y], &[&gw2, dh], move |r, w| {
                let dy: Vec<f32> = r[2]
                    .iter()
                    .zip(&target)
                    .map(|(y, t)| dy_of(*y, *t, global))
                    .collect();
                for i in 0..N {
                    w[0][i] += dy[i] * r[1][i];
                    w[1][i] = dy[i] * r[0][i];
                }
            })
        } else {
            let x = b.0.clone();
            let gw1 = g.grad_buffer("w1")?;
            on_device(&stream, &[dh], &[&gw1], move |r, w| {
                for i in 0..N {
                    w[0][i] += r[0][i] * x[i];
                }
            })
        }
    }
}

pub fn plan() -> UnitPlan {
    let unit = |u: &str, p: &str| UnitSpec {
        name: u.into(),
        params: vec![ParamSpec::new(p, vec![N])],
    };
    UnitPlan {
        units: vec![unit("l1", "w1"), unit("l2", "w2")],
        ignored: vec![],
    }
}

/// The weights the runs start from.
pub fn init() -> std::collections::HashMap<String, Vec<f32>> {
    std::collections::HashMap::from([
        (
            "w1".to_string(),
            (0..N).map(|i| 0.5 + i as f32 / 16.0).collect::<Vec<f32>>(),
        ),
        (
            "w2".to_string(),
            (0..N).map(|i| 1.0 - i as f32 / 32.0).collect(),
        ),
    ])
}

/// Rank `rank`'s batch (the same every step), and the model of `world` ranks.
pub fn batch(rank: usize, world: usize) -> (Batch, Chain) {
    let x: Vec<f32> = (0..N)
        .map(|i| ((i + rank) % 5) as f32 * 0.25 - 0.5)
        .collect();
    let t: Vec<f32> = (0..N).map(|i| ((i * 3 + rank) % 4) as f32 * 0.5).collect();
    let model = Chain {
        global: (N * world) as f32,
        bad_loss: false,
    };
    ((x, t), model)
}

/// Every parameter of [`plan`].
pub fn specs() -> Vec<ParamSpec> {
    plan().units.into_iter().flat_map(|u| u.params).collect()
}

/// Two ranks train the chain for `steps` steps (`forward_backward_async`, `optimizer_step`)
/// on the engines `build` makes of their communicators, each rank's first passed through
/// `wrap` (a hooked communicator that fails one collective of rank 1 "on purpose"), then
/// `synchronize`, every collective with a 2 s timeout: rank 1 must fail at step 1 by that
/// fault and rank 0 report an error too (at a later step or at `synchronize`), within 60 s —
/// never a hang, never a silent success.
pub fn assert_fault_reported(
    steps: usize,
    wrap: impl Fn(usize, ring::RingCommunicator) -> Box<dyn Communicator> + Sync,
    build: impl Fn(Box<dyn Communicator>) -> (Fsdp, Batch, Chain) + Sync,
) {
    let mut options = crate::common::ring_options();
    options.timeout = Duration::from_secs(2);
    let start = Instant::now();
    let errors = ring::run_ranks(2, options, |comm| {
        let (mut fsdp, batch, model) = build(wrap(comm.rank(), comm));
        for step in 0..steps {
            let r = fsdp
                .forward_backward_async(&model, &batch)
                .and_then(|_| fsdp.optimizer_step());
            if let Err(e) = r {
                return (step, e.to_string());
            }
        }
        let e = fsdp
            .synchronize()
            .expect_err("a failed collective went unreported");
        (steps, e.to_string())
    })
    .unwrap();
    println!("{errors:?} after {:?}", start.elapsed());
    assert_eq!(errors[1].0, 1, "rank 1 fails at step 1");
    assert!(errors[1].1.contains("failed on purpose"), "{}", errors[1].1);
    assert!(errors[0].0 >= 1, "rank 0 failed before the fault");
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
}
