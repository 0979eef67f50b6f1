//! Running under torchrun (torchelastic's agent): its store, its attempts, its error files.
//!
//! torchrun's agent hosts a PyTorch `TCPStore` at `MASTER_ADDR:MASTER_PORT` and tells its
//! workers so with `TORCHELASTIC_USE_AGENT_STORE=True`: then every rank, rank 0 included, joins
//! that store as a client speaking PyTorch's protocol
//! ([`StoreProtocol::Torch`](crate::store::StoreProtocol::Torch)), under the prefix PyTorch's
//! workers use for the attempt ([`attempt_key_prefix`]), so that a restarted attempt never reads
//! the keys of the one before. PyTorch's store has no authentication: the data links between
//! ranks use the job token when `FSDP_JOB_TOKEN` (or `FSDP_JOB_TOKEN_FILE`) is inherited from
//! torchrun's environment; without one they are unauthenticated, and
//! [`LaunchEnv::rendezvous`](crate::LaunchEnv::rendezvous) then accepts only a loopback
//! `MASTER_ADDR` (a single-node job).
//!
//! A rank that fails writes `TORCHELASTIC_ERROR_FILE` in torchelastic's format
//! ([`write_error_file`]); torchrun's summary shows the message of the failure with the earliest
//! timestamp as the root cause.

use std::time::{SystemTime, UNIX_EPOCH};

/// `True` when the agent hosts the store and the workers join it.
pub const USE_AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// The attempt: 0, then one more after each restart (`torchrun --max-restarts`).
pub const RESTART_COUNT_ENV: &str = "TORCHELASTIC_RESTART_COUNT";
/// Where a failing worker writes its error for the agent's summary.
pub const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// The prefix of every key of attempt `restart_count` in the agent's store: PyTorch's workers
/// wrap it in `PrefixStore("/worker/attempt_{n}")` over a `TCPStore` (which prepends `/`), so
/// their key `k` is `//worker/attempt_{n}/k` on the wire, and so is ours.
pub fn attempt_key_prefix(restart_count: usize) -> String {
    format!(
        "{}/worker/attempt_{restart_count}/",
        crate::store::TCPSTORE_KEY_PREFIX
    )
}

/// Whether `value` of [`USE_AGENT_STORE_ENV`] says yes (PyTorch writes `True`).
pub fn says_true(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "true" | "1" | "yes"
    )
}

/// The contents of torchelastic's error file for `message` at `timestamp` (seconds since the
/// epoch): `{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}`.
pub fn error_file_json(message: &str, timestamp: u64) -> String {
    serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": message,
                "timestamp": timestamp.to_string(),
            }
        }
    })
    .to_string()
}

/// Writes this rank's error to [`ERROR_FILE_ENV`] if torchrun set it (errors of the write are
/// ignored: torchrun then reports the exit status alone).
pub fn write_error_file(message: &str) {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV) else {
        return;
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if let Some(dir) = std::path::Path::new(&path).parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = std::fs::write(path, error_file_json(message, now));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_is_pytorchs() {
        assert_eq!(attempt_key_prefix(0), "//worker/attempt_0/");
        assert_eq!(attempt_key_prefix(3), "//worker/attempt_3/");
        assert!(says_true("True") && says_true("1") && !says_true("False"));
    }

    #[test]
    fn error_file_has_torchelastics_shape() {
        let v: serde_json::Value =
            serde_json::from_str(&error_file_json("rank 1: \"x\" failed", 1700000000)).unwrap();
        assert_eq!(v["message"]["message"], "rank 1: \"x\" failed");
        assert_eq!(v["message"]["extraInfo"]["timestamp"], "1700000000");
        assert!(v["message"]["extraInfo"]["py_callstack"].is_string());
    }
}
