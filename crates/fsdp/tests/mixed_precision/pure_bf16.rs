//! Pure bf16 with AnyPrecisionAdamW: training on bf16 shards against a reference, the sharded
//! state's bytes per parameter, and the state through a sharded checkpoint.

use super::*;

fn any_precision() -> AnyPrecisionAdamWConfig {
    AnyPrecisionAdamWConfig {
        lr: 1e-2,
        ..AnyPrecisionAdamWConfig::default()
    }
}

/// Pure bf16 (AnyPrecisionAdamW): the shards themselves are bf16 (no f32 master), the optimizer
/// states bf16 with Kahan compensation. At worlds 1 and 2 (where the f32 sum of the two ranks'
/// rounded gradients has one order) the run equals a reference: gradients computed from the
/// bf16 parameters, rounded to bf16, summed in f32, then torchdistx's update on the bf16
/// parameters.
#[test]
fn any_precision_adamw_trains_pure_bf16_shards() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let policy = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32));
    for world in [1, 2] {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        let runs = ring::run_ranks(world, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), world);
            let mut fsdp = tied_engine(comm, &init, config, OptimizerConfig::from(any_precision()));
            assert!(fsdp
                .param_groups()
                .iter()
                .all(|g| g.dtypes().shard == DType::BF16));
            let m = TiedMlp { global: GLOBAL };
            let losses: Vec<f32> = (0..STEPS).map(|_| fsdp.step(&m, &batch).unwrap()).collect();
            (losses, fsdp.full_state_dict().unwrap())
        })
        .unwrap();
        assert!(runs.iter().all(|r| r.1 == runs[0].1), "ranks agree");
        // The reference.
        let m = TiedMlp { global: GLOBAL };
        let mut params: HashMap<String, Vec<bf16>> = init
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().map(|&x| bf16::from_f32(x)).collect()))
            .collect();
        let mut states: HashMap<String, AnyPrecisionAdamWState> = init
            .iter()
            .map(|(k, v)| {
                let s = AnyPrecisionAdamWState::try_new(&any_precision(), v.len()).unwrap();
                (k.clone(), s)
            })
            .collect();
        for _ in 0..STEPS {
            let wide: Map = params
                .iter()
                .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_f32()).collect()))
                .collect();
            let local: Vec<Map> = (0..world)
                .map(|r| local_grads(&m, &wide, policy, &tied_mlp::batch(GLOBAL, r, world)).1)
                .collect();
            for (name, p) in params.iter_mut() {
                let g: Vec<f32> = (0..p.len())
                    .map(|i| {
                        local
                            .iter()
                            .map(|l| round_to(DType::BF16, l[name][i]))
                            .fold(0.0f32, |a, b| if a == 0.0 { b } else { a + b })
                    })
                    .collect();
                states
                    .get_mut(name)
                    .unwrap()
                    .step(&any_precision(), p, &g)
                    .unwrap();
            }
        }
        let want: Map = params
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_f32()).collect()))
            .collect();
        assert_eq!(bits(&runs[0].1), bits(&want), "world {world}");
        let l = &runs[0].0;
        assert!(l[STEPS - 1] < l[0], "learns: {l:?}");
    }
}

/// Sharded state per parameter element: 8 bytes under AnyPrecisionAdamW (bf16 parameter,
/// exp_avg, exp_avg_sq, compensation) against 12 under AdamW with f32 master weights — in the
/// engine (allocator-held shard + optimizer state) and in the plan.
#[test]
fn any_precision_sharded_state_is_8_bytes_per_parameter() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let spans = TiedMlp { global: GLOBAL }.spans();
    for (optim, policy, per_element) in [
        (
            any_precision().into(),
            MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32)),
            8,
        ),
        (adamw().into(), MixedPrecisionPolicy::default(), 12),
    ] {
        let optim: OptimizerConfig = optim;
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        let (numel, bytes) = ring::run_ranks(2, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), 2);
            let mut fsdp = tied_engine(comm, &init, config, optim);
            fsdp.step(&TiedMlp { global: GLOBAL }, &batch).unwrap();
            fsdp.param_groups().iter().fold((0, 0), |(n, b), g| {
                let s = g.layout().shard_numel();
                let shard = s * g.dtypes().shard.size_in_bytes();
                (n + s, b + shard + g.optimizer_state_bytes())
            })
        })
        .unwrap()[0];
        assert_eq!(bytes, per_element * numel, "{optim:?}");
        assert_eq!(
            optim.sharded_bytes_per_param(policy.param_dtype),
            per_element
        );
        let p = fsdp::plan::plan_with_optimizer(&plan, &spans, &[], 2, &config, 1, &optim).unwrap();
        let state = (per_element - policy.param_dtype.size_in_bytes()) * numel;
        assert_eq!(p.per_rank[0].optimizer_state, state as u64, "{optim:?}");
    }
}

/// AnyPrecisionAdamW's state goes through a sharded checkpoint exactly: 2 steps at world 2,
/// save, reload at world 3 (resharded) and at world 2, train 2 more steps; at world 2 the result
/// is bitwise the uninterrupted 4-step run.
#[test]
fn any_precision_state_survives_a_sharded_checkpoint() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let specs: Vec<_> = plan
        .units
        .iter()
        .flat_map(|u| u.params.iter().cloned())
        .chain(plan.ignored.iter().cloned())
        .collect();
    let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
    config.mixed_precision = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32));
    let dir = std::env::temp_dir().join(format!("fsdp-anyprec-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |world: usize, init: &Map, steps: usize, save: bool, state| {
        ring::run_ranks(world, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), world);
            let mut fsdp = tied_engine(comm, init, config, OptimizerConfig::from(any_precision()));
            if let Some(s) = &state {
                fsdp.load_optimizer_state(s).unwrap();
            }
            let m = TiedMlp { global: GLOBAL };
            for _ in 0..steps {
                fsdp.step(&m, &batch).unwrap();
            }
            if save {
                fsdp.save_sharded(&dir).unwrap();
            }
            fsdp.full_state_dict().unwrap()
        })
        .unwrap()
        .remove(0)
    };
    let whole = run(2, &init, 4, false, None);
    run(2, &init, 2, true, None);
    let ckpt = fsdp::checkpoint::load_sharded_checkpoint(&dir, &specs).unwrap();
    assert_eq!(
        ckpt.optimizer.as_ref().unwrap().optimizer,
        "anyprecision_adamw"
    );
    let resumed = run(2, &ckpt.params, 2, false, ckpt.optimizer.clone());
    assert_eq!(bits(&resumed), bits(&whole), "resumed at world 2");
    let resharded = run(3, &ckpt.params, 2, false, ckpt.optimizer.clone());
    assert_eq!(resharded.len(), whole.len(), "resumed at world 3");
    std::fs::remove_dir_all(&dir).unwrap();
}
