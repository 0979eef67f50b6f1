//! The reference GPT's module tree: its parameters, paths and types as nanoGPT's `model.py`
//! nests them, and the single-unit plan without a wrap policy.

use fsdp::wrap::{plan_units, WrapOptions};
use fsdp_gpt::model::{param_specs, GptConfig};
use fsdp_gpt::tree::gpt_module_tree;

fn small() -> GptConfig {
    GptConfig::new(2, 2, 8, 4, 16).unwrap()
}

#[test]
fn gpt_tree_parameters_are_param_specs() {
    for cfg in [
        small(),
        GptConfig::tiny(),
        GptConfig::new(3, 1, 4, 7, 11).unwrap(),
    ] {
        let tree = gpt_module_tree(&cfg);
        assert_eq!(tree.named_parameters(), param_specs(&cfg));
        assert_eq!(tree.numel(), cfg.num_params());
        let all = tree.all_params();
        let (last, p) = all.last().unwrap();
        assert_eq!(last, "lm_head.weight");
        assert_eq!(p.tied_to.as_deref(), Some("transformer.wte.weight"));
        assert_eq!(all.len(), param_specs(&cfg).len() + 1);
    }
}

#[test]
fn gpt_tree_paths_and_types() {
    let tree = gpt_module_tree(&small());
    let m = |p: &str| tree.find(p).unwrap().type_name.clone();
    assert_eq!(m(""), "GPT");
    assert_eq!(m("transformer"), "ModuleDict");
    assert_eq!(m("transformer.h"), "ModuleList");
    assert_eq!(m("transformer.h.1"), "Block");
    assert_eq!(m("transformer.h.1.attn"), "CausalSelfAttention");
    assert_eq!(m("transformer.h.1.attn.c_attn"), "Linear");
    assert_eq!(m("transformer.h.1.mlp"), "MLP");
    assert_eq!(m("transformer.h.0.mlp.gelu"), "GELU");
    assert_eq!(m("transformer.ln_f"), "LayerNorm");
    assert_eq!(m("transformer.wpe"), "Embedding");
    assert_eq!(m("lm_head"), "Linear");
    // Pre-order of named_modules(), children in registration order.
    let names: Vec<_> = tree.modules().iter().map(|m| m.name.clone()).collect();
    assert_eq!(
        names[..8],
        [
            "",
            "transformer",
            "transformer.wte",
            "transformer.wpe",
            "transformer.drop",
            "transformer.h",
            "transformer.h.0",
            "transformer.h.0.ln_1"
        ]
    );
    assert_eq!(names.last().unwrap(), "lm_head");
    // An alias alone counts in full; with its target, once.
    assert_eq!(tree.find("lm_head").unwrap().numel(), 16 * 8);
    assert!(tree.find("nope").is_none());
}

#[test]
fn no_policy_gives_one_root_unit() {
    let cfg = small();
    let plan = plan_units(&gpt_module_tree(&cfg), &WrapOptions::default()).unwrap();
    assert_eq!(plan.units.len(), 1);
    assert_eq!(plan.units[0].name, "");
    assert_eq!(plan.units[0].params, param_specs(&cfg));
    assert!(plan.ignored.is_empty());
}
