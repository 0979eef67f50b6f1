//! Devices, streams, events, element types and stream-safe buffers.
//!
//! This is the bottom crate of the workspace: the one definition of [`Stream`], [`Event`],
//! [`DType`]/[`Element`] and [`Buffer`] that the allocator, collectives, flat-parameter and FSDP
//! crates share, so that the same runtime code drives CPU streams (worker threads) and, with the
//! `cuda` feature, CUDA streams and events (module `cuda`). Buffers on [`Device::Meta`] ([`Buffer::meta`])
//! have lengths and sizes but no memory, to run code for its shapes and memory use alone.
//!
//! Host buffers are ordered by access tickets ([`Buffer::access`]); device buffers (feature
//! `cuda`) are stream-ordered ([`order`]: each storage's [`StreamOrder`] keeps the events of its
//! last write and of the reads since, and [`Buffer::use_on`] makes a stream wait for them), and
//! their host access is an explicit async copy into pinned memory.
//!
//! ```
//! use fsdp_device::{Buffer, DType, Stream, AccessMode};
//! use std::time::Duration;
//!
//! // Issue asynchronous work that fills a buffer on a CPU stream…
//! let buf = Buffer::zeros(DType::F32, 3).unwrap();
//! let comm = Stream::cpu("comm");
//! let ticket = buf.access(AccessMode::Exclusive); // taken now, in program order
//! comm.enqueue(move || {
//!     let mut guard = ticket.acquire(Duration::from_secs(10)).unwrap();
//!     let p = guard.as_ptr() as *mut f32;
//!     // SAFETY: exclusive access to 3 host f32 elements.
//!     unsafe { for i in 0..3 { p.add(i).write(i as f32) } }
//! }).unwrap();
//! // …and read it on the host: the read waits for the work issued before it.
//! assert_eq!(buf.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0]);
//! ```

#[cfg(any(feature = "cuda", test))]
mod block_cache;
pub mod buffer;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
pub mod dtype;
mod error;
mod host_task;
pub mod order;
mod ordered;
mod ordered_ops;
mod reaper;
#[cfg(target_os = "linux")]
pub mod shared;
mod storage;
pub mod stream;

pub use buffer::{AccessGuard, AccessMode, AccessTicket, Buffer, ReadGuard, WriteGuard};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::DeviceError;
pub use host_task::{host_task, TaskRead, TaskWrite};
pub use order::{StreamOrder, StreamUse};
pub use ordered::OrderedStorage;
pub use reaper::{pending_releases, release_after, wait_for_releases};
pub use storage::{HostStorage, MetaStorage, Storage, HOST_ALIGN};
pub use stream::{Event, Stream, StreamId, DEFAULT_TIMEOUT};

#[doc(hidden)]
pub use half;

/// The README's examples, run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
