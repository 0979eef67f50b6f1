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

use fsdp_device::{Buffer, ReadGuard, Stream, WriteGuard};

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

    /// Parameter `name` as a buffer of the memory it lives in: a view of the unsharded flat
    /// buffer, no copy. On a [`ComputeDevice`](super::ComputeDevice) this is how a model reads
    /// its parameters — device memory in `param_dtype`, used through
    /// [`Buffer::use_on`](fsdp_device::Buffer::use_on) on the
    /// [`compute_stream`](Self::compute_stream) — and [`param`](Self::param) refuses; on the
    /// host it views the same `f32` values as `param` (ordered by access tickets).
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when it is not held here; by default (views without
    /// buffers), that too.
    fn buffer(&self, name: &str) -> Result<Buffer, FsdpError> {
        Err(FsdpError::UnknownParameter {
            name: format!("{name} (these views have no buffers)"),
        })
    }

    /// The stream a model issues its work on when its parameters live on a
    /// [`ComputeDevice`](super::ComputeDevice); `None` (the default) on the host, where it
    /// computes on the calling thread.
    fn compute_stream(&self) -> Option<&Stream> {
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

    /// The `f32` gradient of parameter `name` as a buffer of the memory it lives in (a view of
    /// the unsharded gradient, no copy): on a [`ComputeDevice`](super::ComputeDevice), the
    /// device memory a model **adds** its gradient into with work on the compute stream
    /// ([`grad_mut`](Self::grad_mut) refuses there).
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when it is not held here; by default (views without
    /// buffers), that too.
    fn grad_buffer(&mut self, name: &str) -> Result<Buffer, FsdpError> {
        Err(FsdpError::UnknownParameter {
            name: format!("{name} (these views have no buffers)"),
        })
    }
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
    /// Indexed by group; `Some` for the groups these views cover (host memory only).
    guards: Vec<Option<ReadGuard<f32>>>,
    /// Indexed by group: the unsharded buffers of the groups these views cover.
    buffers: Vec<Option<Buffer>>,
    policy: Option<MixedPrecisionPolicy>,
    /// The device's compute stream, when the buffers are on a device.
    stream: Option<Stream>,
}

impl<'a> ParamViews<'a> {
    pub(crate) fn new(
        table: &'a ParamTable,
        guards: Vec<Option<ReadGuard<f32>>>,
        buffers: Vec<Option<Buffer>>,
        policy: Option<MixedPrecisionPolicy>,
        stream: Option<Stream>,
    ) -> Self {
        ParamViews {
            table,
            guards,
            buffers,
            policy,
            stream,
        }
    }

    /// The values of parameter `id`.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when its unit is not among these views' units or lives
    /// on a device (read it with [`buffer_of`](Self::buffer_of)).
    pub fn get(&self, id: ParamId) -> Result<&[f32], FsdpError> {
        let e = self.table.entry(id)?;
        match (self.guards.get(e.group), self.buffers.get(e.group)) {
            (Some(Some(g)), _) => Ok(&g[e.range.clone()]),
            (_, Some(Some(b))) => Err(FsdpError::UnknownParameter {
                name: format!(
                    "{} (its unit {} lives on {}: read it as a buffer, Params::buffer)",
                    e.name,
                    e.group,
                    b.device()
                ),
            }),
            _ => Err(not_unsharded(e)),
        }
    }

    /// Parameter `id` as a view of its unit's unsharded buffer.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when its unit is not among these views' units.
    pub fn buffer_of(&self, id: ParamId) -> Result<Buffer, FsdpError> {
        let e = self.table.entry(id)?;
        match self.buffers.get(e.group) {
            Some(Some(b)) => Ok(b.slice(e.range.clone())?),
            _ => Err(not_unsharded(e)),
        }
    }
}

fn not_unsharded(e: &ParamEntry) -> FsdpError {
    FsdpError::UnknownParameter {
        name: format!("{} (its unit {} is not unsharded here)", e.name, e.group),
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

    fn buffer(&self, name: &str) -> Result<Buffer, FsdpError> {
        self.buffer_of(self.table.id(name)?)
    }

    fn compute_stream(&self) -> Option<&Stream> {
        self.stream.as_ref()
    }
}

/// Write views of the unsharded gradients of some units (see [`Fsdp::grad_views`](super::Fsdp::grad_views)).
pub struct GradViews<'a> {
    table: &'a ParamTable,
    /// Host memory only.
    guards: Vec<Option<WriteGuard<f32>>>,
    buffers: Vec<Option<Buffer>>,
}

impl<'a> GradViews<'a> {
    pub(crate) fn new(
        table: &'a ParamTable,
        guards: Vec<Option<WriteGuard<f32>>>,
        buffers: Vec<Option<Buffer>>,
    ) -> Self {
        GradViews {
            table,
            guards,
            buffers,
        }
    }

    /// The gradient of parameter `id`.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when its unit is not among these views' units or lives
    /// on a device (write it as a buffer, [`grad_buffer_of`](Self::grad_buffer_of)).
    pub fn get_mut(&mut self, id: ParamId) -> Result<&mut [f32], FsdpError> {
        let e = self.table.entry(id)?;
        match (self.guards.get_mut(e.group), self.buffers.get(e.group)) {
            (Some(Some(g)), _) => Ok(&mut g[e.range.clone()]),
            (_, Some(Some(b))) => Err(FsdpError::UnknownParameter {
                name: format!(
                    "{} (its unit's gradient lives on {}: write it as a buffer, \
                     Grads::grad_buffer)",
                    e.name,
                    b.device()
                ),
            }),
            _ => Err(no_gradient(e)),
        }
    }

    /// The gradient of parameter `id` as a view of its unit's unsharded gradient.
    ///
    /// # Errors
    /// [`FsdpError::UnknownParameter`] when its unit is not among these views' units.
    pub fn grad_buffer_of(&self, id: ParamId) -> Result<Buffer, FsdpError> {
        let e = self.table.entry(id)?;
        match (self.buffers.get(e.group), self.guards.get(e.group)) {
            (Some(Some(b)), _) => Ok(b.slice(e.range.clone())?),
            (_, Some(Some(_))) => Err(FsdpError::UnknownParameter {
                name: format!(
                    "{} (its unit's gradient is in host memory: write it with Grads::grad_mut)",
                    e.name
                ),
            }),
            _ => Err(no_gradient(e)),
        }
    }
}

fn no_gradient(e: &ParamEntry) -> FsdpError {
    FsdpError::UnknownParameter {
        name: format!("{} (its unit {} has no gradient here)", e.name, e.group),
    }
}

impl Grads for GradViews<'_> {
    fn grad_mut(&mut self, name: &str) -> Result<&mut [f32], FsdpError> {
        let id = self.table.id(name)?;
        self.get_mut(id)
    }

    fn grad_buffer(&mut self, name: &str) -> Result<Buffer, FsdpError> {
        self.grad_buffer_of(self.table.id(name)?)
    }
}
