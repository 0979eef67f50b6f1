//! Flat parameters: pad, shard and view a unit's parameters as one evenly sharded buffer
//!
//! Not yet built: see the open issues.
#![forbid(unsafe_code)]
