//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the fsdp crate. Bad input is reported here, never by a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FsdpError {
    /// A model configuration is not usable (zero sizes, `n_embd` not divisible by `n_head`, ...).
    #[error("invalid model configuration: {reason}")]
    InvalidConfig {
        /// What is wrong with it.
        reason: String,
    },
    /// A parameter (or gradient) was asked for by a name the store does not hold.
    #[error("unknown parameter `{name}`")]
    UnknownParameter {
        /// The name asked for.
        name: String,
    },
    /// A parameter or gradient slice does not have the number of elements its shape requires.
    #[error("parameter `{name}` has {actual} elements, its shape needs {expected}")]
    ParameterLength {
        /// The parameter's name.
        name: String,
        /// Elements its shape requires.
        expected: usize,
        /// Elements the slice has.
        actual: usize,
    },
    /// A block index is not below `n_layer`.
    #[error("layer {layer} does not exist: the model has {n_layer} layers")]
    LayerOutOfRange {
        /// The index asked for.
        layer: usize,
        /// Number of transformer blocks.
        n_layer: usize,
    },
    /// A token id (input or target) is not below the vocabulary size.
    #[error("token id {token} is out of the vocabulary (size {vocab_size})")]
    TokenOutOfVocab {
        /// The offending id.
        token: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// The shape of a batch or of an activation does not fit the model or the stage.
    #[error("invalid batch or activation shape: {reason}")]
    InvalidShape {
        /// What does not fit.
        reason: String,
    },
    /// The global batch size cannot be split evenly over the ranks.
    #[error("global batch size {batch_size} is not divisible by the world size {world_size}")]
    BatchNotDivisible {
        /// Rows in the global batch.
        batch_size: usize,
        /// Number of ranks.
        world_size: usize,
    },
    /// A rank is not below the world size (or the world size is zero).
    #[error("rank {rank} is not valid in a world of size {world_size}")]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// A token file's length in bytes is odd, so it is not a sequence of u16 token ids.
    #[error("token file {path} has {bytes} bytes, an odd number: not a file of u16 token ids")]
    TokenFileOddLength {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        bytes: u64,
    },
    /// A token stream has too few tokens for the requested sequence length.
    #[error("token stream has {len} tokens, at least {needed} are needed ({reason})")]
    TokenStreamTooShort {
        /// Tokens in the stream.
        len: usize,
        /// Tokens needed.
        needed: usize,
        /// What they are needed for.
        reason: String,
    },
    /// Reading a file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Slices handed to an optimizer (parameter, gradient, state) differ in length.
    #[error(
        "optimizer slices differ in length: {what} has {actual} elements, the parameter {expected}"
    )]
    OptimizerLength {
        /// Which slice.
        what: &'static str,
        /// The parameter's length.
        expected: usize,
        /// The slice's length.
        actual: usize,
    },
    /// An optimizer hyperparameter or step number is out of its valid range.
    #[error("invalid optimizer setting {name} = {value}: {reason}")]
    InvalidHyperparameter {
        /// The setting's name (`lr`, `beta1`, `step`, ...).
        name: &'static str,
        /// Its value.
        value: f64,
        /// The valid range.
        reason: &'static str,
    },
    /// A unit plan (from a wrap policy) is inconsistent.
    #[error("invalid FSDP unit plan: {reason}")]
    InvalidPlan {
        /// What is wrong with it.
        reason: String,
    },
    /// A collective of the FSDP runtime failed.
    #[error(transparent)]
    Collective(#[from] fsdp_collectives::CollectiveError),
    /// A flat-parameter layout or view operation failed.
    #[error(transparent)]
    FlatParam(#[from] fsdp_flatparam::FlatParamError),
    /// The caching allocator could not serve an unsharded buffer.
    #[error(transparent)]
    Alloc(#[from] fsdp_allocator::AllocError),
    /// A device buffer or stream operation failed.
    #[error(transparent)]
    Device(#[from] fsdp_device::DeviceError),
    /// An FSDP runtime configuration is not usable (strategy, mesh, limits).
    #[error("invalid FSDP configuration: {reason}")]
    InvalidFsdpConfig {
        /// What is wrong with it.
        reason: String,
    },
    /// A module tree handed to the wrap planner is malformed (child names, duplicates, ties).
    #[error("invalid module tree: {reason}")]
    InvalidModuleTree {
        /// What is wrong with it.
        reason: String,
    },
    /// An ignored module path names no module of the model.
    #[error("ignored module `{path}` is not a module of the model")]
    UnknownModule {
        /// The path given.
        path: String,
    },
    /// A parameter is declared tied to a parameter the model does not have.
    #[error("parameter `{param}` is tied to `{tied_to}`, which is not a parameter of the model")]
    UnknownTiedParameter {
        /// The tied alias.
        param: String,
        /// The name it is tied to.
        tied_to: String,
    },
    /// A wrap policy (or the ignored modules) would put a tied alias in a unit that is not
    /// its target's unit nor nested in it, or one of them in an ignored module and the other
    /// not.
    #[error(
        "tied parameters `{param}` (in {param_unit}) and `{tied_to}` (in {tied_to_unit}) would \
         land in unrelated FSDP units; a shared storage must belong to the lowest common \
         ancestor unit of its users: wrap a common ancestor of both, or ignore both"
    )]
    TiedParametersSplit {
        /// The tied alias, e.g. `lm_head.weight`.
        param: String,
        /// Where it would land (`the root unit`, `unit `...``, `ignored module `...``).
        param_unit: String,
        /// The parameter it is tied to, e.g. `transformer.wte.weight`.
        tied_to: String,
        /// Where that one would land.
        tied_to_unit: String,
    },
    /// A host buffer (optimizer state, activations, a batch) could not be allocated: the
    /// system refused the memory, or the size is beyond what one allocation can hold.
    #[error(
        "out of host memory: cannot allocate {bytes} bytes ({}) for {what}",
        human_bytes(*bytes)
    )]
    HostOutOfMemory {
        /// What the buffer was for.
        what: String,
        /// The bytes asked for (`u64::MAX` when the size itself overflows).
        bytes: u64,
    },
    /// A checkpoint file or directory cannot be written or read, or does not match the model.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What is wrong (names the tensor where one is at fault).
        reason: String,
    },
}

