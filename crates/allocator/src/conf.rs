//! PyTorch's allocator settings text (`PYTORCH_CUDA_ALLOC_CONF`, and `PYTORCH_ALLOC_CONF`
//! that newer PyTorch reads first) read into an [`AllocatorConfig`].
//!
//! See [`AllocatorConfig::from_pytorch_conf`] for the syntax and the keys.

use crate::{AllocError, AllocatorConfig, LARGE_BUFFER, ROUNDUP_POWER2_INTERVALS};

/// Which allocator PyTorch's `backend` setting names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AllocatorBackend {
    /// `backend:native`, the default: the caching allocator.
    #[default]
    Native,
    /// `backend:cudaMallocAsync`: the CUDA driver's stream-ordered allocator
    /// (`cuMemAllocAsync` on the device's default memory pool).
    CudaMallocAsync,
}

impl std::fmt::Display for AllocatorBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AllocatorBackend::Native => "native",
            AllocatorBackend::CudaMallocAsync => "cudaMallocAsync",
        })
    }
}

/// The environment variables [`AllocatorConfig::from_env`] reads, the first one set (and not
/// empty) winning, as in newer PyTorch (`PYTORCH_CUDA_ALLOC_CONF` is its older name).
pub const ALLOC_CONF_ENV_VARS: [&str; 2] = ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"];

const MIB: usize = 1 << 20;
/// PyTorch's `pinned_max_register_threads()`.
const PINNED_MAX_REGISTER_THREADS: u64 = 128;

/// Keys PyTorch knows that this allocator accepts and ignores (value kind, what it is).
const IGNORED: [(&str, Ignored); 11] = [
    ("max_non_split_rounding_mb", Ignored::MinMib(20)),
    ("large_segment_size_mb", Ignored::Integer),
    ("release_lock_on_cudamalloc", Ignored::Bool),
    ("release_lock_on_hipmalloc", Ignored::Bool),
    ("pinned_use_cuda_host_register", Ignored::Bool),
    ("pinned_use_hip_host_register", Ignored::Bool),
    ("pinned_num_register_threads", Ignored::Threads),
    ("pinned_reserve_segment_size_mb", Ignored::Positive),
    ("pinned_use_background_threads", Ignored::Bool),
    ("graph_capture_record_stream_reuse", Ignored::Bool),
    ("pinned_use_device_host_register", Ignored::Bool),
];

#[derive(Clone, Copy)]
enum Ignored {
    Bool,
    Integer,
    MinMib(u64),
    Threads,
    Positive,
}

fn is_separator(t: &str) -> bool {
    matches!(t, "," | ":" | "[" | "]")
}

/// PyTorch's `ConfigTokenizer`: `, : [ ]` are tokens of their own, whitespace is dropped,
/// everything else runs together.
fn tokenize(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut buf = String::new();
    for ch in text.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !buf.is_empty() {
                tokens.push(std::mem::take(&mut buf));
            }
            tokens.push(ch.to_string());
        } else if !(ch.is_ascii_whitespace() || ch == '\x0b') {
            buf.push(ch);
        }
    }
    if !buf.is_empty() {
        tokens.push(buf);
    }
    tokens
}

