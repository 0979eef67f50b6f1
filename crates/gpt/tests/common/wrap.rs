//! Helpers of the wrap-policy tests (`wrap.rs`, which includes this file with `#[path]`): the
//! small GPT of the hand-computed examples, planning shortcuts, the coverage check of a plan, the
//! tied-parameter error's fields, and the ownership rule the random policies are checked against.

use std::collections::HashMap;

use fsdp::units::UnitPlan;
use fsdp::wrap::{plan_units, WrapOptions, WrapPolicy};
use fsdp::FsdpError;
use fsdp_gpt::model::{param_specs, GptConfig, ParamSpec};
use fsdp_gpt::tree::gpt_module_tree;

/// The small GPT of the hand-computed examples: 2 layers, E = 8, T = 4, V = 16.
///
/// Element counts (E = 8):
/// - `transformer.wte` 16·8 = 128, `transformer.wpe` 4·8 = 32, `transformer.ln_f` 2·8 = 16;
/// - `lm_head` alone 128 (its weight is `wte`'s storage: counted once with it);
/// - per block: `ln_1` 16, `attn.c_attn` 24·8 + 24 = 216, `attn.c_proj` 8·8 + 8 = 72
///   (`attn` 288), `ln_2` 16, `mlp.c_fc` 32·8 + 32 = 288, `mlp.c_proj` 8·32 + 8 = 264
///   (`mlp` 552); block 16 + 288 + 16 + 552 = 872;
/// - `transformer.h` 1744, `transformer` 128 + 32 + 1744 + 16 = 1920, root 1920.
pub fn small() -> GptConfig {
    GptConfig::new(2, 2, 8, 4, 16).unwrap()
}

pub fn plan(cfg: &GptConfig, options: &WrapOptions) -> Result<UnitPlan, FsdpError> {
    plan_units(&gpt_module_tree(cfg), options)
}

pub fn size(cfg: &GptConfig, min: usize) -> Result<UnitPlan, FsdpError> {
    plan(cfg, &WrapOptions::new(WrapPolicy::size(min)))
}

pub fn unit_names(plan: &UnitPlan) -> Vec<&str> {
    plan.units.iter().map(|u| u.name.as_str()).collect()
}

pub fn names(specs: &[ParamSpec]) -> Vec<&str> {
    specs.iter().map(|p| p.name.as_str()).collect()
}

/// Every parameter of the model exactly once across the units and the ignored list, each unit's
/// parameters (and the ignored ones) in `param_specs` order.
pub fn assert_covers_model(cfg: &GptConfig, plan: &UnitPlan) {
    plan.validate().unwrap();
    let order: HashMap<String, usize> = param_specs(cfg)
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p.name, i))
        .collect();
    let mut all: Vec<&ParamSpec> = plan
        .units
        .iter()
        .flat_map(|u| u.params.iter())
        .chain(plan.ignored.iter())
        .collect();
    for list in plan
        .units
        .iter()
        .map(|u| &u.params)
        .chain(std::iter::once(&plan.ignored))
    {
        let idx: Vec<usize> = list.iter().map(|p| order[&p.name]).collect();
        assert!(idx.windows(2).all(|w| w[0] < w[1]), "not in pre-order");
    }
    all.sort_by_key(|p| order[&p.name]);
    let all: Vec<ParamSpec> = all.into_iter().cloned().collect();
    assert_eq!(all, param_specs(cfg));
}

pub fn tie_error(err: FsdpError) -> (String, String, String, String) {
    let msg = err.to_string();
    match err {
        FsdpError::TiedParametersSplit {
            param,
            param_unit,
            tied_to,
            tied_to_unit,
        } => {
            assert!(msg.contains("`lm_head.weight`"), "{msg}");
            assert!(msg.contains("`transformer.wte.weight`"), "{msg}");
            assert!(
                msg.contains(&param_unit) && msg.contains(&tied_to_unit),
                "{msg}"
            );
            (param, param_unit, tied_to, tied_to_unit)
        }
        other => panic!("expected a tied-parameter error, got {other:?}"),
    }
}

/// The owner of module `path` under a "wrap exactly these modules" rule: the nearest ignored
/// ancestor (`Err`), else the nearest wrapped ancestor-or-self, else the root (`Ok("")`).
pub fn expected_owner(
    path: &str,
    wrapped: &[String],
    ignored: &[String],
) -> Result<String, String> {
    let mut ancestors = vec![String::new()];
    let mut acc = String::new();
    for part in path.split('.').filter(|s| !s.is_empty()) {
        acc = if acc.is_empty() {
            part.to_string()
        } else {
            format!("{acc}.{part}")
        };
        ancestors.push(acc.clone());
    }
    if let Some(ig) = ancestors.iter().find(|a| ignored.contains(a)) {
        return Err(ig.clone());
    }
    Ok(ancestors
        .iter()
        .rev()
        .find(|a| wrapped.contains(a))
        .cloned()
        .unwrap_or_default())
}
