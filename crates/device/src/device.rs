use std::fmt;

/// Where memory lives and work runs. More devices may come (the enum is `#[non_exhaustive]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory and CPU streams.
    Cpu,
    /// A CUDA device, by ordinal.
    Cuda(usize),
    /// No memory at all (PyTorch's `device="meta"`): storage has a size but no bytes, and its
    /// address is only an identifier, never dereferenced. Used to run code for its shapes, sizes
    /// and allocator statistics without data (see [`Buffer::meta`](crate::Buffer::meta)).
    Meta,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Meta => f.write_str("meta"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_print_like_pytorch() {
        assert_eq!(Device::Cpu.to_string(), "cpu");
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert_eq!(Device::Meta.to_string(), "meta");
    }
}
