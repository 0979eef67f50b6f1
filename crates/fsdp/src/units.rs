//! FSDP units: which parameters each flat parameter holds.
//!
//! A [`UnitPlan`] is what a wrap policy produces and what the engine consumes: the units in
//! forward order (the root unit first), each with the parameters it owns, plus the parameters of
//! ignored modules (kept unsharded and replicated).

use crate::FsdpError;

/// One parameter of a model: its name (PyTorch's `named_parameters()` name) and shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// The full name, e.g. `transformer.h.0.attn.c_attn.weight`.
    pub name: String,
    /// The shape, row-major (`[out, in]` for a Linear weight, as PyTorch).
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// A parameter named `name` of shape `shape`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>) -> Self {
        ParamSpec {
            name: name.into(),
            shape,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

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
