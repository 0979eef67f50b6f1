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
//! - **tied parameters** (one storage under two names, like a language model's `lm_head.weight` and
//!   `transformer.wte.weight`) must land in one unit: a policy that separates them is an error
//!   ([`FsdpError::TiedParametersSplit`]) naming both parameters and both units.
//!
//! A unit that would own no parameter (a wrapped module whose parameters all went to nested
//! units, or a parameter-less module) is dropped from the plan: in PyTorch such an FSDP instance
//! has no flat parameter and does nothing.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::units::ParamSpec;
use crate::units::{UnitPlan, UnitSpec};
use crate::FsdpError;

/// PyTorch's default `min_num_params` of `size_based_auto_wrap_policy`: 10⁸.
pub const DEFAULT_MIN_NUM_PARAMS: usize = 100_000_000;

/// Module types the size policy never wraps (PyTorch's `EXCLUDE_WRAP_MODULES`): containers.
pub const SIZE_POLICY_EXCLUDED_TYPES: [&str; 2] = ["ModuleList", "ModuleDict"];

/// Module types the size policy never recurses into (PyTorch's `FORCE_LEAF_MODULES`): neither
/// they nor anything inside them becomes a unit; their parameters go to an enclosing unit.
pub const SIZE_POLICY_FORCE_LEAF_TYPES: [&str; 1] = ["MultiheadAttention"];

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
    fn should_recurse(&self, module: &Module, subtree_numel: usize) -> bool {
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
    fn should_wrap(&self, module: &Module, unwrapped_numel: usize) -> bool {
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
#[derive(Debug, Clone, Default)]
pub struct WrapOptions {
    /// The auto-wrap policy; `None` gives one root unit holding every non-ignored parameter.
    pub policy: Option<WrapPolicy>,
    /// Full paths of modules whose subtrees are ignored: their parameters are neither sharded
    /// nor counted by the policy, and stay replicated on every rank ([`UnitPlan::ignored`]).
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

/// A module of the tree, flattened in pre-order.
struct Node<'a> {
    module: &'a Module,
    children: Vec<usize>,
    /// The outermost ignored module containing this one (itself included), if any.
    ignored_by: Option<usize>,
}

/// A parameter occurrence (alias or not), in pre-order.
struct ParamInfo {
    full: String,
    shape: Vec<usize>,
    node: usize,
    /// Index (into the occurrences) of the storage: itself, or the target of a tied alias.
    storage: usize,
    /// Whether it is a tied alias.
    is_alias: bool,
}

struct Planner<'a> {
    nodes: Vec<Node<'a>>,
    params: Vec<ParamInfo>,
    /// Elements of each occurrence's storage, indexed like `params`.
    numel: Vec<usize>,
    /// Storages counted by the policy below each node (ignored ones left out).
    subtree: Vec<BTreeSet<usize>>,
    is_unit: Vec<bool>,
}

fn invalid_tree(reason: String) -> FsdpError {
    FsdpError::InvalidModuleTree { reason }
}

impl<'a> Planner<'a> {
    fn new(root: &'a Module, ignored_modules: &[String]) -> Result<Self, FsdpError> {
        // Flatten the tree in pre-order and check the names.
        let mut nodes: Vec<Node<'a>> = Vec::new();
        let mut stack: Vec<(&'a Module, Option<usize>)> = vec![(root, None)];
        let mut module_names = HashMap::new();
        while let Some((m, parent)) = stack.pop() {
            let idx = nodes.len();
            if let Some(p) = parent {
                let pname = &nodes[p].module.name;
                let local = if pname.is_empty() {
                    Some(m.name.as_str())
                } else {
                    m.name
                        .strip_prefix(pname.as_str())
                        .and_then(|s| s.strip_prefix('.'))
                };
                if !matches!(local, Some(l) if !l.is_empty() && !l.contains('.')) {
                    return Err(invalid_tree(format!(
                        "module `{}` is a child of `{pname}` but its name is not its parent's \
                         path followed by one local name",
                        m.name
                    )));
                }
                nodes[p].children.push(idx);
            }
            if module_names.insert(m.name.as_str(), idx).is_some() {
                return Err(invalid_tree(format!("two modules are named `{}`", m.name)));
            }
            nodes.push(Node {
                module: m,
                children: Vec::new(),
                ignored_by: None,
            });
            stack.extend(m.children.iter().rev().map(|c| (c, Some(idx))));
        }
        // Children were pushed in pre-order, so `nodes[p].children` is in registration order.

        // Ignored modules: each path must exist; mark subtrees (outermost ignored ancestor).
        let mut ignored = vec![false; nodes.len()];
        for path in ignored_modules {
            match module_names.get(path.as_str()) {
                Some(&i) => ignored[i] = true,
                None => return Err(FsdpError::UnknownModule { path: path.clone() }),
            }
        }
        for i in 0..nodes.len() {
            if ignored[i] && nodes[i].ignored_by.is_none() {
                let mut stack = vec![i];
                while let Some(j) = stack.pop() {
                    nodes[j].ignored_by = Some(i);
                    stack.extend(nodes[j].children.iter().copied());
                }
            }
        }

        // Parameter occurrences in pre-order; resolve ties.
        let mut params = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut tied: Vec<(usize, &'a str)> = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            for p in &node.module.params {
                let full = node.module.param_full_name(&p.name);
                let idx = params.len();
                if by_name.insert(full.clone(), idx).is_some() {
                    return Err(invalid_tree(format!("two parameters are named `{full}`")));
                }
                if let Some(t) = &p.tied_to {
                    tied.push((idx, t.as_str()));
                }
                params.push(ParamInfo {
                    full,
                    shape: p.shape.clone(),
                    node: i,
                    storage: idx,
                    is_alias: p.tied_to.is_some(),
                });
            }
        }
        for (idx, target) in tied {
            let param = &params[idx];
            let Some(&t) = by_name.get(target) else {
                return Err(FsdpError::UnknownTiedParameter {
                    param: param.full.clone(),
                    tied_to: target.to_string(),
                });
            };
            let tp = &params[t];
            if tp.is_alias {
                return Err(invalid_tree(format!(
                    "parameter `{}` is tied to `{target}`, which is itself a tied alias; tie it \
                     to the parameter that owns the storage",
                    param.full
                )));
            }
            if tp.shape != param.shape {
                return Err(invalid_tree(format!(
                    "parameter `{}` {:?} is tied to `{target}` of another shape {:?}",
                    param.full, param.shape, tp.shape
                )));
            }
            params[idx].storage = t;
        }

        // Element counts; the total must fit in usize so that every partial sum does.
        let mut numel = Vec::with_capacity(params.len());
        let mut total = 0usize;
        for p in &params {
            let n = p
                .shape
                .iter()
                .try_fold(1usize, |a, &b| a.checked_mul(b))
                .ok_or_else(|| {
                    invalid_tree(format!("parameter `{}`'s element count overflows", p.full))
                })?;
            if !p.is_alias {
                total = total.checked_add(n).ok_or_else(|| {
                    invalid_tree("the number of parameter elements overflows usize".to_string())
                })?;
            }
            numel.push(n);
        }

        // Storage ids below each node, ignored ones left out (PyTorch: `p not in ignored_params`,
        // by identity: a storage is ignored if any of its names is in an ignored module).
        let ignored_storage: HashSet<usize> = params
            .iter()
            .filter(|p| nodes[p.node].ignored_by.is_some())
            .map(|p| p.storage)
            .collect();
        let mut subtree: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); nodes.len()];
        for p in &params {
            if !ignored_storage.contains(&p.storage) {
                subtree[p.node].insert(p.storage);
            }
        }
        for i in (0..nodes.len()).rev() {
            for &c in &nodes[i].children {
                if nodes[c].ignored_by.is_none() {
                    let child = subtree[c].clone();
                    subtree[i].extend(child);
                }
            }
        }

        let n = nodes.len();
        Ok(Planner {
            nodes,
            params,
            numel,
            subtree,
            is_unit: vec![false; n],
        })
    }

    fn count(&self, ids: impl IntoIterator<Item = usize>) -> usize {
        ids.into_iter().map(|id| self.numel[id]).sum()
    }

    /// PyTorch's `_recursive_wrap`: returns the storages inside units at or below `node`.
    fn recursive_wrap(
        &mut self,
        policy: &WrapPolicy,
        node: usize,
        only_wrap_children: bool,
    ) -> BTreeSet<usize> {
        let module = self.nodes[node].module;
        let subtree_numel = self.count(self.subtree[node].iter().copied());
        if !policy.should_recurse(module, subtree_numel) {
            return BTreeSet::new();
        }
        let mut wrapped = BTreeSet::new();
        let children = self.nodes[node].children.clone();
        for c in children {
            if self.nodes[c].ignored_by.is_some() {
                continue;
            }
            wrapped.extend(self.recursive_wrap(policy, c, false));
        }
        let remainder = self.count(self.subtree[node].difference(&wrapped).copied());
        if !only_wrap_children && policy.should_wrap(module, remainder) {
            self.is_unit[node] = true;
            return self.subtree[node].clone();
        }
        wrapped
    }

    fn plan(mut self, policy: Option<&WrapPolicy>) -> Result<UnitPlan, FsdpError> {
        self.is_unit[0] = true;
        if let Some(policy) = policy {
            if self.nodes[0].ignored_by.is_none() {
                self.recursive_wrap(policy, 0, true);
            }
        }

        // Owner of every node: an ignored module, or the nearest unit (pre-order index of units).
        #[derive(Clone, Copy, PartialEq, Eq)]
        enum Owner {
            Unit(usize),
            Ignored(usize),
        }
        // The root unit exists even when the whole model is ignored.
        let mut unit_nodes: Vec<usize> = vec![0];
        let mut owner = vec![Owner::Unit(0); self.nodes.len()];
        let mut parent_owner: Vec<Option<Owner>> = vec![None; self.nodes.len()];
        for i in 0..self.nodes.len() {
            owner[i] = if let Some(ig) = self.nodes[i].ignored_by {
                Owner::Ignored(ig)
            } else if i == 0 {
                Owner::Unit(0)
            } else if self.is_unit[i] {
                unit_nodes.push(i);
                Owner::Unit(unit_nodes.len() - 1)
            } else {
                parent_owner[i].unwrap_or(Owner::Unit(0))
            };
            for &c in &self.nodes[i].children {
                parent_owner[c] = Some(owner[i]);
            }
        }

        let label = |o: Owner| match o {
            Owner::Unit(0) => "the root unit".to_string(),
            Owner::Unit(k) => format!("unit `{}`", self.nodes[unit_nodes[k]].module.name),
            Owner::Ignored(n) => format!("ignored module `{}`", self.nodes[n].module.name),
        };
        let ignored = |o: Owner| matches!(o, Owner::Ignored(_));

        // Tied parameters must share one owner (any ignored module counts as one: replicated).
        for (idx, p) in self.params.iter().enumerate() {
            if p.storage == idx {
                continue;
            }
            let target = &self.params[p.storage];
            let (a, b) = (owner[p.node], owner[target.node]);
            let same = a == b || (ignored(a) && ignored(b));
            if !same {
                return Err(FsdpError::TiedParametersSplit {
                    param: p.full.clone(),
                    param_unit: label(a),
                    tied_to: target.full.clone(),
                    tied_to_unit: label(b),
                });
            }
        }

        let mut units: Vec<UnitSpec> = unit_nodes
            .iter()
            .map(|&n| UnitSpec {
                name: self.nodes[n].module.name.clone(),
                params: Vec::new(),
            })
            .collect();
        let mut ignored_params = Vec::new();
        for (idx, p) in self.params.iter().enumerate() {
            if p.storage != idx {
                continue;
            }
            let spec = ParamSpec {
                name: p.full.clone(),
                shape: p.shape.clone(),
            };
            match owner[p.node] {
                Owner::Unit(k) => units[k].params.push(spec),
                Owner::Ignored(_) => ignored_params.push(spec),
            }
        }
        let mut k = 0;
        units.retain(|u| {
            k += 1;
            k == 1 || !u.params.is_empty()
        });
        Ok(UnitPlan {
            units,
            ignored: ignored_params,
        })
    }
}

