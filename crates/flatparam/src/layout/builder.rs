//! Building a [`FlatParamLayout`]: the declarations (parameters, aliases, alignment) and
//! [`build`](FlatParamLayoutBuilder::build), which checks them and computes every offset.

use std::collections::HashMap;

use fsdp_device::DType;

use super::{FlatParamLayout, NameRef, ParamInfo, SharedParamInfo};
use crate::error::{FlatParamError, Result};

/// The largest element size of any [`DType`]: a layout is checked to fit in memory for all of
/// them, so that its byte ranges never overflow whatever the element type.
const MAX_ELEMENT_BYTES: usize = 8;

#[derive(Clone, Debug)]
enum Decl {
    Param { name: String, shape: Vec<usize> },
    Alias { name: String, target: String },
}

#[derive(Clone, Copy, Debug)]
enum AlignSpec {
    Off,
    Bytes { bytes: usize, dtype: DType },
    Numel(usize),
}

/// Builds a [`FlatParamLayout`]: parameters in order, aliases, world size and alignment.
/// Every check happens in [`build`](Self::build).
///
/// ```
/// use fsdp_device::DType;
/// use fsdp_flatparam::FlatParamLayout;
///
/// let layout = FlatParamLayout::builder(2)
///     .param("wte.weight", &[10, 4])
///     .param("ln.weight", &[4])
///     .param("ln.bias", &[4])
///     .alias("lm_head.weight", "wte.weight") // tied: no space of its own
///     .align_bytes(16, DType::F32)
///     .build()?;
/// assert_eq!(layout.unpadded_numel(), 48);
/// assert_eq!(layout.shard_numel(), 24);
/// assert_eq!(layout.index_of("lm_head.weight"), Some(0));
/// # Ok::<(), fsdp_flatparam::FlatParamError>(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct FlatParamLayoutBuilder {
    world_size: usize,
    align: AlignSpec,
    decls: Vec<Decl>,
}

impl FlatParamLayoutBuilder {
    /// Add the next parameter, with its name and shape (`&[]` for a scalar).
    pub fn param(mut self, name: impl Into<String>, shape: &[usize]) -> Self {
        self.decls.push(Decl::Param {
            name: name.into(),
            shape: shape.to_vec(),
        });
        self
    }

    /// Add a tied parameter: `name` views the same data as the earlier parameter (or alias)
    /// `target`, and takes no space.
    pub fn alias(mut self, name: impl Into<String>, target: impl Into<String>) -> Self {
        self.decls.push(Decl::Alias {
            name: name.into(),
            target: target.into(),
        });
        self
    }

    /// Start every parameter at an offset that is a multiple of `bytes` when the flat parameter
    /// holds `dtype` elements (PyTorch pads to 16 bytes of the unsharded dtype with
    /// `use_orig_params`). `bytes` must be a non-zero multiple of the element size. Off by
    /// default. As in PyTorch, an alignment of more than one element also pads the flat
    /// parameter itself to a multiple of the world size (alignment padding, no end padding).
    pub fn align_bytes(mut self, bytes: usize, dtype: DType) -> Self {
        self.align = AlignSpec::Bytes { bytes, dtype };
        self
    }

    /// Start every parameter at an offset that is a multiple of `numel` elements (non-zero).
    /// `1`, the default, means no alignment; more also pads the flat parameter to a multiple of
    /// the world size, as [`align_bytes`](Self::align_bytes) does.
    pub fn align_numel(mut self, numel: usize) -> Self {
        self.align = AlignSpec::Numel(numel);
        self
    }

