//! A per-stream caching allocator with record-stream and retry statistics, generic over its memory source
//!
//! Not yet built: see the open issues.
#![forbid(unsafe_code)]
