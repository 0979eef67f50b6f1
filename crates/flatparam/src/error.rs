//! The crate's error type.

use fsdp_device::DeviceError;

/// Everything that can go wrong when building a [`FlatParamLayout`](crate::FlatParamLayout) or
/// applying it to buffers. Bad input is always reported here, never by a panic.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum FlatParamError {
    /// The world size (sharding factor) was zero.
    #[error("world size must be at least 1")]
    ZeroWorldSize,
    /// Two parameters or aliases have the same name.
    #[error("parameter name `{name}` is given more than once")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// An alias (tied parameter) names a parameter that was not declared before it.
    #[error("alias `{alias}` refers to `{target}`, which is not an earlier parameter")]
    UnknownAliasTarget {
        /// The alias being declared.
        alias: String,
        /// The name it refers to.
        target: String,
    },
    /// A number of elements (of one parameter, of the running total, of the padded total or of
    /// its size in bytes) does not fit in `usize` / `isize`.
    #[error("number of elements overflows at {what}")]
    NumelOverflow {
        /// Where the overflow happened (a parameter name, or `padding`).
        what: String,
    },
    /// The requested alignment is zero or not a whole number of elements.
    #[error("invalid alignment: {reason}")]
    InvalidAlignment {
        /// Why.
        reason: String,
    },
    /// A slice or buffer does not have the length the layout requires.
    #[error("{what} has {actual} elements, the layout requires {expected}")]
    LengthMismatch {
        /// Which slice or buffer.
        what: String,
        /// The length the layout requires.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// A list (of parameters, of shards) does not have the length the layout requires.
    #[error("expected {expected} {what}, got {actual}")]
    CountMismatch {
        /// What was counted (`parameters`, `shards`).
        what: &'static str,
        /// How many the layout requires.
        expected: usize,
        /// How many were given.
        actual: usize,
    },
    /// A rank is not below the world size.
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The layout's world size.
        world_size: usize,
    },
    /// No parameter or alias has this name.
    #[error("no parameter or alias is named `{name}`")]
    UnknownName {
        /// The name given.
        name: String,
    },
    /// A parameter index is not below the number of parameters.
    #[error("parameter index {index} is out of range ({num_params} parameters)")]
    ParamIndexOutOfRange {
        /// The index given.
        index: usize,
        /// How many (non-alias) parameters the layout has.
        num_params: usize,
    },
    /// Two buffers that must be distinct share memory.
    #[error("{0}")]
    Overlap(String),
    /// An error of the underlying device buffer.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Shorthand for `Result<T, FlatParamError>`.
pub type Result<T, E = FlatParamError> = std::result::Result<T, E>;
