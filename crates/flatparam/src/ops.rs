//! Operations on host slices: flatten, shard, view, gather and scatter.

use std::ops::Range;

use fsdp_device::Element;

use crate::error::{FlatParamError, Result};
use crate::layout::{FlatParamLayout, ParamInfo};
use crate::view::{ParamView, ParamViewMut, ShardParamView, ShardParamViewMut};

fn check_len(what: impl FnOnce() -> String, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(FlatParamError::LengthMismatch {
            what: what(),
            expected,
            actual,
        })
    }
}

fn check_count(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(FlatParamError::CountMismatch {
            what,
            expected,
            actual,
        })
    }
}

/// Split `rest` (which starts at flat offset `*pos`) at the elements `range` of the flat buffer,
/// returning them and keeping what follows in `rest`. `range.start >= *pos`.
fn take_mut<'a, T>(rest: &mut &'a mut [T], pos: &mut usize, range: Range<usize>) -> &'a mut [T] {
    let taken = std::mem::take(rest);
    let (_, tail) = taken.split_at_mut(range.start - *pos);
    let (mine, tail) = tail.split_at_mut(range.end - range.start);
    *rest = tail;
    *pos = range.end;
    mine
}

impl FlatParamLayout {
    fn check_params<T: Element, S: AsRef<[T]>>(&self, params: &[S]) -> Result<()> {
        check_count("parameters", self.num_params(), params.len())?;
        for (p, d) in self.params().iter().zip(params) {
            check_len(
                || format!("parameter `{}`", p.name()),
                p.numel(),
                d.as_ref().len(),
            )?;
        }
        Ok(())
    }

    fn check_flat(&self, len: usize) -> Result<()> {
        check_len(
            || "the unsharded flat buffer".into(),
            self.padded_numel(),
            len,
        )
    }

    fn check_shard(&self, rank: usize, len: usize) -> Result<()> {
        check_len(
            || format!("the shard of rank {rank}"),
            self.shard_numel(),
            len,
        )
    }

    fn check_shards<T: Element, S: AsRef<[T]>>(&self, shards: &[S]) -> Result<()> {
        check_count("shards", self.world_size(), shards.len())?;
        for (rank, s) in shards.iter().enumerate() {
            self.check_shard(rank, s.as_ref().len())?;
        }
        Ok(())
    }

    /// Write the elements `range` of the unsharded flat buffer (parameters and zeroed padding)
    /// into `out`, whose length is that of the range. Inputs already checked.
    fn write_range<T: Element, S: AsRef<[T]>>(
        &self,
        params: &[S],
        range: Range<usize>,
        out: &mut [T],
    ) {
        let zero = T::zeroed();
        let base = range.start;
        let mut pos = range.start;
        for (p, data) in self.params().iter().zip(params) {
            let start = p.offset().max(range.start);
            let end = (p.offset() + p.numel()).min(range.end);
            if p.offset() >= range.end {
                break;
            }
            if start >= end {
                continue;
            }
            if start > pos {
                out[pos - base..start - base].fill(zero);
            }
            out[start - base..end - base]
                .copy_from_slice(&data.as_ref()[start - p.offset()..end - p.offset()]);
            pos = end;
        }
        if pos < range.end {
            out[pos - base..].fill(zero);
        }
    }

    /// Flatten the parameters (one slice per parameter of [`params`](Self::params), in order,
    /// aliases left out) into a new unsharded flat buffer; padding is zero.
    ///
    /// # Errors
    /// [`CountMismatch`](FlatParamError::CountMismatch) or
    /// [`LengthMismatch`](FlatParamError::LengthMismatch) when `params` does not match the layout.
    pub fn flatten<T: Element, S: AsRef<[T]>>(&self, params: &[S]) -> Result<Vec<T>> {
        self.check_params(params)?;
        let zero = T::zeroed();
        let mut flat = Vec::with_capacity(self.padded_numel());
        for (p, data) in self.params().iter().zip(params) {
            flat.resize(p.offset(), zero);
            flat.extend_from_slice(data.as_ref());
        }
        flat.resize(self.padded_numel(), zero);
        Ok(flat)
    }

