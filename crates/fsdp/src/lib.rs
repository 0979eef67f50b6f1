//! Fully sharded data parallel training composed from the collectives, allocator and flatparam crates
//!
//! Not yet built: see the open issues.
#![forbid(unsafe_code)]
