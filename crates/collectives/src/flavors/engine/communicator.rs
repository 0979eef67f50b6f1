//! [`engine_communicator!`]: the [`Communicator`](crate::Communicator) implementation of every
//! backend built on the engine, written once.

/// Implement [`Communicator`](crate::Communicator) for a backend type wrapping an [`Engine`] in
/// its `engine` field; `$split` is its inherent split returning `Result<Option<Self>>`.
macro_rules! engine_communicator {
    ($ty:ty, $split:ident) => {
        impl $crate::Communicator for $ty {
            fn rank(&self) -> usize {
                self.engine.rank()
            }
            fn world_size(&self) -> usize {
                self.engine.world_size()
            }
            fn stream(&self) -> &fsdp_device::Stream {
                self.engine.stream()
            }
            fn all_gather_base(
                &self,
                input: &fsdp_device::Buffer,
                output: &fsdp_device::Buffer,
            ) -> $crate::Result<$crate::Work> {
                self.engine.all_gather_base(input, output)
            }
            fn reduce_scatter_base(
                &self,
                input: &fsdp_device::Buffer,
                output: &fsdp_device::Buffer,
                op: $crate::ReduceOp,
            ) -> $crate::Result<$crate::Work> {
                self.engine.reduce_scatter_base(input, output, op)
            }
            fn all_reduce(
                &self,
                buf: &fsdp_device::Buffer,
                op: $crate::ReduceOp,
            ) -> $crate::Result<$crate::Work> {
                self.engine.all_reduce(buf, op)
            }
            fn broadcast(
                &self,
                buf: &fsdp_device::Buffer,
                root: usize,
            ) -> $crate::Result<$crate::Work> {
                self.engine.broadcast(buf, root)
            }
            fn reduce(
                &self,
                buf: &fsdp_device::Buffer,
                op: $crate::ReduceOp,
                root: usize,
            ) -> $crate::Result<$crate::Work> {
                self.engine.reduce(buf, op, root)
            }
            fn barrier(&self) -> $crate::Result<$crate::Work> {
                self.engine.barrier()
            }
            fn all_gather(
                &self,
                input: &fsdp_device::Buffer,
                outputs: &[fsdp_device::Buffer],
            ) -> $crate::Result<$crate::Work> {
                self.engine.all_gather(input, outputs)
            }
            fn split(
                &self,
                color: Option<u32>,
                key: usize,
            ) -> $crate::Result<Option<Box<dyn $crate::Communicator>>> {
                Ok(self
                    .$split(color, key)?
                    .map(|c| Box::new(c) as Box<dyn $crate::Communicator>))
            }
            fn abort_handle(&self) -> Option<$crate::AbortHandle> {
                Some(self.engine.abort_handle())
            }
            fn prefers_shared_host_memory(&self) -> bool {
                self.engine.reads_shared_regions()
            }
            fn orders_stream_ordered_buffers(&self) -> bool {
                true
            }
        }
    };
}
pub(crate) use engine_communicator;
