//! Every policy against the simulation, bit for bit (strategies, worlds and hybrid meshes,
//! `use_orig_params`, world 1, the forward casts), and the policy's other effects: the bytes
//! all-gathered, FSDP2's divide factors, the refusal of a float64 policy.

use super::*;

#[test]
fn every_strategy_world_and_policy_equals_the_simulation_bitwise() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let mut checked = 0;
    for (world, base) in configs() {
        for policy in policies() {
            for divide in [GradientDivide::Model, GradientDivide::DataParallelSize] {
                let mut config = base;
                config.mixed_precision = policy;
                config.gradient_divide = divide;
                let what = format!(
                    "world {world} {:?} ranks_per_node {:?} {:?} {divide:?}",
                    config.strategy, config.ranks_per_node, policy
                );
                let (want_losses, want) = simulate(&plan, world, &config, &init);
                let (losses, got, _) = engine(world, config, &init);
                assert_eq!(bits(&got), bits(&want), "{what}: parameters");
                let lb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(lb(&losses), lb(&want_losses), "{what}: losses");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 28 * 4 * 2);
}

/// `use_orig_params`: the flat parameters are aligned to 16 bytes of `param_dtype` (4 `f32`
/// or 8 `bf16` elements) and padded to the shard group size, as PyTorch lays them out, and
/// training equals the simulation over that layout bit for bit.
#[test]
fn use_orig_params_aligns_to_the_param_dtype_and_equals_the_simulation() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    for world in [1, 3, 4] {
        for (policy, align) in [
            (MixedPrecisionPolicy::default(), 4),
            (MixedPrecisionPolicy::new(DType::BF16, None), 8),
        ] {
            let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
            config.mixed_precision = policy;
            config.use_orig_params = true;
            let layouts: Vec<(usize, usize, usize)> =
                ring::run_ranks(world, ring_options(), |comm| {
                    let fsdp = tied_engine(comm, &init, config, adamw());
                    (0..fsdp.num_units())
                        .filter_map(|u| fsdp.layout(u))
                        .map(|l| (l.align_numel(), l.unpadded_numel(), l.end_padding_numel()))
                        .collect::<Vec<_>>()
                })
                .unwrap()
                .remove(0);
            assert!(!layouts.is_empty());
            for (a, unpadded, end) in layouts {
                assert_eq!(a, align, "world {world} {policy:?}");
                assert_eq!((unpadded % world, end), (0, 0), "world {world} {policy:?}");
            }
            let (want_losses, want) = simulate(&plan, world, &config, &init);
            let (losses, got, _) = engine(world, config, &init);
            assert_eq!(
                bits(&got),
                bits(&want),
                "world {world} {policy:?}: parameters"
            );
            let lb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                lb(&losses),
                lb(&want_losses),
                "world {world} {policy:?}: losses"
            );
        }
    }
}

/// At world 1 with `reduce_dtype` f32: a single-process f32 run whose parameters are rounded
/// to `param_dtype` before every forward and whose gradients are rounded to `param_dtype`.
#[test]
fn world_one_is_the_rounded_single_process_run() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    for p in [DType::BF16, DType::F16] {
        let policy = MixedPrecisionPolicy::new(p, Some(DType::F32));
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        let (_, got, _) = engine(1, config, &init);
        let batch = tied_mlp::batch(GLOBAL, 0, 1);
        let m = TiedMlp { global: GLOBAL };
        let mut master = init.clone();
        let mut states: HashMap<String, AdamWState> = master
            .iter()
            .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
            .collect();
        for _ in 0..STEPS {
            let (_, mut grads) = local_grads(&m, &master, policy, &batch);
            for (name, w) in master.iter_mut() {
                let g = grads.get_mut(name).unwrap();
                round_slice(p, g);
                states.get_mut(name).unwrap().step(&adamw(), w, g).unwrap();
            }
        }
        assert_eq!(bits(&got), bits(&master), "{p}");
        // And it is not the f32 run.
        let (_, f32_run, _) = engine(1, FsdpConfig::new(ShardingStrategy::FullShard), &init);
        assert_ne!(bits(&got), bits(&f32_run), "{p} changes the result");
    }
}

