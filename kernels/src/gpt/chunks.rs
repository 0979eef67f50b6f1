//! What [`Attention::Chunked`](super::Attention) and [`Logits::Chunked`](super::Logits) share:
//! how many items of f32 matrices fit in a chunk of bytes, and how the chunk is written.

/// The items of one chunk of at most `max_bytes`, an item holding `elements` f32 (at least
/// one item a chunk), out of `items` (all of them when fewer).
pub(super) fn chunk_items(max_bytes: usize, elements: usize, items: usize) -> usize {
    let each = elements.saturating_mul(4).max(1);
    (max_bytes / each).clamp(1, items.max(1))
}

/// The bytes of a chunk named `chunked` (`default`) or `chunked:N` (N MiB, at least 1); `None`
/// for any other name.
pub(super) fn parse_chunked(s: &str, default: usize) -> Option<Result<usize, String>> {
    if s == "chunked" {
        return Some(Ok(default));
    }
    let mib = s.strip_prefix("chunked:")?;
    Some(match mib.parse::<usize>() {
        Ok(n) if n > 0 && n <= (usize::MAX >> 20) => Ok(n << 20),
        _ => Err(format!(
            "{s:?}: the chunk's size is a whole number of MiB, at least 1 (e.g. chunked:256)"
        )),
    })
}

/// `chunked (N MiB)`, or `chunked (N B)` when `max_bytes` is not whole MiB.
pub(super) fn write_chunked(f: &mut std::fmt::Formatter<'_>, max_bytes: usize) -> std::fmt::Result {
    if max_bytes % (1 << 20) == 0 {
        write!(f, "chunked ({} MiB)", max_bytes >> 20)
    } else {
        write!(f, "chunked ({max_bytes} B)")
    }
}
