//! The nccl backend (being written).
