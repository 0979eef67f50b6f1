//! The mpi backend (being written).
