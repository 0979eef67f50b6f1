//! Sharded initialisation: every rank materialises only its own shard of a unit's flat
//! parameter, with values that do not depend on the world size.
//!
//! This is what FSDP2's meta-device initialisation and DeepSpeed's `zero.Init` achieve: the full
//! model never exists on one rank. The values are made world-size independent by drawing every
//! element from a **counter-based** generator keyed by `(seed, parameter name, element index)`
//! instead of from one sequential stream, so that the element `i` of a parameter has the same
//! value whichever rank computes it, in whatever chunking, on whatever world size. A model
//! initialised on 8 ranks is therefore bitwise the model initialised on 1 rank with
//! [`materialize`], and a checkpoint can be reproduced from `(seed, names, rules)` alone.
//!
//! - [`name_key`] and [`element_u64`]: the generator (its exact construction below is part of
//!   the checkpoint-reproducibility contract).
//! - [`Init`]: a rule (zeros, ones, a constant, normal, uniform) and [`Init::fill`], which writes
//!   any range of a parameter's elements.
//! - [`fill_shard`]: one rank's shard of a unit's flat parameter; [`materialize`]: a whole
//!   tensor (the single-process reference).
//!
//! # The generator
//!
//! Let `mix64` be SplitMix64's output finaliser (Stafford's "Mix13"), on wrapping `u64`
//! arithmetic:
//!
//! ```text
//! mix64(z) = { z = (z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9;
//!              z = (z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB;
//!              z ^ (z >> 31) }
//! GAMMA    = 0x9E37_79B9_7F4A_7C15
//! ```
//!
//! - `name_key(name)` is FNV-1a 64 of the name's UTF-8 bytes: `h = 0xCBF2_9CE4_8422_2325`, then
//!   for every byte `b`: `h = (h ^ b) * 0x0000_0100_0000_01B3`.
//! - `element_u64(seed, name_key, index, lane)` derives a stream key and takes the stream's
//!   `index`-th output:
//!
//!   ```text
//!   k = mix64(seed + GAMMA)        // the first output of SplitMix64 seeded with `seed`
//!   k = mix64(k ^ name_key)
//!   k = mix64(k ^ lane)
//!   element_u64 = mix64(k + (index + 1) * GAMMA)
//!   ```
//!
//!   that is, output number `index` (from 0) of the SplitMix64 generator seeded with the key `k`
//!   of `(seed, name, lane)`. For a fixed key, `index ↦ element_u64` is a bijection of `u64`, so
//!   two elements of one parameter never share their bits.
//!
//! From the bits `x` of an element, [`Init`] builds (in `f64`, then rounds to the nearest `f32`):
//!
//! - a uniform in `(0, 1]`: `((x >> 11) + 1) * 2^-53`; a uniform in `[0, 1)`: `(x >> 11) * 2^-53`;
//! - [`Init::Uniform`]: `low * (1 - u) + high * u` with `u` the `[0, 1)` uniform of lane 0;
//! - [`Init::Normal`]: Box–Muller, `mean + std * sqrt(-2 ln u1) * cos(2π u2)` with `u1` the
//!   `(0, 1]` uniform of lane 0 (so `ln` never sees 0) and `u2` the `[0, 1)` uniform of lane 1.
//!   `ln`, `cos` and `sqrt` are those of the pure-Rust [`libm`] crate, not the platform's, so
//!   the bits are the same on every machine.
//!
//! # Example
//!
//! A tensor filled in two chunks equals the tensor filled at once:
//!
//! ```
//! use fsdp::init::{materialize, Init};
//!
//! # fn main() -> Result<(), fsdp::FsdpError> {
//! let init = Init::Normal { mean: 0.0, std: 0.02 };
//! let whole = materialize("fc.weight", &[4, 5], &init, 1337)?;
//! let mut chunks = vec![0.0f32; 20];
//! let (a, b) = chunks.split_at_mut(7);
//! init.fill(1337, "fc.weight", 0, a)?;
//! init.fill(1337, "fc.weight", 7, b)?;
//! assert_eq!(whole, chunks);
//! # Ok(())
//! # }
//! ```

use fsdp_flatparam::FlatParamLayout;

use crate::FsdpError;

/// SplitMix64's increment, the 64-bit golden ratio.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// FNV-1a 64 offset basis.
const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;

/// FNV-1a 64 prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01B3;

