//! The pattern of [`Harness::write_pattern`](super::Harness::write_pattern) on blocks of host
//! memory (the host and shared-host sources).

use super::PATTERN;

/// Write `byte` into the first and last [`PATTERN`] bytes of the `size` bytes at `ptr`.
///
/// # Safety
/// `ptr` is host memory writable for `size` bytes that nothing else touches meanwhile.
pub unsafe fn write_host_pattern(ptr: *mut u8, size: usize, byte: u8) {
    let n = PATTERN.min(size);
    // SAFETY: n <= size, and the caller owns the `size` bytes at `ptr`.
    unsafe {
        std::ptr::write_bytes(ptr, byte, n);
        std::ptr::write_bytes(ptr.add(size - n), byte, n);
    }
}

/// Whether the first and last [`PATTERN`] bytes of the `size` bytes at `ptr` hold `byte`.
///
/// # Safety
/// `ptr` is initialised host memory readable for `size` bytes that nothing writes meanwhile.
pub unsafe fn check_host_pattern(ptr: *const u8, size: usize, byte: u8) -> bool {
    let n = PATTERN.min(size);
    // SAFETY: n <= size, and the caller's bytes are initialised and not written meanwhile.
    let (head, tail) = unsafe {
        (
            std::slice::from_raw_parts(ptr, n),
            std::slice::from_raw_parts(ptr.add(size - n), n),
        )
    };
    head.iter().chain(tail).all(|&x| x == byte)
}
