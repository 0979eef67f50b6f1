//! The store's operations, in either protocol ([`StoreProtocol`]).

use std::time::Duration;

use crate::{CollectiveError, Result};

use super::torch_wire::{self, read_bytes, read_i64, Msg, Query};
use super::wire::{millis, Dec, Enc, Op, Reply};
use super::{StoreProtocol, TcpStore, REPLY_MARGIN};

impl TcpStore {
    fn torch(&self) -> bool {
        self.inner.me.protocol == StoreProtocol::Torch
    }

    /// `key` with this handle's prefix.
    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.inner.key_prefix)
    }

    /// `key` without this handle's prefix (for messages).
    fn short(&self, key: String) -> String {
        match key.strip_prefix(self.inner.key_prefix.as_str()) {
            Some(k) => k.to_string(),
            None => key,
        }
    }

    /// Sets `key` to `value` (replacing any value) and wakes the ranks waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.full(key);
        self.check_size("set", key.len() + value.len())?;
        if self.torch() {
            return self.torch_call("set", None, |s, _| {
                Msg::query(Query::Set)
                    .bytes(key.as_bytes())
                    .bytes(value)
                    .send(s)
            });
        }
        let req = Enc::new(Op::Set)
            .bytes(key.as_bytes())
            .bytes(value)
            .finish();
        self.request("set", &req, None)?.expect_ok(self, "set")?;
        Ok(())
    }

    /// Appends `value` to the value of `key` (an absent key counts as empty).
    pub fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.full(key);
        self.check_size("append", key.len() + value.len())?;
        if self.torch() {
            return self.torch_call("append", None, |s, _| {
                Msg::query(Query::Append)
                    .bytes(key.as_bytes())
                    .bytes(value)
                    .send(s)
            });
        }
        let req = Enc::new(Op::Append)
            .bytes(key.as_bytes())
            .bytes(value)
            .finish();
        self.request("append", &req, None)?
            .expect_ok(self, "append")?;
        Ok(())
    }

    /// Sets every `keys[i]` to `values[i]`. Their counts must agree.
    pub fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<()> {
        if keys.len() != values.len() {
            return Err(CollectiveError::InvalidArgument {
                rank: self.inner.rank,
                op: "multi_set",
                reason: format!("{} keys but {} values", keys.len(), values.len()),
            });
        }
        let keys: Vec<String> = keys.iter().map(|k| self.full(k)).collect();
        let size = keys.iter().zip(values).map(|(k, v)| k.len() + v.len() + 16);
        self.check_size("multi_set", size.sum())?;
        if self.torch() {
            let mut m = Msg::query(Query::MultiSet).i64(keys.len() as i64);
            for (k, v) in keys.iter().zip(values) {
                m = m.bytes(k.as_bytes()).bytes(v);
            }
            return self.torch_call("multi_set", None, |s, _| m.send(s));
        }
        let mut e = Enc::new(Op::MultiSet).u64(keys.len() as u64);
        for (k, v) in keys.iter().zip(values) {
            e = e.bytes(k.as_bytes()).bytes(v);
        }
        self.request("multi_set", &e.finish(), None)?
            .expect_ok(self, "multi_set")?;
        Ok(())
    }

    /// The value of `key`, waiting up to [`timeout`](Self::timeout) for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.inner.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set. On timeout:
    /// [`CollectiveError::Store`] (`op: "get"`) naming the key.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut values = self.multi_get_timeout("get", &[key], timeout)?;
        Ok(values.pop().unwrap_or_default())
    }

    /// The values of `keys`, waiting up to [`timeout`](Self::timeout) for all of them.
    pub fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        self.multi_get_timeout("multi_get", keys, self.inner.timeout)
    }

    fn multi_get_timeout(
        &self,
        op: &'static str,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let full: Vec<String> = keys.iter().map(|k| self.full(k)).collect();
        self.check_size(op, full.iter().map(|k| k.len() + 8).sum())?;
        let timed_out = |missing: Vec<String>| {
            let missing: Vec<String> = missing.into_iter().map(|k| self.short(k)).collect();
            let what = match missing.as_slice() {
                [one] => format!("key {one:?}"),
                many => format!("keys {many:?}"),
            };
            self.store_err(
                op,
                format!(
                    "{what} did not appear within {timeout:?} (store at {})",
                    self.inner.address
                ),
            )
        };
        if self.torch() {
            let got = self.torch_call(op, Some(timeout), |s, deadline| {
                if let Some(missing) = torch_wire::client_wait(s, &full, timeout, REPLY_MARGIN)? {
                    return Ok(Err(missing));
                }
                let mut values = Vec::with_capacity(full.len());
                if let [one] = full.as_slice() {
                    Msg::query(Query::Get).bytes(one.as_bytes()).send(s)?;
                } else {
                    Msg::query(Query::MultiGet).keys(&full).send(s)?;
                }
                for _ in &full {
                    values.push(read_bytes(s, deadline)?);
                }
                Ok(Ok(values))
            })?;
            return got.map_err(timed_out);
        }
        let req = Enc::new(Op::MultiGet)
            .strs(&full.iter().map(String::as_str).collect::<Vec<_>>())
            .u64(millis(timeout))
            .finish();
        match self.request(op, &req, Some(timeout))? {
            Reply::Ok(body) => {
                let mut d = Dec::new(&body);
                let values = (|| {
                    let n = d.u32()? as usize;
                    let v = (0..n.min(full.len()))
                        .map(|_| d.bytes().map(<[u8]>::to_vec))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    d.end()?;
                    Ok(v)
                })()
                .map_err(|e: String| self.protocol(op, e))?;
                if values.len() != full.len() {
                    return Err(self.protocol(op, format!("{} values", values.len())));
                }
                Ok(values)
            }
            Reply::TimedOut(missing) => Err(timed_out(missing)),
            Reply::Error(msg) => Err(self.server_err(op, msg)),
            Reply::Stopping(msg) => Err(self.server_stopping(op, msg)),
        }
    }

    /// The value of `key` if it is set, without waiting.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let key = self.full(key);
        self.check_size("try_get", key.len())?;
        if self.torch() {
            return self.torch_call("try_get", None, |s, deadline| {
                let k = std::slice::from_ref(&key);
                if !torch_wire::client_check(s, k, deadline)? {
                    return Ok(None);
                }
                Msg::query(Query::Get).bytes(key.as_bytes()).send(s)?;
                read_bytes(s, deadline).map(Some)
            });
        }
        let req = Enc::new(Op::TryGet).bytes(key.as_bytes()).finish();
        let body = self
            .request("try_get", &req, None)?
            .expect_ok(self, "try_get")?;
        let mut d = Dec::new(&body);
        let present = d.u8().map_err(|e| self.protocol("try_get", e))?;
        let value = d.bytes().map_err(|e| self.protocol("try_get", e))?;
        Ok((present != 0).then(|| value.to_vec()))
    }

    /// Adds `delta` to the integer counter `key` (absent counts as 0) and returns the new value.
    /// The value is stored as decimal text, so [`get`](Self::get) of a counter gives e.g. `b"5"`.
    /// A key that holds something else than an integer is an error.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let key = self.full(key);
        self.check_size("add", key.len())?;
        if self.torch() {
            return self.torch_call("add", None, |s, deadline| {
                Msg::query(Query::Add)
                    .bytes(key.as_bytes())
                    .i64(delta)
                    .send(s)?;
                read_i64(s, deadline)
            });
        }
        let req = Enc::new(Op::Add).bytes(key.as_bytes()).i64(delta).finish();
        let body = self.request("add", &req, None)?.expect_ok(self, "add")?;
        Dec::new(&body).i64().map_err(|e| self.protocol("add", e))
    }

    /// Atomically replaces the value of `key` by `desired` if it equals `expected`, and returns
    /// the value after the operation (PyTorch's semantics): `desired` when it was swapped, else
    /// the current value. If the key is absent and `expected` is empty, the key is created with
    /// `desired`; if it is absent and `expected` is not empty, nothing is set and `expected` is
    /// returned.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let key = self.full(key);
        self.check_size("compare_set", key.len() + expected.len() + desired.len())?;
        if self.torch() {
            return self.torch_call("compare_set", None, |s, deadline| {
                Msg::query(Query::CompareSet)
                    .bytes(key.as_bytes())
                    .bytes(expected)
                    .bytes(desired)
                    .send(s)?;
                read_bytes(s, deadline)
            });
        }
        let req = Enc::new(Op::CompareSet)
            .bytes(key.as_bytes())
            .bytes(expected)
            .bytes(desired)
            .finish();
        let body = self
            .request("compare_set", &req, None)?
            .expect_ok(self, "compare_set")?;
        let mut d = Dec::new(&body);
        Ok(d.bytes()
            .map_err(|e| self.protocol("compare_set", e))?
            .to_vec())
    }

    /// Waits up to `timeout` until every key of `keys` is set. On timeout:
    /// [`CollectiveError::Store`] (`op: "wait"`) naming the keys still missing.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        match self.wait_missing("wait", keys, timeout)? {
            None => Ok(()),
            Some(missing) => Err(self.store_err(
                "wait",
                format!(
                    "keys {missing:?} did not appear within {timeout:?} ({} of {} keys present; \
                     store at {})",
                    keys.len() - missing.len(),
                    keys.len(),
                    self.inner.address
                ),
            )),
        }
    }

    /// Whether every key of `keys` is set (no waiting).
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let keys: Vec<String> = keys.iter().map(|k| self.full(k)).collect();
        self.check_size("check", keys.iter().map(|k| k.len() + 8).sum())?;
        if self.torch() {
            return self.torch_call("check", None, |s, deadline| {
                torch_wire::client_check(s, &keys, deadline)
            });
        }
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let req = Enc::new(Op::Check).strs(&refs).finish();
        let body = self
            .request("check", &req, None)?
            .expect_ok(self, "check")?;
        Ok(Dec::new(&body)
            .u8()
            .map_err(|e| self.protocol("check", e))?
            != 0)
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete_key(&self, key: &str) -> Result<bool> {
        let key = self.full(key);
        self.check_size("delete_key", key.len())?;
        if self.torch() {
            return self.torch_call("delete_key", None, |s, deadline| {
                Msg::query(Query::DeleteKey).bytes(key.as_bytes()).send(s)?;
                Ok(read_i64(s, deadline)? == 1)
            });
        }
        let req = Enc::new(Op::Delete).bytes(key.as_bytes()).finish();
        let body = self
            .request("delete_key", &req, None)?
            .expect_ok(self, "delete_key")?;
        Ok(Dec::new(&body)
            .u8()
            .map_err(|e| self.protocol("delete_key", e))?
            != 0)
    }

    /// The number of keys in the store (all of them, whatever their prefix, barrier and
    /// counter keys included).
    pub fn num_keys(&self) -> Result<usize> {
        if self.torch() {
            let n = self.torch_call("num_keys", None, |s, deadline| {
                Msg::query(Query::GetNumKeys).send(s)?;
                read_i64(s, deadline)
            })?;
            return Ok(usize::try_from(n).unwrap_or(0));
        }
        let req = Enc::new(Op::NumKeys).finish();
        let body = self
            .request("num_keys", &req, None)?
            .expect_ok(self, "num_keys")?;
        let n = Dec::new(&body)
            .u64()
            .map_err(|e| self.protocol("num_keys", e))?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// Waits until every rank `0..world_size` has reached the barrier `name`: sets
    /// `{name}/{rank}`, then waits up to `timeout` for the keys of all ranks. On timeout:
    /// [`CollectiveError::MissingRanks`] listing exactly the ranks whose keys are absent.
    ///
    /// The keys stay in the store, so a barrier name can be used once: use a fresh name (e.g.
    /// with a counter) for each barrier.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let keys: Vec<String> = (0..self.inner.world_size)
            .map(|r| format!("{name}/{r}"))
            .collect();
        self.set(&keys[self.inner.rank], b"1")?;
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match self.wait_missing("barrier", &refs, timeout)? {
            None => Ok(()),
            Some(missing_keys) => {
                let mut missing: Vec<usize> = missing_keys
                    .iter()
                    .filter_map(|k| keys.iter().position(|x| x == k))
                    .collect();
                missing.sort_unstable();
                Err(CollectiveError::MissingRanks {
                    rank: self.inner.rank,
                    missing,
                    waited: timeout,
                    what: format!(
                        "barrier {name:?}: keys {name}/{{rank}} in the store at {}",
                        self.inner.address
                    ),
                })
            }
        }
    }

    /// Server-side wait; `Some(missing keys)` (without the prefix) on timeout.
    fn wait_missing(
        &self,
        op: &'static str,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Option<Vec<String>>> {
        let full: Vec<String> = keys.iter().map(|k| self.full(k)).collect();
        self.check_size(op, full.iter().map(|k| k.len() + 8).sum())?;
        let missing = if self.torch() {
            self.torch_call(op, Some(timeout), |s, _| {
                torch_wire::client_wait(s, &full, timeout, REPLY_MARGIN)
            })?
        } else {
            let refs: Vec<&str> = full.iter().map(String::as_str).collect();
            let req = Enc::new(Op::Wait).strs(&refs).u64(millis(timeout)).finish();
            match self.request(op, &req, Some(timeout))? {
                Reply::Ok(_) => None,
                Reply::TimedOut(missing) => Some(missing),
                Reply::Error(msg) => return Err(self.server_err(op, msg)),
                Reply::Stopping(msg) => return Err(self.server_stopping(op, msg)),
            }
        };
        Ok(missing.map(|m| m.into_iter().map(|k| self.short(k)).collect()))
    }
}
