//! The wrap policies ([`WrapPolicy`]) and options ([`WrapOptions`]) of [`plan_units`].
//!
//! [`plan_units`]: super::plan_units

use std::fmt;
use std::sync::Arc;

use super::Module;

/// PyTorch's default `min_num_params` of `size_based_auto_wrap_policy`: 10⁸.
pub const DEFAULT_MIN_NUM_PARAMS: usize = 100_000_000;

/// Module types the size policy never wraps (PyTorch's `EXCLUDE_WRAP_MODULES`): containers.
pub const SIZE_POLICY_EXCLUDED_TYPES: [&str; 2] = ["ModuleList", "ModuleDict"];

/// Module types the size policy never recurses into (PyTorch's `FORCE_LEAF_MODULES`): neither
/// they nor anything inside them becomes a unit; their parameters go to an enclosing unit.
pub const SIZE_POLICY_FORCE_LEAF_TYPES: [&str; 1] = ["MultiheadAttention"];

/// The signature of a custom wrap policy: called with a (non-root, non-ignored) module and its
/// unwrapped numel; `true` makes the module a unit.
pub type CustomWrapFn = dyn Fn(&Module, usize) -> bool + Send + Sync;

/// How the modules that become FSDP units are chosen (PyTorch's `auto_wrap_policy`). The root
/// is always a unit whatever the policy; "no policy" (`WrapOptions::policy == None`) gives the
/// root unit alone.
#[derive(Clone)]
pub enum WrapPolicy {
    /// Wrap every module whose [`Module::type_name`] is in the set (PyTorch's
    /// `ModuleWrapPolicy` / `transformer_auto_wrap_policy`), e.g. `["Block"]` for one unit per
    /// transformer block.
    ModuleType(Vec<String>),
    /// PyTorch's `size_based_auto_wrap_policy`: recurse into a module only if its subtree holds
    /// at least `min_num_params` elements and its type is not in
    /// [`SIZE_POLICY_FORCE_LEAF_TYPES`]; after its children, wrap a non-root module if its
    /// unwrapped numel reaches `min_num_params` and its type is not in
    /// [`SIZE_POLICY_EXCLUDED_TYPES`].
    Size {
        /// Threshold of unwrapped elements for a new unit (PyTorch's default is
        /// [`DEFAULT_MIN_NUM_PARAMS`]).
        min_num_params: usize,
    },
    /// A user closure, called bottom-up (every child before its parent, siblings in order) for
    /// each non-root, non-ignored module with its unwrapped numel; `true` wraps the module.
    Custom(Arc<CustomWrapFn>),
}

impl WrapPolicy {
    /// [`WrapPolicy::ModuleType`] from any list of type names.
    pub fn module_type<I, S>(types: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        WrapPolicy::ModuleType(types.into_iter().map(Into::into).collect())
    }

    /// [`WrapPolicy::Size`] with threshold `min_num_params`.
    pub fn size(min_num_params: usize) -> Self {
        WrapPolicy::Size { min_num_params }
    }

    /// [`WrapPolicy::Custom`] from a closure.
    pub fn custom(f: impl Fn(&Module, usize) -> bool + Send + Sync + 'static) -> Self {
        WrapPolicy::Custom(Arc::new(f))
    }

    /// PyTorch's `auto_wrap_policy(module, recurse=True, nonwrapped_numel)`: whether to look for
    /// units inside `module`, whose subtree holds `subtree_numel` (non-ignored) elements.
    pub(super) fn should_recurse(&self, module: &Module, subtree_numel: usize) -> bool {
        match self {
            WrapPolicy::ModuleType(_) | WrapPolicy::Custom(_) => true,
            WrapPolicy::Size { min_num_params } => {
                subtree_numel >= *min_num_params
                    && !SIZE_POLICY_FORCE_LEAF_TYPES.contains(&module.type_name.as_str())
            }
        }
    }

    /// PyTorch's `auto_wrap_policy(module, recurse=False, nonwrapped_numel=remainder)`: whether
    /// `module` becomes a unit once its children are done.
    pub(super) fn should_wrap(&self, module: &Module, unwrapped_numel: usize) -> bool {
        match self {
            WrapPolicy::ModuleType(types) => types.contains(&module.type_name),
            WrapPolicy::Size { min_num_params } => {
                unwrapped_numel >= *min_num_params
                    && !SIZE_POLICY_EXCLUDED_TYPES.contains(&module.type_name.as_str())
            }
            WrapPolicy::Custom(f) => f(module, unwrapped_numel),
        }
    }
}

impl fmt::Debug for WrapPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WrapPolicy::ModuleType(types) => f.debug_tuple("ModuleType").field(types).finish(),
            WrapPolicy::Size { min_num_params } => f
                .debug_struct("Size")
                .field("min_num_params", min_num_params)
                .finish(),
            WrapPolicy::Custom(_) => f.write_str("Custom(<closure>)"),
        }
    }
}

/// The wrapping options of [`plan_units`].
///
/// [`plan_units`]: super::plan_units
#[derive(Debug, Clone, Default)]
pub struct WrapOptions {
    /// The auto-wrap policy; `None` gives one root unit holding every non-ignored parameter.
    pub policy: Option<WrapPolicy>,
    /// Full paths of modules whose subtrees are ignored: their parameters are neither sharded
    /// nor counted by the policy, and stay replicated on every rank ([`UnitPlan::ignored`]).
    ///
    /// [`UnitPlan::ignored`]: crate::units::UnitPlan::ignored
    pub ignored_modules: Vec<String>,
}

impl WrapOptions {
    /// Options with `policy` and no ignored module.
    pub fn new(policy: WrapPolicy) -> Self {
        WrapOptions {
            policy: Some(policy),
            ignored_modules: Vec::new(),
        }
    }

    /// Adds an ignored module path (builder style).
    pub fn with_ignored_module(mut self, path: impl Into<String>) -> Self {
        self.ignored_modules.push(path.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wrap::plan_units;

    #[test]
    fn force_leaf_modules_are_neither_wrapped_nor_entered() {
        let tree = Module::new("", "Net")
            .with_child(
                Module::new("mha", "MultiheadAttention")
                    .with_param("in_proj_weight", vec![30])
                    .with_child(
                        Module::new("mha.out_proj", "Linear").with_param("weight", vec![30]),
                    ),
            )
            .with_child(Module::new("fc", "Linear").with_param("weight", vec![30]));
        let plan = plan_units(&tree, &WrapOptions::new(WrapPolicy::size(30))).unwrap();
        let names: Vec<_> = plan.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["", "fc"]);
        assert_eq!(plan.units[0].numel(), 60);
    }

    #[test]
    fn debug_of_policies() {
        assert_eq!(
            format!("{:?}", WrapPolicy::size(5)),
            "Size { min_num_params: 5 }"
        );
        assert_eq!(
            format!("{:?}", WrapPolicy::custom(|_, _| true)),
            "Custom(<closure>)"
        );
        assert_eq!(
            format!("{:?}", WrapPolicy::module_type(["Block"])),
            "ModuleType([\"Block\"])"
        );
    }
}