fn conf_error(key: &str, value: &str, reason: impl Into<String>) -> AllocError {
    AllocError::AllocConf {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// A decimal integer that is the whole token.
fn integer(key: &str, value: &str, token: &str) -> Result<u64, AllocError> {
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_digit()) {
        return Err(conf_error(
            key,
            value,
            format!("`{token}` is not an integer"),
        ));
    }
    token
        .parse()
        .map_err(|_| conf_error(key, value, format!("`{token}` is too large")))
}

fn boolean(key: &str, value: &str) -> Result<bool, AllocError> {
    match value {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(conf_error(key, value, "expected `True` or `False`")),
    }
}

/// One `key:value` pair: the key, the value's tokens (one, or a bracketed list with its
/// brackets), and the index after it.
fn next_pair(tokens: &[String], mut i: usize) -> Result<(&str, &[String], usize), AllocError> {
    let key = tokens[i].as_str();
    if is_separator(key) {
        return Err(conf_error(
            key,
            "",
            format!("expected an option name at token {i}, got `{key}`"),
        ));
    }
    i += 1;
    if tokens.get(i).map(String::as_str) != Some(":") {
        return Err(conf_error(
            key,
            "",
            "expected `:` and a value after the key",
        ));
    }
    i += 1;
    let start = i;
    match tokens.get(i).map(String::as_str) {
        None | Some(",") | Some(":") | Some("]") => {
            return Err(conf_error(key, "", "expected a value after `:`"));
        }
        Some("[") => {
            while i < tokens.len() && tokens[i] != "]" {
                i += 1;
            }
            if i == tokens.len() {
                let value = tokens[start..].concat();
                return Err(conf_error(key, &value, "expected a closing `]`"));
            }
        }
        Some(_) => {}
    }
    Ok((key, &tokens[start..=i], i + 1))
}

/// `roundup_power2_divisions`'s value, exactly as PyTorch's `parseRoundUpPower2Divisions`.
fn roundup_divisions(
    value_tokens: &[String],
    value: &str,
) -> Result<[usize; ROUNDUP_POWER2_INTERVALS], AllocError> {
    const KEY: &str = "roundup_power2_divisions";
    let mut out = [0usize; ROUNDUP_POWER2_INTERVALS];
    if value_tokens.len() == 1 {
        // The old form: one number of divisions for every interval.
        let d = integer(KEY, value, &value_tokens[0])?;
        if !d.is_power_of_two() {
            return Err(conf_error(KEY, value, "the divisions must be a power of 2"));
        }
        let d = usize::try_from(d).map_err(|_| conf_error(KEY, value, "too large"))?;
        return Ok([d; ROUNDUP_POWER2_INTERVALS]);
    }
    // `[` entries `]`, each entry `interval:divisions` with `,` between.
    let inner = &value_tokens[1..value_tokens.len() - 1];
    let mut first = true;
    let mut last_index = 0usize;
    let mut j = 0;
    while j < inner.len() {
        let (Some(bound), Some(colon), Some(div)) =
            (inner.get(j), inner.get(j + 1), inner.get(j + 2))
        else {
            return Err(conf_error(
                KEY,
                value,
                "expected `interval:divisions` entries",
            ));
        };
        if colon != ":" {
            return Err(conf_error(
                KEY,
                value,
                format!("expected `:` after `{bound}`"),
            ));
        }
        let d = integer(KEY, value, div)?;
        if d != 0 && !d.is_power_of_two() {
            return Err(conf_error(
                KEY,
                value,
                format!("the divisions must be a power of 2 or 0 (off), got {d}"),
            ));
        }
        let d = usize::try_from(d).map_err(|_| conf_error(KEY, value, "too large"))?;
        if bound == ">" {
            // Every interval after the last one named.
            for slot in out.iter_mut().skip(last_index + 1) {
                *slot = d;
            }
        } else {
            let b = integer(KEY, value, bound)?;
            if !b.is_power_of_two() {
                return Err(conf_error(
                    KEY,
                    value,
                    format!("the intervals (MiB) must be powers of 2, got {b}"),
                ));
            }
            let index = (b.ilog2() as usize).min(ROUNDUP_POWER2_INTERVALS - 1);
            if first {
                // The first entry also covers every interval below it.
                for slot in &mut out[..index] {
                    *slot = d;
                }
                first = false;
            }
            out[index] = d;
            last_index = index;
        }
        j += 3;
        if j < inner.len() {
            if inner[j] != "," {
                return Err(conf_error(
                    KEY,
                    value,
                    format!("expected `,` between entries, got `{}`", inner[j]),
                ));
            }
            j += 1;
        }
    }
    Ok(out)
}

fn check_ignored(
    key: &str,
    kind: Ignored,
    value_tokens: &[String],
    value: &str,
) -> Result<(), AllocError> {
    if value_tokens.len() != 1 {
        return Err(conf_error(
            key,
            value,
            "expected a single value, not a list",
        ));
    }
    let token = &value_tokens[0];
    match kind {
        Ignored::Bool => {
            boolean(key, token)?;
        }
        Ignored::Integer => {
            integer(key, value, token)?;
        }
        Ignored::MinMib(min) => {
            let n = integer(key, value, token)?;
            if n < min {
                return Err(conf_error(
                    key,
                    value,
                    format!("too small, must be >= {min}"),
                ));
            }
        }
        Ignored::Threads => {
            let n = integer(key, value, token)?;
            if !n.is_power_of_two() || n > PINNED_MAX_REGISTER_THREADS {
                return Err(conf_error(
                    key,
                    value,
                    format!("must be a power of 2 of at most {PINNED_MAX_REGISTER_THREADS}"),
                ));
            }
        }
        Ignored::Positive => {
            if integer(key, value, token)? == 0 {
                return Err(conf_error(key, value, "must be greater than 0"));
            }
        }
    }
    Ok(())
}

impl AllocatorConfig {
    /// The defaults with PyTorch's allocator settings `text` applied (see
    /// [`apply_pytorch_conf`](Self::apply_pytorch_conf)); an empty text gives the defaults.
    ///
    /// The syntax is PyTorch's (`c10/core/AllocatorConfig.h`, `ConfigTokenizer`): comma-separated
    /// `key:value` pairs, a list value in square brackets, whitespace ignored anywhere, a
    /// trailing comma allowed, a later pair overriding an earlier one. The keys:
    ///
    /// | key | value | here |
    /// |---|---|---|
    /// | `max_split_size_mb` | MiB, an integer | [`AllocatorConfig::max_split_size`] |
    /// | `roundup_power2_divisions` | `N` (a power of two) or `[64:8,256:4,>:1]` | [`AllocatorConfig::roundup_power2_divisions`] |
    /// | `garbage_collection_threshold` | a number strictly between 0 and 1 | [`AllocatorConfig::garbage_collection_threshold`] |
    /// | `expandable_segments` | `True` or `False` | [`AllocatorConfig::expandable_segments`] |
    /// | `backend` | `native`; `cudaMallocAsync` (the CUDA driver's allocator) only through [`from_pytorch_conf_with_backend`](Self::from_pytorch_conf_with_backend), for users that offer it | [`AllocatorBackend`] |
    /// | `max_non_split_rounding_mb`, `large_segment_size_mb`, `release_lock_on_cudamalloc`, `pinned_use_cuda_host_register`, `pinned_num_register_threads`, `pinned_reserve_segment_size_mb`, `pinned_use_background_threads`, `graph_capture_record_stream_reuse` (and the `hip` and `device` spellings) | checked as PyTorch checks them | accepted and ignored, with a `tracing` warning |
    ///
    /// Any other key is an error naming it, as in PyTorch ("Unrecognized key"). Where this parser
    /// differs from PyTorch's, it is stricter: a number must be the whole token (PyTorch's
    /// `stoull("128MB")` reads 128), the `:` and `,` separators are checked (recent PyTorch
    /// ignores what `checkToken` answers), and `max_split_size_mb` must exceed 20, as older PyTorch
    /// required (the newer `c10/core/AllocatorConfig.cpp` accepts 20; this allocator's rules
    /// assume a limit above [`LARGE_BUFFER`]).
    ///
    /// ```
    /// use fsdp_allocator::AllocatorConfig;
    /// let c = AllocatorConfig::from_pytorch_conf(
    ///     "expandable_segments:True,max_split_size_mb:128,\
    ///      roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6",
    /// )?;
    /// assert!(c.expandable_segments);
    /// assert_eq!(c.max_split_size, Some(128 << 20));
    /// assert_eq!(c.garbage_collection_threshold, Some(0.6));
    /// assert_eq!(c.roundup_power2_divisions[8], 1); // 256 MiB to 512 MiB
    /// assert_eq!(c.roundup_power2_divisions[9], 2); // 512 MiB to 1 GiB
    /// assert_eq!(c.roundup_power2_divisions[10], 8); // above
    /// assert!(AllocatorConfig::from_pytorch_conf("max_split_mb:128").is_err());
    /// # Ok::<(), fsdp_allocator::AllocError>(())
    /// ```
    ///
    /// # Errors
    /// As [`apply_pytorch_conf`](Self::apply_pytorch_conf).
    pub fn from_pytorch_conf(text: &str) -> Result<Self, AllocError> {
        AllocatorConfig::default().apply_pytorch_conf(text)
    }

    /// This configuration with the options that PyTorch's allocator settings `text` name
    /// (`PYTORCH_CUDA_ALLOC_CONF` syntax, see
    /// [`from_pytorch_conf`](Self::from_pytorch_conf)) set; the
    /// others keep their values. A `roundup_power2_divisions` list sets every interval (those
    /// it does not cover are 0, off), as on a fresh PyTorch parse.
    ///
    /// # Errors
    /// [`AllocError::AllocConf`] naming the key and its value: an unknown key, a missing
    /// separator or value, a malformed or out-of-range value, `backend:cudaMallocAsync`
    /// (the driver's allocator, which a caching allocator is not: see
    /// [`from_pytorch_conf_with_backend`](Self::from_pytorch_conf_with_backend));
    /// [`AllocError::InvalidConfig`] if the result fails the allocator's checks.
    pub fn apply_pytorch_conf(self, text: &str) -> Result<Self, AllocError> {
        let (config, _) = self.apply_conf(text, false)?;
        Ok(config)
    }

    /// The defaults with PyTorch's allocator settings `text` applied, and the allocator
    /// backend it names: [`AllocatorBackend::CudaMallocAsync`] for `backend:cudaMallocAsync`
    /// (which [`from_pytorch_conf`](Self::from_pytorch_conf) refuses), else
    /// [`AllocatorBackend::Native`]. For users that can serve memory from the CUDA driver's
    /// stream-ordered allocator instead of a [`CachingAllocator`](crate::CachingAllocator), as
    /// PyTorch does under that setting; the other keys are checked either way (and, as in
    /// PyTorch, the caching allocator's options do nothing under the driver's).
    ///
    /// ```
    /// use fsdp_allocator::{AllocatorBackend, AllocatorConfig};
    /// let (c, b) = AllocatorConfig::from_pytorch_conf_with_backend("backend:cudaMallocAsync")?;
    /// assert_eq!((c, b), (AllocatorConfig::default(), AllocatorBackend::CudaMallocAsync));
    /// let (_, b) = AllocatorConfig::from_pytorch_conf_with_backend("expandable_segments:True")?;
    /// assert_eq!(b, AllocatorBackend::Native);
    /// # Ok::<(), fsdp_allocator::AllocError>(())
    /// ```
    ///
    /// # Errors
    /// As [`apply_pytorch_conf`](Self::apply_pytorch_conf), but for `backend:cudaMallocAsync`.
    pub fn from_pytorch_conf_with_backend(
        text: &str,
    ) -> Result<(AllocatorConfig, AllocatorBackend), AllocError> {
        AllocatorConfig::default().apply_conf(text, true)
    }

    fn apply_conf(
        mut self,
        text: &str,
        driver_ok: bool,
    ) -> Result<(AllocatorConfig, AllocatorBackend), AllocError> {
        let mut backend = AllocatorBackend::Native;
        let tokens = tokenize(text);
        let mut i = 0;
        while i < tokens.len() {
            let (key, value_tokens, next) = next_pair(&tokens, i)?;
            let value = value_tokens.concat();
            let single = value_tokens[0].as_str();
            let list = value_tokens.len() > 1;
            if list && key != "roundup_power2_divisions" {
                let known = matches!(
                    key,
                    "max_split_size_mb"
                        | "garbage_collection_threshold"
                        | "expandable_segments"
                        | "backend"
                ) || IGNORED.iter().any(|(k, _)| *k == key);
                let reason = if known {
                    "expected a single value, not a list"
                } else {
                    "unrecognized option"
                };
                return Err(conf_error(key, &value, reason));
            }
            match key {
                "max_split_size_mb" => {
                    let mb = integer(key, &value, single)?;
                    let min = (LARGE_BUFFER / MIB) as u64;
                    if mb <= min {
                        return Err(conf_error(
                            key,
                            &value,
                            format!("too small, must be > {min} (MiB)"),
                        ));
                    }
                    let mb = usize::try_from(mb)
                        .unwrap_or(usize::MAX)
                        .min(usize::MAX / MIB);
                    self.max_split_size = Some(mb * MIB);
                }
                "garbage_collection_threshold" => {
                    let t: f64 = single
                        .parse()
                        .map_err(|_| conf_error(key, &value, "not a number"))?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(conf_error(key, &value, "must lie strictly between 0 and 1"));
                    }
                    self.garbage_collection_threshold = Some(t);
                }
                "roundup_power2_divisions" => {
                    self.roundup_power2_divisions = roundup_divisions(value_tokens, &value)?;
                }
                "expandable_segments" => self.expandable_segments = boolean(key, single)?,
                "backend" => match single {
                    "native" => backend = AllocatorBackend::Native,
                    "cudaMallocAsync" if driver_ok => backend = AllocatorBackend::CudaMallocAsync,
                    "cudaMallocAsync" => {
                        return Err(conf_error(
                            key,
                            &value,
                            "not supported: this is the native caching allocator (use \
                             backend:native or leave the key out)",
                        ))
                    }
                    _ => {
                        return Err(conf_error(
                            key,
                            &value,
                            "unknown allocator backend, the options are native and \
                             cudaMallocAsync",
                        ))
                    }
                },
                _ => match IGNORED.iter().find(|(k, _)| *k == key) {
                    Some((_, kind)) => {
                        check_ignored(key, *kind, value_tokens, &value)?;
                        tracing::warn!(
                            "allocator option {key}:{value} is accepted and ignored (this \
                             allocator does not implement it)"
                        );
                    }
                    None => return Err(conf_error(key, &value, "unrecognized option")),
                },
            }
            i = next;
            if i < tokens.len() {
                if tokens[i] != "," {
                    return Err(conf_error(
                        key,
                        &value,
                        format!("expected `,` after the value, got `{}`", tokens[i]),
                    ));
                }
                i += 1;
            }
        }
        self.validate()?;
        Ok((self, backend))
    }

    /// The defaults with the allocator settings of the environment: the first of
    /// [`ALLOC_CONF_ENV_VARS`] that is set and not empty (`PYTORCH_ALLOC_CONF`, then
    /// `PYTORCH_CUDA_ALLOC_CONF`); none gives the defaults.
    ///
    /// # Errors
    /// As [`from_pytorch_conf`](Self::from_pytorch_conf); a variable that is not UTF-8.
    pub fn from_env() -> Result<Self, AllocError> {
        match alloc_conf_from_env()? {
            Some((_, text)) => AllocatorConfig::from_pytorch_conf(&text),
            None => Ok(AllocatorConfig::default()),
        }
    }

    /// The defaults with the allocator settings of the environment (as
    /// [`from_env`](Self::from_env)) and the backend they name (as
    /// [`from_pytorch_conf_with_backend`](Self::from_pytorch_conf_with_backend)).
    ///
    /// # Errors
    /// As [`from_pytorch_conf_with_backend`](Self::from_pytorch_conf_with_backend); a variable
    /// that is not UTF-8.
    pub fn from_env_with_backend() -> Result<(AllocatorConfig, AllocatorBackend), AllocError> {
        match alloc_conf_from_env()? {
            Some((_, text)) => AllocatorConfig::from_pytorch_conf_with_backend(&text),
            None => Ok((AllocatorConfig::default(), AllocatorBackend::Native)),
        }
    }

    /// These options as PyTorch's allocator settings text, which
    /// [`from_pytorch_conf`](Self::from_pytorch_conf) reads back to this configuration: the
    /// options that differ from the defaults, among `max_split_size_mb`,
    /// `roundup_power2_divisions`, `garbage_collection_threshold` and `expandable_segments`
    /// (the memory limit and the timeout have no key; they are left out).
    ///
    /// # Errors
    /// [`AllocError::InvalidConfig`] for a `max_split_size` that is not a whole number of MiB.
    pub fn to_pytorch_conf(&self) -> Result<String, AllocError> {
        let mut parts = Vec::new();
        if let Some(m) = self.max_split_size {
            if m % MIB != 0 {
                return Err(AllocError::InvalidConfig(format!(
                    "max_split_size {m} is not a whole number of MiB (max_split_size_mb)"
                )));
            }
            parts.push(format!("max_split_size_mb:{}", m / MIB));
        }
        let d = &self.roundup_power2_divisions;
        if d.iter().all(|&x| x == d[0]) {
            if d[0] != 0 {
                parts.push(format!("roundup_power2_divisions:{}", d[0]));
            }
        } else {
            let entries: Vec<String> = d
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    if i + 1 == ROUNDUP_POWER2_INTERVALS {
                        format!(">:{x}")
                    } else {
                        format!("{}:{x}", 1u64 << i)
                    }
                })
                .collect();
            parts.push(format!("roundup_power2_divisions:[{}]", entries.join(",")));
        }
        if let Some(t) = self.garbage_collection_threshold {
            parts.push(format!("garbage_collection_threshold:{t}"));
        }
        if self.expandable_segments {
            parts.push("expandable_segments:True".into());
        }
        Ok(parts.join(","))
    }
}

/// The allocator settings text of the environment: the first of [`ALLOC_CONF_ENV_VARS`] set
/// and not empty, with its name.
///
/// # Errors
/// [`AllocError::AllocConf`] for a variable whose value is not UTF-8.
pub fn alloc_conf_from_env() -> Result<Option<(&'static str, String)>, AllocError> {
    for name in ALLOC_CONF_ENV_VARS {
        match std::env::var(name) {
            Ok(text) if text.trim().is_empty() => {}
            Ok(text) => return Ok(Some((name, text))),
            Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(conf_error(name, &v.to_string_lossy(), "not UTF-8"))
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
#[path = "conf_tests.rs"]
mod tests;