/// Decides the FSDP units of `model` with `options` (PyTorch's auto-wrapping at FSDP
/// construction).
///
/// The root is always a unit and owns every parameter that no nested unit took; each unit owns
/// the parameters of its subtree minus those of nested units, in pre-order (PyTorch's
/// `named_parameters()` order); the units are listed root first, then in pre-order. Tied aliases
/// are not listed (the unit holding the target holds the storage). Units that would own no
/// parameter are dropped, except the root. Parameters of ignored modules go to
/// [`UnitPlan::ignored`], in pre-order.
///
/// # Errors
/// - [`FsdpError::TiedParametersSplit`] when a tied alias and its target would land in different
///   units, or one in an ignored module and the other not;
/// - [`FsdpError::UnknownModule`] for an ignored module path that is not in the tree;
/// - [`FsdpError::UnknownTiedParameter`] for a tie to a parameter the tree does not have;
/// - [`FsdpError::InvalidModuleTree`] for a malformed tree: a child's name that is not its
///   parent's path plus a local name, duplicate module or parameter names, a tie to an alias or
///   to a parameter of another shape, or an element count that overflows.
///
/// # Example
///
/// A model with two blocks and a head tied to the embedding: a module-type policy makes each block a unit, and
/// the root keeps the embedding and the head tied to it.
///
/// ```
/// use fsdp::wrap::{plan_units, Module, WrapOptions, WrapPolicy};
///
/// # fn main() -> Result<(), fsdp::FsdpError> {
/// let block = |name: &str| Module::new(name, "Block").with_param("weight", vec![8, 8]);
/// let tree = Module::new("", "Net")
///     .with_child(Module::new("embed", "Embedding").with_param("weight", vec![10, 4]))
///     .with_child(block("b0"))
///     .with_child(block("b1"))
///     .with_child(Module::new("head", "Linear").with_tied_param("weight", vec![10, 4], "embed.weight"));
///
/// let plan = plan_units(&tree, &WrapOptions::new(WrapPolicy::module_type(["Block"])))?;
/// let names: Vec<&str> = plan.units.iter().map(|u| u.name.as_str()).collect();
/// assert_eq!(names, ["", "b0", "b1"]);
/// assert_eq!(plan.unit_of("embed.weight"), Some(0));
///
/// // 64 elements per block, 40 in the embedding: the size policy with a threshold of 64 gives
/// // the same units.
/// assert_eq!(plan_units(&tree, &WrapOptions::new(WrapPolicy::size(64)))?, plan);
///
/// // Wrapping `head` alone would split it from the embedding it is tied to.
/// let err = plan_units(&tree, &WrapOptions::new(WrapPolicy::custom(|m, _| m.name == "head")))
///     .unwrap_err();
/// assert!(err.to_string().contains("head.weight"));
/// # Ok(())
/// # }
/// ```
pub fn plan_units(model: &Module, options: &WrapOptions) -> Result<UnitPlan, FsdpError> {
    Planner::new(model, &options.ignored_modules)?.plan(options.policy.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_trees_are_errors() {
        let bad_child = Module::new("", "M").with_child(Module::new("a.b", "L"));
        assert!(matches!(
            plan_units(&bad_child, &WrapOptions::default()),
            Err(FsdpError::InvalidModuleTree { .. })
        ));
        let dup = Module::new("", "M")
            .with_child(Module::new("a", "L").with_param("w", vec![2]))
            .with_child(Module::new("a", "L"));
        assert!(matches!(
            plan_units(&dup, &WrapOptions::default()),
            Err(FsdpError::InvalidModuleTree { .. })
        ));
        let chain = Module::new("", "M")
            .with_param("w", vec![2])
            .with_tied_param("x", vec![2], "w")
            .with_tied_param("y", vec![2], "x");
        let err = plan_units(&chain, &WrapOptions::default()).unwrap_err();
        assert!(err.to_string().contains("itself a tied alias"), "{err}");
        let shape = Module::new("", "M")
            .with_param("w", vec![2])
            .with_tied_param("x", vec![3], "w");
        assert!(matches!(
            plan_units(&shape, &WrapOptions::default()),
            Err(FsdpError::InvalidModuleTree { .. })
        ));
        let huge = Module::new("", "M").with_param("w", vec![usize::MAX, 2]);
        assert!(matches!(
            plan_units(&huge, &WrapOptions::default()),
            Err(FsdpError::InvalidModuleTree { .. })
        ));
        let sum = Module::new("", "M")
            .with_param("w", vec![usize::MAX])
            .with_param("v", vec![1]);
        assert!(matches!(
            plan_units(&sum, &WrapOptions::default()),
            Err(FsdpError::InvalidModuleTree { .. })
        ));
    }

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
