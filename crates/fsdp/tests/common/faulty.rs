//! A model that goes wrong on purpose, for the engine's error tests (`generic_models.rs`, which
//! includes this file with `#[path]`): [`Faulty`] wraps a model and lists or reads a parameter
//! the engine does not have ([`MISSING`]), in a span's list or in the middle of a pass.

use fsdp::engine::{FsdpModel, Phase, Span};
use fsdp::{FsdpError, Grads, Params};

pub const MISSING: &str = "no.such.weight";

/// How a [`Faulty`] model goes wrong with a parameter the engine does not have ([`MISSING`]).
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Span `n` also lists it.
    Listed(usize),
    /// The forward or backward (`Phase`) of span `n` reads it.
    Read(Phase, usize),
}

/// `inner` with a [`Fault`].
pub struct Faulty<'a, M> {
    pub inner: &'a M,
    pub fault: Fault,
}

impl<M> Faulty<'_, M> {
    fn reads_in(&self, phase: Phase, s: usize) -> bool {
        matches!(self.fault, Fault::Read(p, n) if (p, n) == (phase, s))
    }
}

impl<M: FsdpModel> FsdpModel for Faulty<'_, M> {
    type Batch = M::Batch;
    type Tape = M::Tape;
    fn spans(&self) -> Vec<Span> {
        let mut spans = self.inner.spans();
        if let Fault::Listed(n) = self.fault {
            spans[n].params.push(MISSING.into());
        }
        spans
    }
    fn forward(
        &self,
        s: usize,
        p: &dyn Params,
        b: &M::Batch,
        t: &mut M::Tape,
    ) -> Result<(), FsdpError> {
        if self.reads_in(Phase::Forward, s) {
            p.param(MISSING)?;
        }
        self.inner.forward(s, p, b, t)
    }
    fn loss(&self, t: &M::Tape) -> Result<f32, FsdpError> {
        self.inner.loss(t)
    }
    fn backward(
        &self,
        s: usize,
        p: &dyn Params,
        g: &mut dyn Grads,
        b: &M::Batch,
        t: &mut M::Tape,
    ) -> Result<(), FsdpError> {
        if self.reads_in(Phase::Backward, s) {
            g.grad_mut(MISSING)?;
        }
        self.inner.backward(s, p, g, b, t)
    }
}

pub fn is_missing(r: Result<f32, FsdpError>) -> bool {
    matches!(r, Err(FsdpError::UnknownParameter { ref name }) if name == MISSING)
}
