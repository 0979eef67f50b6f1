//! `EngineGpt::train_step`: the step's loss kept in the engine's memory, clipping, and the
//! optimizer step only if the step is finite (`Fsdp::optimizer_step_if_finite`), decided on
//! the device (the host twin) and read one step late, as on the host at once.

use std::time::Duration;

use fsdp::engine::{ComputeDevice, StepOutcome};
use fsdp_collectives::{ring, Communicator};
use fsdp_gpt::engine_gpt::EngineGpt;
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::{GptPass, HostOps};

use super::common::training::{ring_options, Setup};
use super::{bits, engine, micro_batches, run, Bits, Options, Place, BATCH, SEQ, STEPS};

/// Each step's outcome as (loss, norm bits, applied, halted), and how many arrived at each
/// step (then at the flush).
type Outcomes = (Vec<(f32, u64, bool, bool)>, Vec<usize>);

/// Rank 0's `STEPS` steps of `train_step` clipped to `clip`, skipping up to `limit`
/// non-finite steps; the outcomes and final parameters.
fn steps(
    s: &Setup<impl Copy + Into<fsdp::optim::OptimizerConfig> + Sync>,
    world: usize,
    o: Options,
    on_device: bool,
    clip: Option<f64>,
    limit: Option<u64>,
) -> (Outcomes, Bits) {
    let mut out = ring::run_ranks(world, ring_options(), |comm| {
        let rank = comm.rank();
        let dev = on_device.then(|| {
            let latency = Duration::from_millis(1);
            ComputeDevice::host_twin_with_latency(1 << 28, Default::default(), latency).unwrap()
        });
        let fsdp = engine(s, Box::new(comm), dev, o);
        let pass = GptPass::new(HostOps::new(), s.cfg.dims()).unwrap();
        let mut gpt = EngineGpt::new(fsdp, pass).unwrap();
        gpt.set_skip_nonfinite(limit);
        let (mut outcomes, mut arrivals) = (Vec::new(), Vec::new());
        let mut take = |got: Vec<StepOutcome>| {
            arrivals.push(got.len());
            let got = got
                .iter()
                .map(|o| (o.loss, o.grad_norm.to_bits(), o.applied, o.halted));
            outcomes.extend(got);
        };
        for k in 0..STEPS {
            let micro = micro_batches(s, k, rank, world, o.accum);
            take(gpt.train_step(&micro, BATCH * SEQ, clip).unwrap());
        }
        take(gpt.flush_steps().unwrap());
        let params = gpt.engine().full_state_dict().unwrap();
        ((outcomes, arrivals), bits(&[], &[], params))
    })
    .unwrap();
    out.swap_remove(0)
}

/// The device's outcomes, one step late, are the host's (bit for bit, clipping included),
/// and so are the parameters; the losses are the global batch's mean within the rounding of
/// the shares' sums, and the steps are `forward_backward`'s then `optimizer_step`'s.
#[test]
fn train_step_decides_on_the_device_as_on_the_host() {
    let s = Setup::new(2, 5, 17, super::common::adamw());
    for (world, strategy, accum) in [
        (1, ShardingStrategy::FullShard, 1),
        (2, ShardingStrategy::FullShard, 2),
        (2, ShardingStrategy::ShardGradOp, 1),
    ] {
        let what = format!("world {world}, {strategy:?}, {accum} micro-batches");
        let o = Options {
            accum,
            ..Options::new(strategy)
        };
        let (host, host_params) = steps(&s, world, o, false, Some(0.05), None);
        let (dev, dev_params) = steps(&s, world, o, true, Some(0.05), None);
        assert_eq!(dev.0, host.0, "{what}: outcomes");
        assert_eq!(dev_params, host_params, "{what}: parameters");
        let n = STEPS as usize;
        assert_eq!(host.1, [vec![1; n], vec![0]].concat(), "{what}: at once");
        assert_eq!(
            dev.1,
            [vec![0], vec![1; n]].concat(),
            "{what}: one step late"
        );
        assert!(
            host.0.iter().all(|o| o.2 && !o.3),
            "{what}: every step applied"
        );
        // Without clipping, against the pass's loss read at once and `optimizer_step`: the
        // same steps.
        let (unclipped, unclipped_params) = steps(&s, world, o, true, None, None);
        let (want, _, want_params) = run(&s, world, o, Place::Host);
        for (step, (got, want)) in unclipped.0.iter().zip(&want).enumerate() {
            let want = f32::from_bits(*want);
            assert!(
                (got.0 - want).abs() <= 2e-6 * want.abs(),
                "{what}: step {step}'s loss {} against {want}",
                got.0
            );
        }
        assert_eq!(
            unclipped_params.2, want_params,
            "{what}: the steps without clipping"
        );
    }
}

/// A NaN weight makes every step non-finite: the first is skipped, the second passes the
/// limit of 1 and halts the engine, so that no step applies — on the device as on the host —
/// and the weights are the initial ones.
#[test]
fn a_nonfinite_run_halts_past_the_limit() {
    let mut s = Setup::new(1, 5, 17, super::common::adamw());
    let initial = s.init.clone();
    if let Some(w) = s.init.get_mut("transformer.h.0.mlp.c_fc.weight") {
        w[3] = f32::NAN;
    }
    let o = Options::new(ShardingStrategy::FullShard);
    let (host, host_params) = steps(&s, 2, o, false, Some(1.0), Some(1));
    let (dev, dev_params) = steps(&s, 2, o, true, Some(1.0), Some(1));
    assert_eq!(
        dev.0
            .iter()
            .map(|o| (o.0.to_bits(), o.1, o.2, o.3))
            .collect::<Vec<_>>(),
        host.0
            .iter()
            .map(|o| (o.0.to_bits(), o.1, o.2, o.3))
            .collect::<Vec<_>>()
    );
    assert_eq!(dev_params, host_params);
    let halted: Vec<bool> = host.0.iter().map(|o| o.3).collect();
    assert_eq!(halted, [false, true, true]);
    assert!(host.0.iter().all(|o| !o.2 && o.0.is_nan()));
    // Only the NaN weight differs from the initial weights: nothing was stepped.
    let (_, _, init_bits) = bits(&[], &[], initial);
    let changed: Vec<&String> = host_params
        .2
        .iter()
        .zip(&init_bits)
        .filter(|(a, b)| a != b)
        .map(|(a, _)| &a.0)
        .collect();
    assert_eq!(changed, ["transformer.h.0.mlp.c_fc.weight"]);
}