/// `2^-53`, the spacing of the 53-bit uniforms.
const TWO_POW_MINUS_53: f64 = 1.0 / (1u64 << 53) as f64;

/// SplitMix64's output finaliser (Stafford's Mix13): a bijection of `u64` with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stable 64-bit key of a parameter name: FNV-1a 64 of its UTF-8 bytes (offset basis
/// `0xCBF29CE484222325`, prime `0x100000001B3`).
///
/// Unlike std's `DefaultHasher` / `RandomState`, this is the same in every process, on every
/// platform and in every version, as the checkpoint-reproducibility contract requires.
///
/// ```
/// assert_eq!(fsdp::init::name_key(""), 0xCBF2_9CE4_8422_2325);
/// assert_eq!(fsdp::init::name_key("a"), 0xAF63_DC4C_8601_EC8C);
/// ```
pub fn name_key(name: &str) -> u64 {
    name.bytes().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// The key of the SplitMix64 stream of `(seed, name_key, lane)` (see the [module
/// documentation](self)).
fn stream_key(seed: u64, name_key: u64, lane: u64) -> u64 {
    let k = mix64(seed.wrapping_add(GAMMA));
    let k = mix64(k ^ name_key);
    mix64(k ^ lane)
}

/// Output number `index` of the SplitMix64 stream of key `key`.
fn stream_u64(key: u64, index: u64) -> u64 {
    mix64(key.wrapping_add(index.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// 64 random bits for element `index` of the parameter whose [`name_key`] is `name_key`, under
/// `seed`, in the independent `lane` (an element that needs several random numbers, as a
/// Box–Muller normal, takes lanes 0, 1, ...).
///
/// Stateless and counter-based: the result depends on the four arguments only. The
/// construction, part of the checkpoint-reproducibility contract, is
///
/// ```text
/// k = mix64(mix64(mix64(seed + GAMMA) ^ name_key) ^ lane)
/// element_u64 = mix64(k + (index + 1) * GAMMA)
/// ```
///
/// with SplitMix64's finaliser `mix64` and `GAMMA = 0x9E3779B97F4A7C15`, all arithmetic
/// wrapping: output number `index` of SplitMix64 seeded with `k` (see the [module
/// documentation](self)).
///
/// ```
/// use fsdp::init::{element_u64, name_key};
///
/// let key = name_key("transformer.wte.weight");
/// assert_eq!(element_u64(7, key, 3, 0), element_u64(7, key, 3, 0));
/// assert_ne!(element_u64(7, key, 3, 0), element_u64(7, key, 4, 0));
/// assert_ne!(element_u64(7, key, 3, 0), element_u64(7, key, 3, 1));
/// ```
pub fn element_u64(seed: u64, name_key: u64, index: u64, lane: u64) -> u64 {
    stream_u64(stream_key(seed, name_key, lane), index)
}

/// A uniform in `(0, 1]` from the top 53 bits of `x`.
fn unit_open_closed(x: u64) -> f64 {
    ((x >> 11) + 1) as f64 * TWO_POW_MINUS_53
}

/// A uniform in `[0, 1)` from the top 53 bits of `x`.
fn unit_closed_open(x: u64) -> f64 {
    (x >> 11) as f64 * TWO_POW_MINUS_53
}

/// How to initialise a parameter. Every element's value depends only on `(seed, name, index)`;
/// see [`fill`](Self::fill).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Every element 0.
    Zeros,
    /// Every element 1.
    Ones,
    /// Every element the given value.
    Constant(f32),
    /// Normal samples, by Box–Muller from lanes 0 and 1 of the element (see the [module
    /// documentation](self)), rounded to `f32`. `std` must be finite and `>= 0`, `mean`
    /// finite.
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation.
        std: f64,
    },
    /// Uniform samples in `[low, high)` (`[low, high]` once rounded to `f32`), from lane 0 of
    /// the element. Both bounds must be finite, with `low <= high`.
    Uniform {
        /// The lower bound.
        low: f64,
        /// The upper bound.
        high: f64,
    },
}

impl Init {
    /// Check the rule's parameters.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] for a non-finite `mean`, a negative or non-finite
    /// `std`, non-finite uniform bounds or `low > high`.
    pub fn validate(&self) -> Result<(), FsdpError> {
        match *self {
            Init::Zeros | Init::Ones | Init::Constant(_) => Ok(()),
            Init::Normal { mean, std } => {
                if !mean.is_finite() {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "mean",
                        value: mean,
                        reason: "the mean of a normal initialisation must be finite",
                    });
                }
                if !(std.is_finite() && std >= 0.0) {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "std",
                        value: std,
                        reason: "the standard deviation of a normal initialisation must be \
                                 finite and >= 0",
                    });
                }
                Ok(())
            }
            Init::Uniform { low, high } => {
                if !low.is_finite() {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "low",
                        value: low,
                        reason: "the bounds of a uniform initialisation must be finite",
                    });
                }
                if !high.is_finite() {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "high",
                        value: high,
                        reason: "the bounds of a uniform initialisation must be finite",
                    });
                }
                if low > high {
                    return Err(FsdpError::InvalidHyperparameter {
                        name: "high",
                        value: high,
                        reason: "the upper bound of a uniform initialisation must be >= low",
                    });
                }
                Ok(())
            }
        }
    }

    /// Write elements `start .. start + out.len()` (row-major flat indices) of the parameter
    /// named `name` into `out`.
    ///
    /// The value of element `i` depends only on `(seed, name, i)` and the rule — not on
    /// `start`, on `out.len()`, on the parameter's shape or on anything else — so filling a
    /// tensor in any chunking gives bitwise the same values as filling it at once.
    ///
    /// # Errors
    /// [`FsdpError::InvalidHyperparameter`] (see [`validate`](Self::validate)), and
    /// [`FsdpError::InvalidShape`] when `start + out.len()` overflows `u64`.
    ///
    /// ```
    /// use fsdp::init::Init;
    ///
    /// # fn main() -> Result<(), fsdp::FsdpError> {
    /// let mut a = [0.0f32; 8];
    /// let mut b = [0.0f32; 3];
    /// let u = Init::Uniform { low: -1.0, high: 1.0 };
    /// u.fill(42, "w", 0, &mut a)?;
    /// u.fill(42, "w", 5, &mut b)?;
    /// assert_eq!(a[5..], b);
    /// assert!(a.iter().all(|x| (-1.0..=1.0).contains(x)));
    /// # Ok(())
    /// # }
    /// ```
    pub fn fill(
        &self,
        seed: u64,
        name: &str,
        start: u64,
        out: &mut [f32],
    ) -> Result<(), FsdpError> {
        self.validate()?;
        let len = u64::try_from(out.len()).ok();
        if len.and_then(|n| start.checked_add(n)).is_none() {
            return Err(FsdpError::InvalidShape {
                reason: format!(
                    "elements {start} .. {start} + {} of `{name}` overflow a u64 index",
                    out.len()
                ),
            });
        }
        match *self {
            Init::Zeros => out.fill(0.0),
            Init::Ones => out.fill(1.0),
            Init::Constant(c) => out.fill(c),
            Init::Normal { mean, std } => {
                let key = name_key(name);
                let k0 = stream_key(seed, key, 0);
                let k1 = stream_key(seed, key, 1);
                for (index, o) in (start..).zip(out.iter_mut()) {
                    let u1 = unit_open_closed(stream_u64(k0, index));
                    let u2 = unit_closed_open(stream_u64(k1, index));
                    let r = libm::sqrt(-2.0 * libm::log(u1));
                    let z = r * libm::cos(2.0 * std::f64::consts::PI * u2);
                    *o = (mean + std * z) as f32;
                }
            }
            Init::Uniform { low, high } => {
                let k0 = stream_key(seed, name_key(name), 0);
                for (index, o) in (start..).zip(out.iter_mut()) {
                    let u = unit_closed_open(stream_u64(k0, index));
                    // No `high - low`, which can overflow for finite bounds.
                    *o = (low * (1.0 - u) + high * u) as f32;
                }
            }
        }
        Ok(())
    }
}

