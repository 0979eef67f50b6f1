//! The model as a tree of modules, and the wrap policies that turn it into FSDP units.
//!
//! A [`Module`] is a named node (its full dotted path, as PyTorch's `named_modules()`) with a
//! type name, its own parameters and its children, built with [`Module::new`] and its builder
//! methods to mirror how a PyTorch model nests its modules.
//!
//! [`plan_units`] applies a [`WrapPolicy`] to a tree and returns the [`UnitPlan`] the runtime
//! consumes, following PyTorch's `_recursive_wrap`:
//!
//! - the traversal is **bottom-up**: a module's children are considered (and possibly wrapped)
//!   before the module itself;
//! - a module's **unwrapped numel** is the number of elements of the parameters of its subtree
//!   that no nested unit already took (tied parameters counted once, ignored modules left out);
//! - the **root** is always a unit: it owns whatever no nested unit took;
//! - each unit owns the parameters of its subtree minus those of nested units, in pre-order
//!   (PyTorch's `named_parameters()` order), and the units are listed root first, then in
//!   pre-order (forward order);
//! - parameters of **ignored modules** stay unsharded and replicated ([`UnitPlan::ignored`]);
//! - **tied parameters** (one storage under two names, like a language model's `lm_head.weight`
//!   and `transformer.wte.weight`): the storage belongs to its target's unit, and an alias may
//!   lie in that unit or in a unit nested in it — the lowest common ancestor of the users owns
//!   the shared storage, as PyTorch advises for shared parameters; the engine keeps that unit
//!   unsharded while the nested users run (their spans name the storage). A policy that puts
//!   alias and target in unrelated units (siblings, or the target nested below the alias) is an
//!   error ([`FsdpError::TiedParametersSplit`]) naming both parameters and both units.
//!
//! A unit that would own no parameter (a wrapped module whose parameters all went to nested
//! units, or a parameter-less module) is dropped from the plan: in PyTorch such an FSDP instance
//! has no flat parameter and does nothing.
//!
//! [`UnitPlan`]: crate::units::UnitPlan
//! [`UnitPlan::ignored`]: crate::units::UnitPlan::ignored
//! [`FsdpError::TiedParametersSplit`]: crate::FsdpError::TiedParametersSplit

mod planner;
mod policy;

use std::collections::HashSet;

use crate::units::ParamSpec;

pub use planner::plan_units;
pub use policy::{
    CustomWrapFn, WrapOptions, WrapPolicy, DEFAULT_MIN_NUM_PARAMS, SIZE_POLICY_EXCLUDED_TYPES,
    SIZE_POLICY_FORCE_LEAF_TYPES,
};

/// A parameter held directly by a [`Module`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModuleParam {
    /// The local name within its module, e.g. `weight`.
    pub name: String,
    /// The shape, row-major.
    pub shape: Vec<usize>,
    /// The full name of the parameter this one shares storage with, if it is a tied alias
    /// (a language model's `lm_head.weight` tied to `transformer.wte.weight`). The target must be a
    /// parameter of the same tree that is not itself an alias, with the same shape.
    pub tied_to: Option<String>,
}

impl ModuleParam {
    /// A parameter with its own storage.
    pub fn new(name: impl Into<String>, shape: Vec<usize>) -> Self {
        ModuleParam {
            name: name.into(),
            shape,
            tied_to: None,
        }
    }

    /// An alias of parameter `tied_to` (a full name).
    pub fn tied(name: impl Into<String>, shape: Vec<usize>, tied_to: impl Into<String>) -> Self {
        ModuleParam {
            name: name.into(),
            shape,
            tied_to: Some(tied_to.into()),
        }
    }

    /// Number of elements (saturating at `usize::MAX` for absurd shapes).
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .unwrap_or(usize::MAX)
    }
}

/// A node of the model tree: a module with its full path, type, own parameters and children.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Module {
    /// The full dotted path, as PyTorch's `named_modules()` (`""` for the root); a child's name
    /// is its parent's name, a dot (unless the parent is the root `""`) and a local name.
    pub name: String,
    /// The module's class name, e.g. `Block`, `Linear`, `ModuleList`.
    pub type_name: String,
    /// The parameters the module holds directly, in registration order.
    pub params: Vec<ModuleParam>,
    /// The child modules, in registration order.
    pub children: Vec<Module>,
}