    /// Flatten the parameters into `flat`, a buffer of [`padded_numel`](Self::padded_numel)
    /// elements; every padding element is overwritten with zero.
    ///
    /// # Errors
    /// [`CountMismatch`](FlatParamError::CountMismatch) or
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn flatten_into<T: Element, S: AsRef<[T]>>(
        &self,
        params: &[S],
        flat: &mut [T],
    ) -> Result<()> {
        self.check_params(params)?;
        self.check_flat(flat.len())?;
        // The whole buffer: one copy per parameter, zeros in the gaps (the general
        // `write_range` clips every parameter to the range, which costs at small sizes).
        let zero = T::zeroed();
        let mut rest = flat;
        let mut pos = 0;
        for (p, data) in self.params().iter().zip(params) {
            let gap = p.offset() - pos;
            let (gap_out, tail) = std::mem::take(&mut rest).split_at_mut(gap);
            if gap > 0 {
                gap_out.fill(zero);
            }
            let (out, tail) = tail.split_at_mut(p.numel());
            out.copy_from_slice(data.as_ref());
            rest = tail;
            pos = p.offset() + p.numel();
        }
        rest.fill(zero);
        Ok(())
    }

    /// Write only `rank`'s shard of the flattened parameters into `shard` (of
    /// [`shard_numel`](Self::shard_numel) elements), without building the unsharded buffer: how a
    /// rank initialises its shard from full parameters.
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange),
    /// [`CountMismatch`](FlatParamError::CountMismatch) or
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn flatten_shard_into<T: Element, S: AsRef<[T]>>(
        &self,
        params: &[S],
        rank: usize,
        shard: &mut [T],
    ) -> Result<()> {
        let range = self.shard_range(rank)?;
        self.check_params(params)?;
        self.check_shard(rank, shard.len())?;
        self.write_range(params, range, shard);
        Ok(())
    }

    /// `rank`'s shard of an unsharded flat buffer.
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn shard<'a, T: Element>(&self, flat: &'a [T], rank: usize) -> Result<&'a [T]> {
        let range = self.shard_range(rank)?;
        self.check_flat(flat.len())?;
        Ok(&flat[range])
    }

    /// `rank`'s shard of an unsharded flat buffer, mutably.
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn shard_mut<'a, T: Element>(&self, flat: &'a mut [T], rank: usize) -> Result<&'a mut [T]> {
        let range = self.shard_range(rank)?;
        self.check_flat(flat.len())?;
        Ok(&mut flat[range])
    }

    /// Every rank's shard of an unsharded flat buffer, in rank order.
    ///
    /// # Errors
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn shards<'a, T: Element>(&self, flat: &'a [T]) -> Result<Vec<&'a [T]>> {
        self.check_flat(flat.len())?;
        let n = self.shard_numel();
        Ok((0..self.world_size())
            .map(|r| &flat[r * n..(r + 1) * n])
            .collect())
    }

    /// Every rank's shard of an unsharded flat buffer, mutably and disjointly, in rank order:
    /// the outputs of a reduce-scatter written in place.
    ///
    /// # Errors
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn shards_mut<'a, T: Element>(&self, flat: &'a mut [T]) -> Result<Vec<&'a mut [T]>> {
        self.check_flat(flat.len())?;
        let n = self.shard_numel();
        let mut out = Vec::with_capacity(self.world_size());
        let mut rest = flat;
        for _ in 0..self.world_size() {
            let (shard, tail) = std::mem::take(&mut rest).split_at_mut(n);
            out.push(shard);
            rest = tail;
        }
        Ok(out)
    }

    /// Concatenate the shards of every rank (in rank order) into the unsharded flat buffer:
    /// the result of an all-gather, done on the host.
    ///
    /// # Errors
    /// [`CountMismatch`](FlatParamError::CountMismatch) or
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn unshard_into<T: Element, S: AsRef<[T]>>(
        &self,
        shards: &[S],
        flat: &mut [T],
    ) -> Result<()> {
        self.check_shards(shards)?;
        self.check_flat(flat.len())?;
        let n = self.shard_numel();
        for (rank, s) in shards.iter().enumerate() {
            flat[rank * n..(rank + 1) * n].copy_from_slice(s.as_ref());
        }
        Ok(())
    }

    fn make_view<'a, T>(&'a self, flat: &'a [T], name: &'a str, index: usize) -> ParamView<'a, T> {
        let info = &self.params()[index];
        ParamView {
            name,
            info,
            index,
            data: &flat[info.range()],
        }
    }

    /// The parameters as shaped, read-only views of an unsharded (all-gathered) flat buffer, in
    /// parameter order, aliases left out. No element is copied.
    ///
    /// # Errors
    /// [`LengthMismatch`](FlatParamError::LengthMismatch) when `flat` is not
    /// [`padded_numel`](Self::padded_numel) long.
    pub fn views<'a, T: Element>(&'a self, flat: &'a [T]) -> Result<Vec<ParamView<'a, T>>> {
        self.check_flat(flat.len())?;
        Ok(self
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| self.make_view(flat, p.name(), i))
            .collect())
    }

    /// One view per name, parameters and aliases, in declaration order: an alias's view has the
    /// alias's name and the same data as the parameter it shares.
    ///
    /// # Errors
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn named_views<'a, T: Element>(&'a self, flat: &'a [T]) -> Result<Vec<ParamView<'a, T>>> {
        self.check_flat(flat.len())?;
        Ok(self
            .names()
            .map(|(name, i)| self.make_view(flat, name, i))
            .collect())
    }

    /// The view of the parameter or alias `name`.
    ///
    /// # Errors
    /// [`UnknownName`](FlatParamError::UnknownName),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn view<'a, T: Element>(&'a self, flat: &'a [T], name: &str) -> Result<ParamView<'a, T>> {
        self.check_flat(flat.len())?;
        let (name, index) = self
            .lookup(name)
            .ok_or_else(|| FlatParamError::UnknownName { name: name.into() })?;
        Ok(self.make_view(flat, name, index))
    }

    /// The view of parameter `index`.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn view_at<'a, T: Element>(
        &'a self,
        flat: &'a [T],
        index: usize,
    ) -> Result<ParamView<'a, T>> {
        let p = self.param(index)?;
        self.check_flat(flat.len())?;
        Ok(self.make_view(flat, p.name(), index))
    }

    /// Disjoint mutable views of every parameter (aliases left out) in an unsharded flat buffer,
    /// in parameter order: a backward pass writes each gradient straight into the flat gradient
    /// buffer, which is then the reduce-scatter input as it is. Gradients of an alias belong in
    /// the view of the parameter it shares (accumulate them there). Padding is not touched.
    ///
    /// # Errors
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn views_mut<'a, T: Element>(
        &'a self,
        flat: &'a mut [T],
    ) -> Result<Vec<ParamViewMut<'a, T>>> {
        self.check_flat(flat.len())?;
        let mut out = Vec::with_capacity(self.num_params());
        let mut rest = flat;
        let mut pos = 0;
        for (index, info) in self.params().iter().enumerate() {
            let data = take_mut(&mut rest, &mut pos, info.range());
            out.push(ParamViewMut { info, index, data });
        }
        Ok(out)
    }

    /// The mutable view of parameter `index`.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn view_at_mut<'a, T: Element>(
        &'a self,
        flat: &'a mut [T],
        index: usize,
    ) -> Result<ParamViewMut<'a, T>> {
        let info = self.param(index)?;
        self.check_flat(flat.len())?;
        Ok(ParamViewMut {
            info,
            index,
            data: &mut flat[info.range()],
        })
    }

    fn in_shard(&self, rank: usize) -> impl Iterator<Item = (usize, &ParamInfo)> + '_ {
        let shard = rank * self.shard_numel()..(rank + 1) * self.shard_numel();
        self.params()
            .iter()
            .enumerate()
            .skip_while(move |(_, p)| p.offset() + p.numel() <= shard.start)
            .take_while(move |(_, p)| p.offset() < shard.end)
            // A zero-element parameter is listed as PyTorch lists it (ShardParamInfo::in_shard).
            .filter(move |(_, p)| p.numel() > 0 || p.offset() > shard.start)
    }

    /// The pieces of the parameters that lie in `rank`'s shard, viewed inside that shard (of
    /// [`shard_numel`](Self::shard_numel) elements), in parameter order; parameters the shard does not list
    /// ([`ShardParamInfo::in_shard`](crate::ShardParamInfo::in_shard)) are left out.
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn shard_views<'a, T: Element>(
        &'a self,
        shard: &'a [T],
        rank: usize,
    ) -> Result<Vec<ShardParamView<'a, T>>> {
        self.check_rank(rank)?;
        self.check_shard(rank, shard.len())?;
        let mut out = Vec::new();
        for (index, info) in self.in_shard(rank) {
            let piece = self.shard_param_info(index, rank)?;
            out.push(ShardParamView {
                info,
                index,
                piece,
                data: &shard[piece.shard_range()],
            });
        }
        Ok(out)
    }

    /// Disjoint mutable views of the pieces in `rank`'s shard; see
    /// [`shard_views`](Self::shard_views).
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn shard_views_mut<'a, T: Element>(
        &'a self,
        shard: &'a mut [T],
        rank: usize,
    ) -> Result<Vec<ShardParamViewMut<'a, T>>> {
        self.check_rank(rank)?;
        self.check_shard(rank, shard.len())?;
        let mut out = Vec::new();
        let mut rest = shard;
        let mut pos = 0;
        for (index, info) in self.in_shard(rank) {
            let piece = self.shard_param_info(index, rank)?;
            let data = take_mut(&mut rest, &mut pos, piece.shard_range());
            out.push(ShardParamViewMut {
                info,
                index,
                piece,
                data,
            });
        }
        Ok(out)
    }

    /// Reassemble parameter `index` from its pieces in the shards of every rank (in rank order),
    /// into `out` (of the parameter's [`numel`](ParamInfo::numel)).
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange),
    /// [`CountMismatch`](FlatParamError::CountMismatch),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn gather_param_into<T: Element, S: AsRef<[T]>>(
        &self,
        index: usize,
        shards: &[S],
        out: &mut [T],
    ) -> Result<()> {
        let p = self.param(index)?;
        self.check_shards(shards)?;
        check_len(|| format!("parameter `{}`", p.name()), p.numel(), out.len())?;
        for rank in self.ranks_holding(p) {
            let piece = self.shard_param_info(index, rank)?;
            out[piece.intra_param_range()]
                .copy_from_slice(&shards[rank].as_ref()[piece.shard_range()]);
        }
        Ok(())
    }

    /// Reassemble parameter `index` from the shards of every rank into a new vector.
    ///
    /// # Errors
    /// As [`gather_param_into`](Self::gather_param_into).
    pub fn gather_param<T: Element, S: AsRef<[T]>>(
        &self,
        index: usize,
        shards: &[S],
    ) -> Result<Vec<T>> {
        let p = self.param(index)?;
        let mut out = vec![T::zeroed(); p.numel()];
        self.gather_param_into(index, shards, &mut out)?;
        Ok(out)
    }

    /// Write the full parameter `index` into its pieces in the shards of every rank (in rank
    /// order); nothing else in the shards changes.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange),
    /// [`CountMismatch`](FlatParamError::CountMismatch),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn scatter_param<T: Element, S: AsMut<[T]>>(
        &self,
        index: usize,
        full: &[T],
        shards: &mut [S],
    ) -> Result<()> {
        let p = self.param(index)?;
        check_len(
            || format!("parameter `{}`", p.name()),
            p.numel(),
            full.len(),
        )?;
        check_count("shards", self.world_size(), shards.len())?;
        for (rank, s) in shards.iter_mut().enumerate() {
            self.check_shard(rank, s.as_mut().len())?;
        }
        for rank in self.ranks_holding(p) {
            let piece = self.shard_param_info(index, rank)?;
            shards[rank].as_mut()[piece.shard_range()]
                .copy_from_slice(&full[piece.intra_param_range()]);
        }
        Ok(())
    }

    /// Write `rank`'s piece of the full parameter `index` into that rank's shard (nothing if the
    /// shard holds none of it): how one rank loads a parameter from a full checkpoint.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange),
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn scatter_param_to_shard<T: Element>(
        &self,
        index: usize,
        full: &[T],
        rank: usize,
        shard: &mut [T],
    ) -> Result<()> {
        let piece = self.shard_param_info(index, rank)?;
        let p = &self.params()[index];
        check_len(
            || format!("parameter `{}`", p.name()),
            p.numel(),
            full.len(),
        )?;
        self.check_shard(rank, shard.len())?;
        shard[piece.shard_range()].copy_from_slice(&full[piece.intra_param_range()]);
        Ok(())
    }
}
