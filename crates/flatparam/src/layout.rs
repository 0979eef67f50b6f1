//! The layout of a flat parameter: pure metadata (offsets, padding, shards), no data.
//!
//! The builder that computes it is in [`builder`].

mod builder;

use std::collections::HashMap;
use std::ops::Range;

use fsdp_device::DType;

use crate::error::{FlatParamError, Result};

pub use builder::FlatParamLayoutBuilder;

/// One original (non-alias) parameter inside the flat parameter.
///
/// PyTorch keeps the same facts in `FlatParameter._fqns`, `_shapes`, `_numels` and the offsets
/// implied by `_numels_with_padding`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    name: String,
    shape: Box<[usize]>,
    numel: usize,
    offset: usize,
}

impl ParamInfo {
    /// The parameter's name (its fully qualified name in the module tree).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The parameter's shape; empty for a scalar.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements: the product of the shape (1 for a scalar, 0 if any dimension is 0).
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Offset of the first element in the unsharded flat buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The elements of the unsharded flat buffer that hold this parameter.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// A tied (shared) parameter: a second name for an earlier parameter. It occupies no space in
/// the flat parameter and views the same data (PyTorch's `_SharedParamInfo`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedParamInfo {
    name: String,
    prim_index: usize,
}

impl SharedParamInfo {
    /// The alias's own name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Index (in [`FlatParamLayout::params`]) of the parameter it shares.
    pub fn prim_index(&self) -> usize {
        self.prim_index
    }
}

/// The piece of one parameter that lies in one rank's shard (PyTorch's `_ShardParamInfo`).
///
/// When [`in_shard`](Self::in_shard) is `false` every other field is 0. Unlike PyTorch, whose
/// `intra_param_end_idx` is inclusive, [`intra_param_end_idx`](Self::intra_param_end_idx) is
/// exclusive, so that `flat_param_data[intra_param_start_idx..intra_param_end_idx]` is the piece.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ShardParamInfo {
    /// Whether the parameter is listed in the shard: any element of it lies there. A
    /// zero-element parameter at offset `s` is listed, with 0 elements, exactly as PyTorch's
    /// `_get_shard_metadata` does: in the shard that holds both element `s - 1` and element
    /// `s` of the flat parameter, so in no shard when `s` is 0 or falls on a shard boundary.
    pub in_shard: bool,
    /// Offset of the piece inside the shard: `shard[offset_in_shard..offset_in_shard +
    /// numel_in_shard]`.
    pub offset_in_shard: usize,
    /// Number of elements of the parameter in the shard.
    pub numel_in_shard: usize,
    /// Index, in the flattened parameter, of the first element of the piece.
    pub intra_param_start_idx: usize,
    /// Index, in the flattened parameter, one past the last element of the piece (exclusive).
    pub intra_param_end_idx: usize,
}

impl ShardParamInfo {
    /// The piece's elements inside the shard.
    pub fn shard_range(&self) -> Range<usize> {
        self.offset_in_shard..self.offset_in_shard + self.numel_in_shard
    }

    /// The piece's elements inside the flattened parameter.
    pub fn intra_param_range(&self) -> Range<usize> {
        self.intra_param_start_idx..self.intra_param_end_idx
    }
}

/// What a run of the unsharded flat buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentKind {
    /// The parameter of this index in [`FlatParamLayout::params`].
    Param(usize),
    /// Padding inserted before a parameter so that its offset is aligned, and, with alignment
    /// on, after the last parameter up to a multiple of the world size: PyTorch
    /// (`use_orig_params`) makes that padding part of the flat parameter itself.
    AlignmentPadding,
    /// Padding at the end so that the total is a multiple of the world size (alignment off:
    /// PyTorch adds it when sharding, as `_shard_numel_padded`).
    EndPadding,
}

/// A run of the unsharded flat buffer: a parameter or padding. See
/// [`FlatParamLayout::segments`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// What the run holds.
    pub kind: SegmentKind,
    /// Where it lies in the unsharded flat buffer, in elements.
    pub range: Range<usize>,
}

