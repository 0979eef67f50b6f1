//! All-gather base through NCCL on the GPU (being written).

fn main() {}
