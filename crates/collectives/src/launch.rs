//! The process launcher (being written).
