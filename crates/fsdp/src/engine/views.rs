//! How a model reads its parameters and writes its gradients: by name through the [`Params`] and
//! [`Grads`] traits, or by a [`ParamId`] resolved once with [`Fsdp::param_id`](super::Fsdp::param_id).
//!
//! While units are unsharded, [`ParamViews`] and [`GradViews`] hold the access guards of their
//! flat buffers and slice each parameter out of them: no copy, and no name lookup for accesses
//! through a [`ParamId`].

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::ops::Range;

use fsdp_device::{ReadGuard, WriteGuard};

use super::mixed_precision::MixedPrecisionPolicy;
use crate::FsdpError;

/// Read access to parameters by name. Implement it over views of flat buffers to run a model on
/// them without copies; the engine's [`ParamViews`] and a `HashMap<String, Vec<f32>>` implement
/// it.
pub trait Params {
    /// The values of parameter `name`, row-major.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when it is not held here.
    fn param(&self, name: &str) -> Result<&[f32], FsdpError>;

    /// The mixed-precision policy of the parameters these views show, for a model that casts
    /// its inputs and outputs ([`MixedPrecisionPolicy::cast_forward_input`],
    /// [`MixedPrecisionPolicy::cast_output`]); `None` (the default) outside the engine.
    fn mixed_precision(&self) -> Option<MixedPrecisionPolicy> {
        None
    }
}

/// Write access to gradients by name. Backward code **adds** into these slices (PyTorch
/// semantics): the owner zeroes them before a fresh accumulation.
pub trait Grads {
    /// The gradient of parameter `name`, row-major.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when it is not held here.
    fn grad_mut(&mut self, name: &str) -> Result<&mut [f32], FsdpError>;
}

impl<K, V, S> Params for HashMap<K, V, S>
where
    K: Borrow<str> + Hash + Eq,
    V: AsRef<[f32]>,
    S: BuildHasher,
{
    fn param(&self, name: &str) -> Result<&[f32], FsdpError> {
        self.get(name)
            .map(AsRef::as_ref)
            .ok_or_else(|| FsdpError::UnknownParameter { name: name.into() })
    }
}

impl<K, V, S> Grads for HashMap<K, V, S>
where
    K: Borrow<str> + Hash + Eq,
    V: AsMut<[f32]>,
    S: BuildHasher,
{
    fn grad_mut(&mut self, name: &str) -> Result<&mut [f32], FsdpError> {
        self.get_mut(name)
            .map(AsMut::as_mut)
            .ok_or_else(|| FsdpError::UnknownParameter { name: name.into() })
    }
}

/// A parameter of the engine, resolved once (an index into its parameter table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub(crate) usize);

/// Where a parameter lives: its unit (param group) and its element range in the unit's
/// unsharded flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParamEntry {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) group: usize,
    pub(crate) range: Range<usize>,
}

/// The engine's parameter table: every parameter once, in unit order, and a name index.
#[derive(Debug, Clone, Default)]
pub(crate) struct ParamTable {
    pub(crate) entries: Vec<ParamEntry>,
    pub(crate) by_name: HashMap<String, ParamId>,
}

impl ParamTable {
    pub(crate) fn push(&mut self, e: ParamEntry) {
        self.by_name
            .insert(e.name.clone(), ParamId(self.entries.len()));
        self.entries.push(e);
    }

    pub(crate) fn entry(&self, id: ParamId) -> Result<&ParamEntry, FsdpError> {
        self.entries
            .get(id.0)
            .ok_or_else(|| FsdpError::UnknownParameter {
                name: format!("#{}", id.0),
            })
    }

    pub(crate) fn id(&self, name: &str) -> Result<ParamId, FsdpError> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| FsdpError::UnknownParameter { name: name.into() })
    }
}

/// Read views of the unsharded parameters of some units (see [`Fsdp::param_views`](super::Fsdp::param_views)).
pub struct ParamViews<'a> {
    table: &'a ParamTable,
    /// Indexed by group; `Some` for the groups these views cover.
    guards: Vec<Option<ReadGuard<f32>>>,
    policy: Option<MixedPrecisionPolicy>,
}

impl<'a> ParamViews<'a> {
    pub(crate) fn new(
        table: &'a ParamTable,
        guards: Vec<Option<ReadGuard<f32>>>,
        policy: Option<MixedPrecisionPolicy>,
    ) -> Self {
        ParamViews {
            table,
            guards,
            policy,
        }
    }

    /// The values of parameter `id`.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when its unit is not among these views' units.
    pub fn get(&self, id: ParamId) -> Result<&[f32], FsdpError> {
        let e = self.table.entry(id)?;
        match self.guards.get(e.group) {
            Some(Some(g)) => Ok(&g[e.range.clone()]),
            _ => Err(FsdpError::UnknownParameter {
                name: format!("{} (its unit {} is not unsharded here)", e.name, e.group),
            }),
        }
    }
}

impl Params for ParamViews<'_> {
    fn param(&self, name: &str) -> Result<&[f32], FsdpError> {
        self.get(self.table.id(name)?)
    }

    /// The policy of the first unit the views cover.
    fn mixed_precision(&self) -> Option<MixedPrecisionPolicy> {
        self.policy
    }
}

/// Write views of the unsharded gradients of some units (see [`Fsdp::grad_views`](super::Fsdp::grad_views)).
pub struct GradViews<'a> {
    table: &'a ParamTable,
    guards: Vec<Option<WriteGuard<f32>>>,
}

impl<'a> GradViews<'a> {
    pub(crate) fn new(table: &'a ParamTable, guards: Vec<Option<WriteGuard<f32>>>) -> Self {
        GradViews { table, guards }
    }

    /// The gradient of parameter `id`.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when its unit is not among these views' units.
    pub fn get_mut(&mut self, id: ParamId) -> Result<&mut [f32], FsdpError> {
        let e = self.table.entry(id)?;
        match self.guards.get_mut(e.group) {
            Some(Some(g)) => Ok(&mut g[e.range.clone()]),
            _ => Err(FsdpError::UnknownParameter {
                name: format!("{} (its unit {} has no gradient here)", e.name, e.group),
            }),
        }
    }
}

impl Grads for GradViews<'_> {
    fn grad_mut(&mut self, name: &str) -> Result<&mut [f32], FsdpError> {
        let id = self.table.id(name)?;
        self.get_mut(id)
    }
}
