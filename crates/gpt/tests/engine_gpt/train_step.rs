//! `EngineGpt::train_step`: the step's loss kept in the engine's memory, clipping, and the
//! optimizer step only if the step is finite (`Fsdp::optimizer_step_if_finite`), decided on
//! the device (the host twin) and read one step late, as on the host at once.

use fsdp::engine::{Fsdp, StepOutcome};
use fsdp_gpt::engine_gpt::EngineGpt;
use fsdp_gpt::engine_views::EngineViews;
use fsdp_gpt::runtime::ShardingStrategy;
use fsdp_kernels::gpt::GptPass;

use super::common::training::Setup;
use super::{
    bits, micro_batches, on_place, run, Bits, Options, Place, RankBody, BATCH, SEQ, STEPS,
};

/// Each step's outcome as (loss, norm bits, applied, halted), and how many arrived at each
/// step (then at the flush).
type Outcomes = (Vec<(f32, u64, bool, bool)>, Vec<usize>);

/// Rank 0's `STEPS` steps of `train_step` clipped to `clip`, skipping up to `limit`
/// non-finite steps, the engine's buffers in `place`; the outcomes and final parameters.
fn steps<S: Copy + Into<fsdp::optim::OptimizerConfig> + Sync>(
    s: &Setup<S>,
    world: usize,
    o: Options,
    place: Place,
    clip: Option<f64>,
    limit: Option<u64>,
) -> (Outcomes, Bits) {
    struct Steps<'a, S>(&'a Setup<S>, Options, Option<f64>, Option<u64>);
    impl<S: Copy + Into<fsdp::optim::OptimizerConfig> + Sync> RankBody for Steps<'_, S> {
        type Out = (Outcomes, Bits);
        fn run<O: EngineViews>(&self, fsdp: Fsdp, ops: O) -> (Outcomes, Bits) {
            drive(self.0, fsdp, ops, self.1, self.2, self.3)
        }
    }
    on_place(s, world, o, place, &Steps(s, o, clip, limit))
}

/// One rank's steps of [`steps`] over `ops` on `fsdp`.
fn drive<O: EngineViews>(
    s: &Setup<impl Copy + Into<fsdp::optim::OptimizerConfig>>,
    fsdp: Fsdp,
    ops: O,
    o: Options,
    clip: Option<f64>,
    limit: Option<u64>,
) -> (Outcomes, Bits) {
    let (rank, world) = (fsdp.rank(), fsdp.world_size());
    let pass = GptPass::new(ops, s.cfg.dims()).unwrap();
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
        let (host, host_params) = steps(&s, world, o, Place::Host, Some(0.05), None);
        let (dev, dev_params) = steps(&s, world, o, Place::HostTwin, Some(0.05), None);
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
        let (unclipped, unclipped_params) = steps(&s, world, o, Place::HostTwin, None, None);
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
    let (host, host_params) = steps(&s, 2, o, Place::Host, Some(1.0), Some(1));
    let (dev, dev_params) = steps(&s, 2, o, Place::HostTwin, Some(1.0), Some(1));
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

/// On a GPU: `train_step` with the kernels on the engine's CUDA buffers (the step's loss in a
/// view of the engine's buffer, the decision by `engine_decide`) tracks the host twins on the
/// host engine within 1e-4 relative (cuBLAS's f32 products against the host's), one step
/// late, at worlds 1 and 2 over the CUDA ring, in one and in two micro-batches, every step
/// applied; a NaN weight halts it past the limit as on the host.
#[test]
fn train_step_on_the_gpu_tracks_the_host_twins() {
    if !super::common::gpu::gpu("train_step_on_the_gpu_tracks_the_host_twins") {
        return;
    }
    let s = Setup::new(2, 7, 42, super::common::adamw());
    // Two micro-batches: at world 1 every unit's gradient accumulates in its gradient shard
    // on the GPU itself, across the micro-batches.
    for (world, accum) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let o = Options {
            accum,
            ..Options::new(ShardingStrategy::FullShard)
        };
        let what = format!("world {world}, {accum} micro-batches");
        let (host, _) = steps(&s, world, o, Place::Host, Some(1.0), None);
        let (gpu, _) = steps(&s, world, o, Place::Gpu, Some(1.0), None);
        let n = STEPS as usize;
        assert_eq!(
            gpu.1,
            [vec![0], vec![1; n]].concat(),
            "{what}: one step late"
        );
        for (g, h) in gpu.0.iter().zip(&host.0) {
            assert!(((g.0 - h.0) / h.0).abs() <= 1e-4, "{what}: {g:?} vs {h:?}");
            assert!(g.2 && !g.3, "{what}: {g:?}");
        }
        println!("{what}: train_step outcomes {:?}", gpu.0);
    }
    let mut s = s;
    if let Some(w) = s.init.get_mut("transformer.h.0.mlp.c_fc.weight") {
        w[3] = f32::NAN;
    }
    let o = Options::new(ShardingStrategy::FullShard);
    let (gpu, _) = steps(&s, 1, o, Place::Gpu, Some(1.0), Some(1));
    let halted: Vec<bool> = gpu.0.iter().map(|o| o.3).collect();
    assert_eq!(halted, [false, true, true]);
    assert!(gpu.0.iter().all(|o| !o.2));
}
