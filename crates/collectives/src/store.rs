//! The rendezvous key-value store (being written).
