//! Runs every collective of the MPI backend against the host reference (being written).

fn main() {}