/// `output_dtype` and `cast_forward_inputs` reach the model: each changes the result, and the
/// simulation (which applies them through the same policy) still matches.
#[test]
fn output_dtype_and_cast_forward_inputs_are_applied() {
    let tree = tied_mlp::tree();
    let plan = plan_units(&tree, &tied_mlp::wrap()).unwrap();
    let init = tied_mlp::init_params(&tree);
    let base = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32));
    let mut results = Vec::new();
    for (cast_inputs, output) in [(false, None), (true, None), (true, Some(DType::F16))] {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = MixedPrecisionPolicy {
            cast_forward_inputs: cast_inputs,
            output_dtype: output,
            ..base
        };
        let (_, want) = simulate(&plan, 2, &config, &init);
        let (_, got, _) = engine(2, config, &init);
        assert_eq!(bits(&got), bits(&want));
        results.push(bits(&got));
    }
    assert_ne!(
        results[0], results[1],
        "cast_forward_inputs changes the run"
    );
    assert_ne!(results[1], results[2], "output_dtype changes the run");
}

/// bf16 parameters halve the bytes all-gathered; the schedule is the same.
#[test]
fn bf16_halves_the_bytes_all_gathered() {
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let run = |policy| {
        let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
        config.mixed_precision = policy;
        config.trace = true;
        ring::run_ranks(2, ring_options(), |comm| {
            let batch = tied_mlp::batch(GLOBAL, comm.rank(), 2);
            let mut fsdp = tied_engine(comm, &init, config, adamw());
            fsdp.step(&TiedMlp { global: GLOBAL }, &batch).unwrap();
            let bytes = |k: fsdp::trace::SpanKind| -> u64 {
                fsdp.trace_events()
                    .iter()
                    .filter_map(|e| match e {
                        fsdp::trace::TraceEvent::Span { kind, bytes, .. } if *kind == k => *bytes,
                        _ => None,
                    })
                    .sum()
            };
            (
                bytes(fsdp::trace::SpanKind::AllGather),
                bytes(fsdp::trace::SpanKind::ReduceScatter),
                fsdp.schedule().to_vec(),
            )
        })
        .unwrap()
        .remove(0)
    };
    let f32_run = run(MixedPrecisionPolicy::default());
    let bf16 = run(MixedPrecisionPolicy::new(DType::BF16, Some(DType::F32)));
    let bf16_bf16 = run(MixedPrecisionPolicy::new(DType::BF16, None));
    assert!(f32_run.0 > 0);
    assert_eq!(bf16.0 * 2, f32_run.0);
    assert_eq!(
        bf16.1, f32_run.1,
        "f32 reduce: the same reduce-scatter bytes"
    );
    assert_eq!(bf16_bf16.1 * 2, f32_run.1);
    assert_eq!(bf16.2, f32_run.2, "the same schedule");
}

#[test]
fn fsdp2_divide_factors() {
    let f = |n| divide_factors(GradientDivide::DataParallelSize, DType::F16, n);
    assert_eq!((f(1).pre_divide, f(1).post_divide), (None, None));
    assert_eq!((f(2).pre_divide, f(2).post_divide), (Some(2.0), None));
    assert_eq!((f(3).pre_divide, f(3).post_divide), (Some(2.0), Some(1.5)));
    assert_eq!((f(4).pre_divide, f(4).post_divide), (Some(2.0), Some(2.0)));
    assert_eq!(
        (f(16).pre_divide, f(16).post_divide),
        (Some(4.0), Some(4.0))
    );
    assert_eq!(
        (f(32).pre_divide, f(32).post_divide),
        (Some(8.0), Some(4.0))
    );
    let a = divide_factors(GradientDivide::DataParallelSize, DType::BF16, 3);
    assert_eq!(a.premul, Some(round_to(DType::BF16, 1.0 / 3.0)));
    let m = divide_factors(GradientDivide::Model, DType::F16, 8);
    assert_eq!(m, fsdp::engine::DivideFactors::NONE);
}

#[test]
fn a_float64_policy_is_refused_by_name() {
    let mut config = FsdpConfig::new(ShardingStrategy::FullShard);
    config.mixed_precision = MixedPrecisionPolicy::new(DType::BF16, Some(DType::F64));
    let tree = tied_mlp::tree();
    let init = tied_mlp::init_params(&tree);
    let err = ring::run_ranks(1, ring_options(), |comm| {
        tied_engine_result(comm, &init, config, adamw().into())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(err[0].contains("reduce_dtype float64"), "{}", err[0]);
}
