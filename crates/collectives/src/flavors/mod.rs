//! Backends of the [`Communicator`](crate::Communicator) trait, one module each.

pub mod ring;
