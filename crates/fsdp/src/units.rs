//! FSDP units: which parameters each flat parameter holds.
//!
//! A [`UnitPlan`] is what a wrap policy produces and what the runtime consumes: the units in
//! forward order (the root unit first), each with the parameters it owns, plus the parameters of
//! ignored modules (kept unsharded and replicated).

use crate::model::{block_param_specs, embed_param_specs, head_param_specs, GptConfig, ParamSpec};
use crate::FsdpError;

/// One FSDP unit: a module subtree's parameters minus those of nested units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSpec {
    /// The module path of the unit (`""` for the root).
    pub name: String,
    /// The parameters it owns, in the model's `named_parameters()` order.
    pub params: Vec<ParamSpec>,
}

impl UnitSpec {
    /// Total number of elements.
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }
}

/// The units of a model, root first, and the parameters left unsharded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UnitPlan {
    /// The units, the root unit first, the others in forward (pre-order) order.
    pub units: Vec<UnitSpec>,
    /// Parameters of ignored modules: not sharded, replicated on every rank.
    pub ignored: Vec<ParamSpec>,
}

impl UnitPlan {
    /// The index of the unit that owns parameter `name`, if any unit does.
    pub fn unit_of(&self, name: &str) -> Option<usize> {
        self.units
            .iter()
            .position(|u| u.params.iter().any(|p| p.name == name))
    }

    /// Check that every parameter appears exactly once (in a unit or among the ignored).
    pub fn validate(&self) -> Result<(), FsdpError> {
        let mut seen = std::collections::HashSet::new();
        let all = self
            .units
            .iter()
            .flat_map(|u| u.params.iter())
            .chain(self.ignored.iter());
        for p in all {
            if !seen.insert(p.name.as_str()) {
                return Err(FsdpError::InvalidPlan {
                    reason: format!("parameter `{}` appears in more than one place", p.name),
                });
            }
        }
        Ok(())
    }
}

/// The plan of the module-type policy "every transformer block" for the reference GPT: the root
/// unit owns `wte` (tied with `lm_head`), `wpe` and `ln_f`; unit `transformer.h.{i}` owns block
/// `i`.
pub fn gpt_block_plan(cfg: &GptConfig) -> UnitPlan {
    let mut root = embed_param_specs(cfg);
    root.extend(head_param_specs(cfg));
    let mut units = vec![UnitSpec {
        name: String::new(),
        params: root,
    }];
    for layer in 0..cfg.n_layer {
        units.push(UnitSpec {
            name: format!("transformer.h.{layer}"),
            params: block_param_specs(cfg, layer),
        });
    }
    UnitPlan {
        units,
        ignored: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_plan_covers_every_parameter_once() {
        let cfg = GptConfig::new(3, 2, 16, 8, 50).unwrap();
        let plan = gpt_block_plan(&cfg);
        plan.validate().unwrap();
        assert_eq!(plan.units.len(), 4);
        let total: usize = plan.units.iter().map(UnitSpec::numel).sum();
        assert_eq!(total, cfg.num_params());
        assert_eq!(plan.unit_of("transformer.wte.weight"), Some(0));
        assert_eq!(plan.unit_of("transformer.h.2.mlp.c_fc.bias"), Some(3));
        assert_eq!(plan.unit_of("lm_head.weight"), None);
    }
}
