//! [`MetaOps`]' [`PeerOps`]: the peers' buffers and events of sharded training counted, with
//! nothing copied or reduced (see [`MetaOps`]).

use super::memory::{bytes_of, Counted};
use super::meta::{write, MetaCounted, MetaOps};
use super::peer::{PeerOps, PeerPtr};
use super::peer_half::{check_cast, half_type};
use crate::host::ReduceKind;
use crate::KernelError;
use fsdp_device::DType;

impl PeerOps for MetaOps {
    type Event = ();
    type Half = MetaCounted;

    fn half(&self, len: usize) -> Result<MetaCounted, KernelError> {
        Ok(self.counted(len, bytes_of::<half::bf16>))
    }
    fn half_ptr(&self, half: &MetaCounted) -> PeerPtr {
        PeerPtr {
            addr: 0,
            len: half.len,
        }
    }
    unsafe fn cast_to_half_ptr(
        &self,
        half: DType,
        src: &MetaCounted,
        src_offset: usize,
        dst: PeerPtr,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        half_type(half)?;
        check_cast("source", src_offset, len, src.len)?;
        check_cast("destination", dst_offset, len, dst.len)
    }
    unsafe fn widen_half_ptr(
        &self,
        half: DType,
        _: PeerPtr,
        _: usize,
        dst: &mut MetaCounted,
        _: usize,
        _: usize,
    ) -> Result<(), KernelError> {
        half_type(half)?;
        write(&mut [dst]);
        Ok(())
    }
    unsafe fn reduce_half_from_peers(
        &self,
        half: DType,
        _: ReduceKind,
        _: &[(PeerPtr, usize)],
        dst: &mut MetaCounted,
        _: usize,
        _: usize,
    ) -> Result<(), KernelError> {
        half_type(half)?;
        write(&mut [dst]);
        Ok(())
    }

    fn peer_ptr(&self, buf: &MetaCounted) -> PeerPtr {
        PeerPtr {
            addr: 0,
            len: buf.len,
        }
    }
    fn scalars_ptr(&self, scalars: &Counted<Vec<f64>>) -> PeerPtr {
        PeerPtr {
            addr: 0,
            len: scalars.len(),
        }
    }
    fn record_event(&self) -> Result<(), KernelError> {
        Ok(())
    }
    fn wait_event(&self, _: &()) -> Result<(), KernelError> {
        Ok(())
    }
    unsafe fn copy_from_peer(
        &self,
        _: PeerPtr,
        _: usize,
        dst: &mut MetaCounted,
        _: usize,
        _: usize,
    ) -> Result<(), KernelError> {
        write(&mut [dst]);
        Ok(())
    }
    unsafe fn reduce_from_peers(
        &self,
        _: ReduceKind,
        _: &[(PeerPtr, usize)],
        dst: &mut MetaCounted,
        _: usize,
        _: usize,
    ) -> Result<(), KernelError> {
        write(&mut [dst]);
        Ok(())
    }
    unsafe fn reduce_scalars_from_peers(
        &self,
        _: ReduceKind,
        _: &[(PeerPtr, usize)],
        dst: &mut Counted<Vec<f64>>,
        _: usize,
        _: usize,
    ) -> Result<(), KernelError> {
        let _: &mut Vec<f64> = dst;
        Ok(())
    }
}
