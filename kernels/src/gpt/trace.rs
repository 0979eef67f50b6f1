//! Tracing [`GptPass`]'s step: with [`set_tracing`](GptPass::set_tracing) the step records
//! a [`Mark`](GptOps::Mark) after each of its parts (the embeddings, each block's forward, the
//! head, each block's backward, the embeddings' backward), which a trainer turns into a
//! timeline once the device has run them.

use std::sync::{Mutex, PoisonError};

use super::model::DeviceGpt;
use super::ops::GptOps;
use super::pass::GptPass;
use super::units::Units;
use crate::KernelError;

/// The end of one part of a traced step: its name, whether it belongs to backward, and the
/// mark recorded where it ends (it begins where the part before it ended).
pub struct SpanEnd<M> {
    /// The part, e.g. `forward block 2`.
    pub name: String,
    /// Whether it is part of backward.
    pub backward: bool,
    /// Recorded after its operations.
    pub mark: M,
}

/// The marks a traced step has recorded (`None`: not tracing).
pub(super) type Marks<M> = Mutex<Option<Vec<SpanEnd<M>>>>;

impl<O: GptOps> GptPass<O> {
    /// Record a mark after each part of every step from now on (`true`), or none (`false`,
    /// the default).
    pub fn set_tracing(&mut self, on: bool) {
        let m = self.marks.get_mut().unwrap_or_else(PoisonError::into_inner);
        *m = on.then(Vec::new);
    }

    /// The marks recorded since the last call, in order (none when not tracing).
    pub fn take_marks(&self) -> Vec<SpanEnd<O::Mark>> {
        let mut m = self.marks.lock().unwrap_or_else(PoisonError::into_inner);
        m.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// When tracing and `units` asks for it ([`Units::traced`]), records the end of a hook's
    /// work `name()`.
    pub(super) fn hook_mark<U: Units<O> + ?Sized>(
        &self,
        units: &U,
        backward: bool,
        name: impl FnOnce() -> String,
    ) -> Result<(), KernelError> {
        if units.traced() {
            self.trace_mark(backward, name)?;
        }
        Ok(())
    }

    /// When tracing, records the end of the part `name()`.
    pub(super) fn trace_mark(
        &self,
        backward: bool,
        name: impl FnOnce() -> String,
    ) -> Result<(), KernelError> {
        let mut m = self.marks.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = m.as_mut() {
            v.push(SpanEnd {
                name: name(),
                backward,
                mark: self.ops().mark()?,
            });
        }
        Ok(())
    }
}

impl<O: GptOps> DeviceGpt<O> {
    /// Record a mark after each part of every step from now on (`true`), or none (`false`,
    /// the default): [`GptPass::set_tracing`].
    pub fn set_tracing(&mut self, on: bool) {
        self.pass.set_tracing(on);
    }

    /// The marks recorded since the last call, in order (none when not tracing):
    /// [`GptPass::take_marks`].
    pub fn take_marks(&self) -> Vec<SpanEnd<O::Mark>> {
        self.pass.take_marks()
    }
}
