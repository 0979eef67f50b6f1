//! Building a communicator from the environment (being written).