/// The whole tensor `name` of shape `shape` initialised by `init` under `seed`, row-major: the
/// single-process reference that every sharded fill reproduces bitwise.
///
/// # Errors
/// [`FsdpError::InvalidHyperparameter`] for an invalid rule (see [`Init::validate`]), and
/// [`FsdpError::InvalidShape`] when the product of `shape` overflows.
pub fn materialize(
    name: &str,
    shape: &[usize],
    init: &Init,
    seed: u64,
) -> Result<Vec<f32>, FsdpError> {
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| FsdpError::InvalidShape {
            reason: format!("the number of elements of `{name}` (shape {shape:?}) overflows"),
        })?;
    init.validate()?;
    let mut out = vec![0.0f32; numel];
    init.fill(seed, name, 0, &mut out)?;
    Ok(out)
}

/// A per-parameter rule: the [`Init`] of the parameter of a given name and shape, as
/// [`fill_shard`] takes it (`&InitRule<'_>` is `&dyn Fn(&str, &[usize]) -> Result<Init,
/// FsdpError>`, borrowing whatever it captures).
pub type InitRule<'a> = dyn Fn(&str, &[usize]) -> Result<Init, FsdpError> + 'a;

/// Write shard `shard_index` (this rank's, of `layout.shard_numel()` elements) of the unit whose
/// flat parameter is laid out by `layout`, without materialising anything else.
///
/// Every parameter's rule is `init_of(name, shape)`. For every parameter with a piece in the
/// shard (see [`FlatParamLayout::shard_param_infos`]), `out[piece.shard_range()]` receives the
/// parameter's elements `piece.intra_param_range()` as [`Init::fill`] writes them; padding
/// (alignment gaps and end padding) is 0. Concatenating the shards of every index therefore
/// gives `layout.flatten(..)` of the [`materialize`]d parameters, bitwise, whatever the world
/// size. Aliases (tied parameters) take no space and are not asked for.
///
/// `init_of` is called, and its rule validated, for *every* parameter of the layout, not only
/// those in the shard, so that a bad rule fails on every rank alike.
///
/// # Errors
/// [`FsdpError::FlatParam`] when `shard_index` is not below the world size,
/// [`FsdpError::InvalidShape`] when `out` is not `layout.shard_numel()` long, any error of
/// `init_of`, and [`FsdpError::InvalidHyperparameter`] for an invalid rule.
///
/// # Example
///
/// Two ranks each fill their shard; together they hold the single-process tensors:
///
/// ```
/// use fsdp::init::{fill_shard, materialize, Init};
/// use fsdp::FsdpError;
/// use fsdp_flatparam::FlatParamLayout;
///
/// # fn main() -> Result<(), FsdpError> {
/// let layout = FlatParamLayout::builder(2)
///     .param("fc.weight", &[3, 4])
///     .param("fc.bias", &[3])
///     .build()?;
/// let init_of = |name: &str, _shape: &[usize]| -> Result<Init, FsdpError> {
///     Ok(if name.ends_with(".bias") {
///         Init::Zeros
///     } else {
///         Init::Normal { mean: 0.0, std: 0.02 }
///     })
/// };
///
/// let mut flat = Vec::new();
/// for rank in 0..layout.world_size() {
///     let mut shard = vec![f32::NAN; layout.shard_numel()];
///     fill_shard(&layout, rank, 0, &init_of, &mut shard)?; // on rank `rank` only
///     flat.extend(shard);
/// }
///
/// let weight = materialize("fc.weight", &[3, 4], &init_of("fc.weight", &[3, 4])?, 0)?;
/// let bias = materialize("fc.bias", &[3], &Init::Zeros, 0)?;
/// assert_eq!(flat, layout.flatten(&[weight, bias])?);
/// assert_eq!(flat[15], 0.0); // end padding
/// # Ok(())
/// # }
/// ```
pub fn fill_shard(
    layout: &FlatParamLayout,
    shard_index: usize,
    seed: u64,
    init_of: &InitRule<'_>,
    out: &mut [f32],
) -> Result<(), FsdpError> {
    let pieces = layout.shard_param_infos(shard_index)?;
    if out.len() != layout.shard_numel() {
        return Err(FsdpError::InvalidShape {
            reason: format!(
                "shard buffer has {} elements, the layout's shards have {}",
                out.len(),
                layout.shard_numel()
            ),
        });
    }
    let rules = layout
        .params()
        .iter()
        .map(|p| {
            let init = init_of(p.name(), p.shape())?;
            init.validate()?;
            Ok(init)
        })
        .collect::<Result<Vec<Init>, FsdpError>>()?;
    out.fill(0.0);
    for ((p, piece), init) in layout.params().iter().zip(&pieces).zip(&rules) {
        if !piece.in_shard {
            continue;
        }
        init.fill(
            seed,
            p.name(),
            piece.intra_param_start_idx as u64,
            &mut out[piece.shard_range()],
        )?;
    }
    Ok(())
}
