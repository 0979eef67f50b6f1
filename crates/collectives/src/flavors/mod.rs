//! Backends of the [`Communicator`](crate::Communicator) trait, one module each.
//!
//! - [`ring`]: ranks are threads of one process (the embedded default).
//! - [`tcp`]: ranks are processes (on one machine or several) connected by TCP sockets in a ring,
//!   bootstrapped through the rendezvous [`store`](crate::store) — what Gloo is to PyTorch.
//! - `nccl` (cargo feature `nccl`): NCCL through cudarc, on CUDA buffers.
//! - `mpi` (cargo feature `mpi`): MPI through rsmpi, on host buffers, across machines.
//! - [`dryrun`]: no data and no peers — every collective checks its arguments as the others do
//!   and completes at once, on buffers of any device (meta included); the FSDP plan drives the
//!   real engine over it.

mod check;
#[cfg(feature = "cuda")]
pub mod cuda_ring;
mod desc;
pub mod dryrun;
mod engine;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod ring;
pub mod tcp;