impl FsdpError {
    /// Whether the error says that this rank failed because a peer left (its failure is
    /// secondary): a collective error for which
    /// [`CollectiveError::caused_by_peer`](fsdp_collectives::CollectiveError::caused_by_peer)
    /// holds. Every other error is this rank's own.
    pub fn caused_by_peer(&self) -> bool {
        match self {
            FsdpError::Collective(e) => e.caused_by_peer(),
            _ => false,
        }
    }
}

/// `bytes` in binary units with one decimal (`1.5 GiB`), or `N B` below 1 KiB.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// A vector of `len` copies of `value`, allocated fallibly: when the system refuses the memory
/// (or `len` elements do not fit in one allocation) the result is
/// [`FsdpError::HostOutOfMemory`] naming `what` and the bytes asked, not an abort. Use it for
/// buffers whose size comes from the user (optimizer state, activations, batches).
///
/// # Errors
/// [`FsdpError::HostOutOfMemory`].
pub fn try_filled_vec<T: Clone>(len: usize, value: T, what: &str) -> Result<Vec<T>, FsdpError> {
    let mut v = Vec::new();
    if v.try_reserve_exact(len).is_err() {
        let bytes = (len as u128).saturating_mul(std::mem::size_of::<T>() as u128);
        return Err(FsdpError::HostOutOfMemory {
            what: what.to_string(),
            bytes: u64::try_from(bytes).unwrap_or(u64::MAX),
        });
    }
    v.resize(len, value);
    Ok(v)
}
