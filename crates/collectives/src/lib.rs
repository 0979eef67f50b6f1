//! Collectives with an equal-size all-gather at their core.
//!
//! This crate gives Rust training code what PyTorch FSDP gets from NCCL: a [`Communicator`]
//! trait with NCCL's semantics (`all_gather_base`, `reduce_scatter_base`, `all_reduce`,
//! `broadcast`, `reduce`, `barrier`, unequal `all_gather`, `split`), a 2-D mesh helper for hybrid
//! sharding ([`mesh_2d`]), and backends. The [`ring`] backend — ranks as threads of one process —
//! is the embedded default; [`tcp`] runs ranks as processes (bitwise the ring's results), `nccl`
//! (feature `nccl`) on GPUs through cudarc, `mpi` (feature `mpi`) under `mpirun`, and [`dryrun`]
//! checks arguments and completes at once without moving data (on buffers of any device, the
//! meta device included: what a plan of a run needs, with [`dryrun::dry_run_mesh`] for hybrid
//! sharding). Processes meet through the rendezvous [`store::TcpStore`]; [`init_from_env`] builds
//! a communicator from the launcher's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...) and
//! [`launch`] starts the processes, like `torchrun`.
//!
//! Guarantees, on every backend but the dry run (which checks each rank's arguments alone and
//! returns completed work):
//! - every collective is enqueued on the communicator's [`Stream`](fsdp_device::Stream) and
//!   returns a [`Work`]; waiting is bounded by a timeout;
//! - arguments are checked on every rank before data moves: lengths, element types, reduce ops,
//!   roots or operations that differ across ranks fail on every rank with an error that names the
//!   ranks and what differed ([`CollectiveError::Mismatch`]);
//! - a peer that leaves (its communicator is dropped, its thread panics) or never arrives makes
//!   the others fail within the timeout, never hang;
//! - reductions are deterministic: bitwise identical on every rank and in every run.
//!
//! ```
//! use fsdp_collectives::{ring, Communicator};
//! use fsdp_device::{Buffer, DType};
//!
//! // Three ranks as threads; each contributes 2 elements; everyone gets all 6.
//! let gathered = ring::run_ranks(3, ring::RingOptions::default(), |comm| {
//!     let r = comm.rank() as f32;
//!     let input = Buffer::from_slice(&[r, r + 0.5]).unwrap();
//!     let output = Buffer::zeros(DType::F32, 2 * comm.world_size()).unwrap();
//!     let work = comm.all_gather_base(&input, &output).unwrap();
//!     work.wait().unwrap();
//!     output.to_vec::<f32>().unwrap()
//! })
//! .unwrap();
//! for out in gathered {
//!     assert_eq!(out, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
//! }
//! ```

pub mod auth;
mod communicator;
mod env;
mod error;
pub mod flavors;
pub mod launch;
mod mesh;
mod op;
pub mod store;
pub mod torchelastic;
mod work;

pub use communicator::{AbortHandle, Communicator};
pub use env::{
    init_from_env, init_with_store, parse_seconds, Backend, InitOptions, LaunchEnv,
    INIT_TIMEOUT_ENV, TIMEOUT_ENV,
};
pub use error::{CollectiveError, Result};
#[cfg(feature = "cuda")]
pub use flavors::cuda_ring;
#[cfg(feature = "mpi")]
pub use flavors::mpi;
#[cfg(feature = "nccl")]
pub use flavors::nccl;
pub use flavors::{dryrun, ring, tcp};
pub use mesh::{mesh_2d, HybridMesh};
pub use op::ReduceOp;
pub use work::{Work, WorkCompleter};

/// The README's examples, run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
