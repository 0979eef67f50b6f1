//! The planner behind [`plan_units`]: PyTorch's `_recursive_wrap` over a flattened module tree.

use std::collections::{BTreeSet, HashMap, HashSet};

use super::{Module, WrapOptions, WrapPolicy};
use crate::units::ParamSpec;
use crate::units::{UnitPlan, UnitSpec};
use crate::FsdpError;

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
        // The unit enclosing each unit (the root encloses itself).
        let mut unit_parent: Vec<usize> = vec![0];
        let mut owner = vec![Owner::Unit(0); self.nodes.len()];
        let mut parent_owner: Vec<Option<Owner>> = vec![None; self.nodes.len()];
        for i in 0..self.nodes.len() {
            owner[i] = if let Some(ig) = self.nodes[i].ignored_by {
                Owner::Ignored(ig)
            } else if i == 0 {
                Owner::Unit(0)
            } else if self.is_unit[i] {
                unit_nodes.push(i);
                // A unit inside an ignored module cannot exist (ignored subtrees are not
                // entered); its enclosing unit is the nearest unit above it.
                unit_parent.push(match parent_owner[i] {
                    Some(Owner::Unit(k)) => k,
                    _ => 0,
                });
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

        // Whether unit `outer` encloses unit `inner` (or is it).
        let encloses = |outer: usize, mut inner: usize| loop {
            if inner == outer {
                return true;
            }
            if inner == 0 {
                return false;
            }
            inner = unit_parent[inner];
        };
        // A tied alias must lie in its target's unit or in a unit nested in it: the storage
        // then belongs to the lowest common ancestor of its users, which stays unsharded while
        // they run (PyTorch's advice for shared parameters). Any ignored module counts as one
        // owner (replicated).
        for (idx, p) in self.params.iter().enumerate() {
            if p.storage == idx {
                continue;
            }
            let target = &self.params[p.storage];
            let (a, b) = (owner[p.node], owner[target.node]);
            let ok = match (a, b) {
                (Owner::Unit(alias), Owner::Unit(storage)) => encloses(storage, alias),
                _ => a == b || (ignored(a) && ignored(b)),
            };
            if !ok {
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
/// - [`FsdpError::TiedParametersSplit`] when a tied alias would land in a unit that is neither
///   its target's unit nor nested in it, or one of them in an ignored module and the other not;
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
/// // Wrapping `head` alone is fine: the shared storage stays with the embedding in the root,
/// // the lowest common ancestor of its users (and `head`, which owns nothing else, is dropped).
/// let head = plan_units(&tree, &WrapOptions::new(WrapPolicy::custom(|m, _| m.name == "head")))?;
/// assert_eq!(head.units.len(), 1);
///
/// // Wrapping `embed` alone would put the storage below its other user, `head`, in the root.
/// let err = plan_units(&tree, &WrapOptions::new(WrapPolicy::custom(|m, _| m.name == "embed")))
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
}