impl Segment {
    /// Whether the run is padding (of either kind).
    pub fn is_padding(&self) -> bool {
        !matches!(self.kind, SegmentKind::Param(_))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NameRef {
    Param(usize),
    Alias(usize),
}

/// Where a unit's parameters lie in its flat parameter, and how that is cut into shards.
///
/// The unsharded flat buffer holds the parameters in declaration order (each at an offset that
/// is a multiple of the alignment, with zeroed gaps), then zeroed padding up to
/// [`padded_numel`](Self::padded_numel), a multiple of the world size: the buffer is therefore
/// the input of an equal-size reduce-scatter, and the output of an equal-size all-gather, as it
/// is. Rank `r` keeps the `r`-th of `world_size` equal shards of
/// [`shard_numel`](Self::shard_numel) elements.
///
/// Everything is counted in elements, the same for every element type: a shard cast from `f32`
/// to `bf16` has the same layout. [`param_byte_range`](Self::param_byte_range) and
/// [`shard_byte_range`](Self::shard_byte_range) give bytes for a given type, so device code can
/// build its own views.
#[derive(Clone, Debug)]
pub struct FlatParamLayout {
    world_size: usize,
    align_numel: usize,
    params: Vec<ParamInfo>,
    shared: Vec<SharedParamInfo>,
    order: Vec<NameRef>,
    by_name: HashMap<String, NameRef>,
    unpadded_numel: usize,
    padded_numel: usize,
    shard_numel: usize,
}

impl PartialEq for FlatParamLayout {
    fn eq(&self, other: &Self) -> bool {
        // `by_name` is derived from the rest.
        self.world_size == other.world_size
            && self.align_numel == other.align_numel
            && self.params == other.params
            && self.shared == other.shared
            && self.order == other.order
    }
}

impl Eq for FlatParamLayout {}

impl FlatParamLayout {
    /// The number of shards (the sharding factor).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Every parameter's offset is a multiple of this many elements (1 when alignment is off).
    pub fn align_numel(&self) -> usize {
        self.align_numel
    }

    /// The original parameters, in order, without aliases.
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// Number of original (non-alias) parameters.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }

    /// The tied parameters (aliases), in order.
    pub fn shared_params(&self) -> &[SharedParamInfo] {
        &self.shared
    }

    /// Every name, parameters and aliases, in declaration order, each with the index of the
    /// parameter whose data it views.
    pub fn names(&self) -> impl ExactSizeIterator<Item = (&str, usize)> + '_ {
        self.order.iter().map(|r| match *r {
            NameRef::Param(i) => (self.params[i].name(), i),
            NameRef::Alias(a) => (self.shared[a].name(), self.shared[a].prim_index),
        })
    }

    /// Index in [`params`](Self::params) of the parameter that `name` views (aliases resolved).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).map(|r| match *r {
            NameRef::Param(i) => i,
            NameRef::Alias(a) => self.shared[a].prim_index,
        })
    }

    /// The stored name equal to `name`, and the index of the parameter it views.
    pub(crate) fn lookup(&self, name: &str) -> Option<(&str, usize)> {
        self.by_name.get(name).map(|r| match *r {
            NameRef::Param(i) => (self.params[i].name(), i),
            NameRef::Alias(a) => (self.shared[a].name(), self.shared[a].prim_index),
        })
    }

    /// Whether `name` is an alias (a tied parameter) rather than an original parameter.
    pub fn is_alias(&self, name: &str) -> bool {
        matches!(self.by_name.get(name), Some(NameRef::Alias(_)))
    }

    /// The parameter of index `index`.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange).
    pub fn param(&self, index: usize) -> Result<&ParamInfo> {
        self.params
            .get(index)
            .ok_or(FlatParamError::ParamIndexOutOfRange {
                index,
                num_params: self.params.len(),
            })
    }

    /// Elements of the flat parameter before end padding: up to the end of the last parameter
    /// (parameters and alignment gaps), and with alignment on, the alignment padding up to a
    /// multiple of the world size (PyTorch's `_unpadded_unsharded_size`).
    pub fn unpadded_numel(&self) -> usize {
        self.unpadded_numel
    }

    /// Length of the unsharded flat buffer: [`unpadded_numel`](Self::unpadded_numel) rounded up
    /// to a multiple of the world size.
    pub fn padded_numel(&self) -> usize {
        self.padded_numel
    }

    /// Padding elements at the end (fewer than the world size; 0 with alignment on).
    pub fn end_padding_numel(&self) -> usize {
        self.padded_numel - self.unpadded_numel
    }

    /// Length of every rank's shard: `padded_numel / world_size`.
    pub fn shard_numel(&self) -> usize {
        self.shard_numel
    }

    pub(crate) fn check_rank(&self, rank: usize) -> Result<()> {
        if rank < self.world_size {
            Ok(())
        } else {
            Err(FlatParamError::RankOutOfRange {
                rank,
                world_size: self.world_size,
            })
        }
    }

    /// The elements of the unsharded flat buffer that make up `rank`'s shard.
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange).
    pub fn shard_range(&self, rank: usize) -> Result<Range<usize>> {
        self.check_rank(rank)?;
        let start = rank * self.shard_numel;
        Ok(start..start + self.shard_numel)
    }

    /// Number of end-padding elements in `rank`'s shard (PyTorch's `_shard_numel_padded`);
    /// alignment gaps are not counted.
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange).
    pub fn numel_padded_in_shard(&self, rank: usize) -> Result<usize> {
        let range = self.shard_range(rank)?;
        Ok(range.end - range.start.max(self.unpadded_numel).min(range.end))
    }

    /// The piece of parameter `index` in `rank`'s shard.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange),
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange).
    pub fn shard_param_info(&self, index: usize, rank: usize) -> Result<ShardParamInfo> {
        let p = self.param(index)?;
        let shard = self.shard_range(rank)?;
        Ok(piece(p, &shard))
    }

    /// The piece of every parameter in `rank`'s shard, in parameter order (PyTorch's
    /// `FlatParameter._shard_param_infos`).
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange).
    pub fn shard_param_infos(&self, rank: usize) -> Result<Vec<ShardParamInfo>> {
        let shard = self.shard_range(rank)?;
        Ok(self.params.iter().map(|p| piece(p, &shard)).collect())
    }

    /// The ranks whose shards hold part of parameter `index`, in order, with the piece each
    /// holds. The pieces cover the parameter exactly once, in order; a zero-element parameter
    /// has one empty piece or none (see [`ShardParamInfo::in_shard`]).
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange).
    pub fn param_pieces(&self, index: usize) -> Result<Vec<(usize, ShardParamInfo)>> {
        let p = self.param(index)?;
        Ok(self
            .ranks_holding(p)
            .map(|rank| {
                let start = rank * self.shard_numel;
                (rank, piece(p, &(start..start + self.shard_numel)))
            })
            .collect())
    }

    /// The ranks whose shards list `p` (see [`ShardParamInfo::in_shard`]).
    pub(crate) fn ranks_holding(&self, p: &ParamInfo) -> Range<usize> {
        if p.numel == 0 {
            // Listed where both element offset - 1 and element offset lie.
            return match self.shard_numel {
                n if n > 0 && p.offset % n != 0 && p.offset < self.padded_numel => {
                    p.offset / n..p.offset / n + 1
                }
                _ => 0..0,
            };
        }
        // numel > 0 implies padded_numel > 0, hence shard_numel > 0.
        let first = p.offset / self.shard_numel;
        let last = (p.offset + p.numel - 1) / self.shard_numel;
        first..last + 1
    }

    /// The unsharded flat buffer as consecutive runs, in order: every parameter (zero-element
    /// ones included, as empty runs), alignment gaps and the end padding. The runs cover
    /// `0..padded_numel` exactly.
    pub fn segments(&self) -> Vec<Segment> {
        let mut out = Vec::with_capacity(2 * self.params.len() + 1);
        let mut pos = 0;
        for (i, p) in self.params.iter().enumerate() {
            if p.offset > pos {
                out.push(Segment {
                    kind: SegmentKind::AlignmentPadding,
                    range: pos..p.offset,
                });
            }
            out.push(Segment {
                kind: SegmentKind::Param(i),
                range: p.range(),
            });
            pos = p.offset + p.numel;
        }
        if self.unpadded_numel > pos {
            out.push(Segment {
                kind: SegmentKind::AlignmentPadding,
                range: pos..self.unpadded_numel,
            });
            pos = self.unpadded_numel;
        }
        if self.padded_numel > pos {
            out.push(Segment {
                kind: SegmentKind::EndPadding,
                range: pos..self.padded_numel,
            });
        }
        out
    }

    /// The padding runs (alignment gaps and end padding) of the unsharded flat buffer; the flat
    /// buffers this crate writes hold zeros there.
    pub fn padding_ranges(&self) -> Vec<Range<usize>> {
        self.segments()
            .into_iter()
            .filter(Segment::is_padding)
            .map(|s| s.range)
            .collect()
    }

    /// Bytes of parameter `index` inside an unsharded flat buffer of `dtype` elements.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange).
    pub fn param_byte_range(&self, index: usize, dtype: DType) -> Result<Range<usize>> {
        Ok(byte_range(self.param(index)?.range(), dtype))
    }

    /// Bytes of `rank`'s shard inside an unsharded flat buffer of `dtype` elements.
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange).
    pub fn shard_byte_range(&self, rank: usize, dtype: DType) -> Result<Range<usize>> {
        Ok(byte_range(self.shard_range(rank)?, dtype))
    }
}

/// An element range in bytes for `dtype`. Never overflows for ranges of a built layout, which
/// checks its padded size against the widest element type.
pub(crate) fn byte_range(range: Range<usize>, dtype: DType) -> Range<usize> {
    let size = dtype.size_in_bytes();
    range.start * size..range.end * size
}

fn piece(p: &ParamInfo, shard: &Range<usize>) -> ShardParamInfo {
    if p.numel == 0 {
        // PyTorch: inclusive bounds [s, s - 1] meet the shard [a, b] when a <= s - 1 and
        // s <= b.
        if shard.start < p.offset && p.offset < shard.end {
            return ShardParamInfo {
                in_shard: true,
                offset_in_shard: p.offset - shard.start,
                ..ShardParamInfo::default()
            };
        }
        return ShardParamInfo::default();
    }
    let start = p.offset.max(shard.start);
    let end = (p.offset + p.numel).min(shard.end);
    if start >= end {
        return ShardParamInfo::default();
    }
    ShardParamInfo {
        in_shard: true,
        offset_in_shard: start - shard.start,
        numel_in_shard: end - start,
        intra_param_start_idx: start - p.offset,
        intra_param_end_idx: end - p.offset,
    }
}
