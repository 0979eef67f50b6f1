//! The reference GPT's initialisation rule and the engine's sharded initialisation with it:
//! nanoGPT's rule per parameter, a unit's shards against every tensor materialised, and the
//! full state dict after construction bitwise equal at worlds 1, 2, 3 and 4.

use fsdp::init::{fill_shard, materialize, Init};
use fsdp::FsdpError;
use fsdp_flatparam::FlatParamLayout;
use fsdp_gpt::init::gpt2_init;
use fsdp_gpt::model::{block_param_specs, GptConfig};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn gpt2_rule_follows_nanogpt() {
    let n_layer = 12;
    let rule = gpt2_init(n_layer);
    let proj = 0.02 / (2.0 * n_layer as f64).sqrt();
    let normal = |std| Init::Normal { mean: 0.0, std };
    let cases: [(&str, &[usize], Init); 12] = [
        ("transformer.wte.weight", &[50304, 768], normal(0.02)),
        ("transformer.wpe.weight", &[1024, 768], normal(0.02)),
        ("transformer.h.3.ln_1.weight", &[768], Init::Ones),
        ("transformer.h.3.ln_1.bias", &[768], Init::Zeros),
        (
            "transformer.h.3.attn.c_attn.weight",
            &[2304, 768],
            normal(0.02),
        ),
        ("transformer.h.3.attn.c_attn.bias", &[2304], Init::Zeros),
        (
            "transformer.h.3.attn.c_proj.weight",
            &[768, 768],
            normal(proj),
        ),
        (
            "transformer.h.3.mlp.c_fc.weight",
            &[3072, 768],
            normal(0.02),
        ),
        (
            "transformer.h.3.mlp.c_proj.weight",
            &[768, 3072],
            normal(proj),
        ),
        ("transformer.h.3.mlp.c_proj.bias", &[768], Init::Zeros),
        ("transformer.ln_f.weight", &[768], Init::Ones),
        ("lm_head.weight", &[50304, 768], normal(0.02)),
    ];
    for (name, shape, want) in cases {
        assert_eq!(rule(name, shape).unwrap(), want, "{name}");
    }
    assert!(matches!(
        rule("transformer.h.0.attn.bias_mask", &[4]),
        Err(FsdpError::UnknownParameter { .. })
    ));
    assert!(matches!(
        rule("transformer.ln_f.weight", &[4, 4]),
        Err(FsdpError::InvalidShape { .. })
    ));
    assert!(matches!(
        gpt2_init(0)("transformer.h.0.mlp.c_proj.weight", &[4, 16]),
        Err(FsdpError::InvalidConfig { .. })
    ));
}

#[test]
fn gpt2_unit_sharded_matches_whole_model() {
    // A block unit of a tiny GPT, sharded over 3 ranks, against every tensor materialised.
    let e = 8;
    let cfg = GptConfig::new(2, 2, e, 4, 16).unwrap();
    let names: Vec<(String, Vec<usize>)> = block_param_specs(&cfg, 1)
        .into_iter()
        .map(|p| (p.name, p.shape))
        .collect();
    let rule = gpt2_init(2);
    let seed = 2024;
    let reference: Vec<Vec<f32>> = names
        .iter()
        .map(|(n, s)| materialize(n, s, &rule(n, s).unwrap(), seed).unwrap())
        .collect();
    for world in [1, 3, 5] {
        let layout = names
            .iter()
            .fold(FlatParamLayout::builder(world), |b, (n, s)| b.param(n, s))
            .build()
            .unwrap();
        let mut flat = Vec::new();
        for rank in 0..world {
            let mut shard = vec![f32::NAN; layout.shard_numel()];
            fill_shard(&layout, rank, seed, &rule, &mut shard).unwrap();
            flat.extend(shard);
        }
        assert_eq!(bits(&flat), bits(&layout.flatten(&reference).unwrap()));
    }
}
