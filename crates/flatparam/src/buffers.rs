//! The layout applied to [`fsdp_device::Buffer`]s: per-parameter and per-shard buffers that
//! share the flat buffer's storage, on any device, with no copy and no host round trip.

use fsdp_device::{with_element, Buffer};

use crate::cast::cast_into;
use crate::error::{FlatParamError, Result};
use crate::layout::FlatParamLayout;

impl FlatParamLayout {
    fn check_buffer(&self, flat: &Buffer) -> Result<()> {
        if flat.len() == self.padded_numel() {
            Ok(())
        } else {
            Err(FlatParamError::LengthMismatch {
                what: "the unsharded flat buffer".into(),
                expected: self.padded_numel(),
                actual: flat.len(),
            })
        }
    }

    /// One buffer per parameter (aliases left out), in parameter order, each a slice of the
    /// unsharded flat buffer `flat` (same storage, any device and element type).
    ///
    /// # Errors
    /// [`LengthMismatch`](FlatParamError::LengthMismatch) when `flat` is not
    /// [`padded_numel`](Self::padded_numel) long.
    pub fn buffer_views(&self, flat: &Buffer) -> Result<Vec<Buffer>> {
        self.check_buffer(flat)?;
        self.params()
            .iter()
            .map(|p| Ok(flat.slice(p.range())?))
            .collect()
    }

    /// The buffer of parameter `index`, a slice of the unsharded flat buffer `flat`.
    ///
    /// # Errors
    /// [`ParamIndexOutOfRange`](FlatParamError::ParamIndexOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn buffer_view(&self, flat: &Buffer, index: usize) -> Result<Buffer> {
        let p = self.param(index)?;
        self.check_buffer(flat)?;
        Ok(flat.slice(p.range())?)
    }

    /// `rank`'s shard of the unsharded flat buffer `flat`, as a slice of it (e.g. where the
    /// reduce-scatter of an in-place gradient buffer leaves this rank's result).
    ///
    /// # Errors
    /// [`RankOutOfRange`](FlatParamError::RankOutOfRange),
    /// [`LengthMismatch`](FlatParamError::LengthMismatch).
    pub fn shard_buffer(&self, flat: &Buffer, rank: usize) -> Result<Buffer> {
        let range = self.shard_range(rank)?;
        self.check_buffer(flat)?;
        Ok(flat.slice(range)?)
    }
}

/// Cast the elements of the host buffer `src` into the host buffer `dst` of the same length
/// (round to nearest even; see [`cast_into`]), after the stream work issued on either before
/// the call. The element types are the buffers' own.
///
/// # Errors
/// [`LengthMismatch`](FlatParamError::LengthMismatch),
/// [`Overlap`](FlatParamError::Overlap) when the buffers share bytes, and
/// [`Device`](FlatParamError::Device) errors (a buffer not on the host, a timeout).
pub fn cast_buffer(src: &Buffer, dst: &Buffer) -> Result<()> {
    if src.len() != dst.len() {
        return Err(FlatParamError::LengthMismatch {
            what: format!("the {} destination buffer of a cast", dst.dtype()),
            expected: src.len(),
            actual: dst.len(),
        });
    }
    if src.overlaps(dst) {
        return Err(FlatParamError::Overlap(
            "the source and destination of a cast share memory".into(),
        ));
    }
    with_element!(src.dtype(), S => with_element!(dst.dtype(), D => {
        let s = src.read::<S>()?;
        let mut d = dst.write::<D>()?;
        cast_into::<S, D>(&s, &mut d)
    }))
}