    /// Check the declarations and compute the layout.
    ///
    /// # Errors
    /// [`ZeroWorldSize`](FlatParamError::ZeroWorldSize),
    /// [`DuplicateName`](FlatParamError::DuplicateName),
    /// [`UnknownAliasTarget`](FlatParamError::UnknownAliasTarget),
    /// [`InvalidAlignment`](FlatParamError::InvalidAlignment) and
    /// [`NumelOverflow`](FlatParamError::NumelOverflow) (also when the padded total, in bytes of
    /// the widest element type, would exceed `isize::MAX`).
    pub fn build(self) -> Result<FlatParamLayout> {
        let world_size = self.world_size;
        if world_size == 0 {
            return Err(FlatParamError::ZeroWorldSize);
        }
        let align_numel = match self.align {
            AlignSpec::Off => 1,
            AlignSpec::Numel(0) => {
                return Err(FlatParamError::InvalidAlignment {
                    reason: "alignment of 0 elements".into(),
                })
            }
            AlignSpec::Numel(n) => n,
            AlignSpec::Bytes { bytes, dtype } => {
                let size = dtype.size_in_bytes();
                if bytes == 0 || bytes % size != 0 {
                    return Err(FlatParamError::InvalidAlignment {
                        reason: format!(
                            "{bytes} bytes is not a positive multiple of the {size}-byte {dtype} \
                             element"
                        ),
                    });
                }
                bytes / size
            }
        };

        let mut params: Vec<ParamInfo> = Vec::new();
        let mut shared: Vec<SharedParamInfo> = Vec::new();
        let mut order: Vec<NameRef> = Vec::with_capacity(self.decls.len());
        let mut by_name: HashMap<String, NameRef> = HashMap::with_capacity(self.decls.len());
        let mut total: usize = 0;
        for decl in self.decls {
            match decl {
                Decl::Param { name, shape } => {
                    if by_name.contains_key(&name) {
                        return Err(FlatParamError::DuplicateName { name });
                    }
                    let overflow = || FlatParamError::NumelOverflow { what: name.clone() };
                    let numel = shape
                        .iter()
                        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                        .ok_or_else(overflow)?;
                    let offset = total
                        .checked_next_multiple_of(align_numel)
                        .ok_or_else(overflow)?;
                    total = offset.checked_add(numel).ok_or_else(overflow)?;
                    let r = NameRef::Param(params.len());
                    by_name.insert(name.clone(), r);
                    order.push(r);
                    params.push(ParamInfo {
                        name,
                        shape: shape.into_boxed_slice(),
                        numel,
                        offset,
                    });
                }
                Decl::Alias { name, target } => {
                    if by_name.contains_key(&name) {
                        return Err(FlatParamError::DuplicateName { name });
                    }
                    let prim_index = match by_name.get(&target) {
                        Some(NameRef::Param(i)) => *i,
                        Some(NameRef::Alias(a)) => shared[*a].prim_index,
                        None => {
                            return Err(FlatParamError::UnknownAliasTarget {
                                alias: name,
                                target,
                            })
                        }
                    };
                    let r = NameRef::Alias(shared.len());
                    by_name.insert(name.clone(), r);
                    order.push(r);
                    shared.push(SharedParamInfo { name, prim_index });
                }
            }
        }
        let padding_overflow = || FlatParamError::NumelOverflow {
            what: "padding".into(),
        };
        if align_numel > 1 {
            // PyTorch's `_init_flat_param_and_metadata` with `_aligned_numel > 0` appends a
            // padding tensor up to a multiple of the world size: the flat parameter then needs
            // no padding when sharded.
            total = total
                .checked_next_multiple_of(world_size)
                .ok_or_else(padding_overflow)?;
        }
        let padded_numel = total
            .checked_next_multiple_of(world_size)
            .ok_or_else(padding_overflow)?;
        match padded_numel.checked_mul(MAX_ELEMENT_BYTES) {
            Some(bytes) if bytes <= isize::MAX as usize => {}
            _ => return Err(padding_overflow()),
        }
        Ok(FlatParamLayout {
            world_size,
            align_numel,
            params,
            shared,
            order,
            by_name,
            unpadded_numel: total,
            padded_numel,
            shard_numel: padded_numel / world_size,
        })
    }
}

impl FlatParamLayout {
    /// Start a layout for `world_size` ranks (the sharding factor).
    pub fn builder(world_size: usize) -> FlatParamLayoutBuilder {
        FlatParamLayoutBuilder {
            world_size,
            align: AlignSpec::Off,
            decls: Vec::new(),
        }
    }
}