impl Module {
    /// A module without parameters or children.
    pub fn new(name: impl Into<String>, type_name: impl Into<String>) -> Self {
        Module {
            name: name.into(),
            type_name: type_name.into(),
            params: Vec::new(),
            children: Vec::new(),
        }
    }

    /// Adds a parameter with its own storage (builder style).
    pub fn with_param(mut self, local: impl Into<String>, shape: Vec<usize>) -> Self {
        self.params.push(ModuleParam::new(local, shape));
        self
    }

    /// Adds a parameter tied to (sharing storage with) parameter `tied_to`, a full name.
    pub fn with_tied_param(
        mut self,
        local: impl Into<String>,
        shape: Vec<usize>,
        tied_to: impl Into<String>,
    ) -> Self {
        self.params.push(ModuleParam::tied(local, shape, tied_to));
        self
    }

    /// Adds a child module (builder style). Its name must be a full path: see
    /// [`Module::child_path`].
    pub fn with_child(mut self, child: Module) -> Self {
        self.children.push(child);
        self
    }

    /// The full path of a child with local name `local`: `"{name}.{local}"`, or `local` for the
    /// root.
    pub fn child_path(&self, local: &str) -> String {
        join(&self.name, local)
    }

    /// The full name of this module's parameter `local`, e.g. `transformer.wte.weight`.
    pub fn param_full_name(&self, local: &str) -> String {
        join(&self.name, local)
    }

    /// This module and all its descendants, in pre-order (PyTorch's `named_modules()` order).
    pub fn modules(&self) -> Vec<&Module> {
        let mut out = Vec::new();
        let mut stack = vec![self];
        while let Some(m) = stack.pop() {
            out.push(m);
            stack.extend(m.children.iter().rev());
        }
        out
    }

    /// The module of the subtree whose full path is `path`, if any.
    pub fn find(&self, path: &str) -> Option<&Module> {
        self.modules().into_iter().find(|m| m.name == path)
    }

    /// Every parameter of the subtree, tied aliases included, with its full name, in pre-order
    /// (each module's own parameters before its children's).
    pub fn all_params(&self) -> Vec<(String, &ModuleParam)> {
        self.modules()
            .into_iter()
            .flat_map(|m| {
                m.params
                    .iter()
                    .map(move |p| (m.param_full_name(&p.name), p))
            })
            .collect()
    }

    /// Full names of the subtree's parameters that own their storage (tied aliases left out), in
    /// pre-order.
    pub fn param_names(&self) -> Vec<String> {
        self.all_params()
            .into_iter()
            .filter(|(_, p)| p.tied_to.is_none())
            .map(|(n, _)| n)
            .collect()
    }

    /// The subtree's parameters as [`ParamSpec`]s, tied aliases left out, in pre-order
    /// (PyTorch's `named_parameters()`).
    pub fn named_parameters(&self) -> Vec<ParamSpec> {
        self.all_params()
            .into_iter()
            .filter(|(_, p)| p.tied_to.is_none())
            .map(|(name, p)| ParamSpec {
                name,
                shape: p.shape.clone(),
            })
            .collect()
    }

    /// Number of parameter elements of the subtree, each storage counted once (as PyTorch's
    /// `sum(p.numel() for p in module.parameters())`): an alias whose target is in the subtree
    /// adds nothing, an alias alone in the subtree counts in full. Saturates at `usize::MAX`.
    pub fn numel(&self) -> usize {
        let mut seen = HashSet::new();
        let mut total = 0usize;
        for (name, p) in self.all_params() {
            let key = p.tied_to.clone().unwrap_or(name);
            if seen.insert(key) {
                total = total.saturating_add(p.numel());
            }
        }
        total
    }
}

fn join(prefix: &str, local: &str) -> String {
    if prefix.is_empty() {
        local.to_string()
    } else {
        format!("{prefix}.{local}")
    }
}
