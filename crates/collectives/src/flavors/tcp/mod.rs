//! The tcp backend (being written).
