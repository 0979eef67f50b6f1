//! The exchange of the memory admission among the ranks of one host under a launcher
//! ([`HostGroup`]): at the rendezvous store, every rank publishes its prediction and the memory
//! it sees under a key scoped by the job and the host, waits for the host's other
//! `LOCAL_WORLD_SIZE` ranks, and adds up the same figures, so that every rank of the host
//! reaches the same verdict; a rank that fails first publishes its error instead, so that none
//! waits for it. [`crate::admission`] computes the figures and decides.

use std::cell::Cell;
use std::time::Duration;

use fsdp::human_bytes;
use fsdp::plan::AvailableMemory;
use fsdp_collectives::store::TcpStore;
use fsdp_collectives::LaunchEnv;

use crate::admission::overflow;
use crate::{fail, CliError};

/// The rounds of the exchange among the ranks of a host: the cheap lower bound, then the
/// plan's prediction.
const ROUNDS: [&str; 2] = ["lower-bound", "plan"];
pub(crate) const LOWER_BOUND: usize = 0;
pub(crate) const PLAN: usize = 1;

/// One rank's figure in a round of the exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Share {
    rank: usize,
    bytes: u64,
    /// The memory this rank sees (`None`: unknown on its system).
    available: Option<AvailableMemory>,
}

/// What a rank publishes in a round: its share, or the error that stopped it before.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    Share(Share),
    Failed { rank: usize, error: String },
}

impl Entry {
    /// `ok RANK BYTES AVAILABLE SOURCE` (`-` for an unknown available figure, no source) or
    /// `err RANK MESSAGE`.
    fn encode(&self) -> String {
        match self {
            Entry::Share(s) => match &s.available {
                Some(a) => format!("ok {} {} {} {}", s.rank, s.bytes, a.bytes, a.source),
                None => format!("ok {} {} -", s.rank, s.bytes),
            },
            Entry::Failed { rank, error } => format!("err {rank} {}", error.replace('\n', " ")),
        }
    }

    fn decode(v: &str) -> Option<Entry> {
        let mut f = v.splitn(3, ' ');
        let (kind, rank) = (f.next()?, f.next()?.parse().ok()?);
        let rest = f.next().unwrap_or("");
        match kind {
            "err" => Some(Entry::Failed {
                rank,
                error: rest.to_string(),
            }),
            "ok" => {
                let mut f = rest.splitn(3, ' ');
                let bytes = f.next()?.parse().ok()?;
                let available = match f.next()? {
                    "-" => None,
                    b => Some(AvailableMemory {
                        bytes: b.parse().ok()?,
                        source: f.next().unwrap_or("").to_string(),
                    }),
                };
                Some(Entry::Share(Share {
                    rank,
                    bytes,
                    available,
                }))
            }
            _ => None,
        }
    }
}

/// `rank 0 1.0 GiB, rank 1 1.0 GiB` for a few ranks; a summary for many.
pub(crate) fn list_shares(shares: &[Share]) -> String {
    const LISTED: usize = 8;
    if shares.len() <= LISTED {
        return shares
            .iter()
            .map(|s| format!("rank {} {}", s.rank, human_bytes(s.bytes)))
            .collect::<Vec<_>>()
            .join(", ");
    }
    let min = shares.iter().min_by_key(|s| s.bytes);
    let max = shares.iter().max_by_key(|s| s.bytes);
    match (min, max) {
        (Some(a), Some(b)) if a.bytes == b.bytes => {
            format!("{} ranks of {} each", shares.len(), human_bytes(a.bytes))
        }
        (Some(a), Some(b)) => format!(
            "{} ranks of {} (rank {}) to {} (rank {})",
            shares.len(),
            human_bytes(a.bytes),
            a.rank,
            human_bytes(b.bytes),
            b.rank
        ),
        _ => "no rank".to_string(),
    }
}

/// The ranks of this host under a launcher (`LOCAL_WORLD_SIZE` of them), met at the
/// rendezvous store (rank 0 hosts it), where they add up their predicted memory: in each round
/// every rank publishes its figure and the memory it sees under a key of the job, this host
/// and its local rank, waits (within the store's timeout) for the figures of the host's other
/// ranks, and adds them up as they all do, against the smallest memory any of them saw — so
/// every rank of the host reaches the same verdict. A rank that fails before it publishes
/// publishes its error instead ([`HostGroup::abandon`]), so that the others stop with it
/// rather than wait; one that dies is named when the timeout passes.
///
/// The host is the launcher's node identity, `GROUP_RANK` (set by `fsdp launch` and
/// torchrun), else the host name.
pub(crate) struct HostGroup {
    store: TcpStore,
    env: LaunchEnv,
    /// `node 0` or `host NAME`.
    host: String,
    /// `fsdp/admission/JOB/HOST`.
    prefix: String,
    /// Rounds published so far.
    published: Cell<usize>,
    /// Whether this rank said it is done with the store.
    left: Cell<bool>,
}

impl HostGroup {
    /// Meets the other ranks at the rendezvous store (every rank of the job; the ranks that
    /// never arrive are named after `timeout`).
    pub(crate) fn join(timeout: Duration) -> Result<HostGroup, CliError> {
        let env = LaunchEnv::from_env()?.ok_or_else(|| {
            fail("RANK and WORLD_SIZE are not set: no launcher started this rank")
        })?;
        let store = env.rendezvous(timeout)?;
        let var = |k: &str| {
            std::env::var(k)
                .ok()
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let (host, key) = match var("GROUP_RANK") {
            Some(g) => (format!("node {g}"), format!("node-{g}")),
            None => {
                let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
                    .filter(|h| !h.is_empty())
                    .or_else(|| var("HOSTNAME"))
                    .unwrap_or_else(|| "localhost".to_string());
                (format!("host {name}"), format!("host-{name}"))
            }
        };
        // The store is the job's; a torchrun job id scopes the keys further.
        let job = var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "job".to_string());
        Ok(HostGroup {
            store,
            env,
            host,
            prefix: format!("fsdp/admission/{job}/{key}"),
            published: Cell::new(0),
            left: Cell::new(false),
        })
    }

    /// The rendezvous store, which the communicator is built over.
    pub(crate) fn store(&self) -> &TcpStore {
        &self.store
    }

    /// The launcher's environment of this rank.
    pub(crate) fn env(&self) -> &LaunchEnv {
        &self.env
    }

    /// `the 2 ranks of node 0`.
    pub(crate) fn who(&self) -> String {
        match self.env.local_world_size {
            1 => format!("the 1 rank of {}", self.host),
            n => format!("the {n} ranks of {}", self.host),
        }
    }

    fn key(&self, round: usize, local_rank: usize) -> String {
        format!("{}/{}/{local_rank}", self.prefix, ROUNDS[round])
    }

    fn publish(&self, round: usize, entry: &Entry) -> Result<(), CliError> {
        self.published.set(round + 1);
        let key = self.key(round, self.env.local_rank);
        Ok(self.store.set(&key, entry.encode().as_bytes())?)
    }

    /// Publishes this rank's `bytes` and `available` for `round` and returns every rank's of
    /// this host, in local-rank order; an error when a rank of the host failed before it (its
    /// error quoted) or did not publish within the store's timeout.
    pub(crate) fn exchange(
        &self,
        round: usize,
        bytes: u64,
        available: Option<AvailableMemory>,
    ) -> Result<Vec<Share>, CliError> {
        let me = self.env.rank;
        self.publish(
            round,
            &Entry::Share(Share {
                rank: me,
                bytes,
                available,
            }),
        )?;
        let keys: Vec<String> = (0..self.env.local_world_size)
            .map(|l| self.key(round, l))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let timeout = self.store.timeout();
        if self.store.wait(&refs, timeout).is_err() {
            let missing: Vec<usize> = (0..keys.len())
                .filter(|&l| !self.store.check(&[refs[l]]).unwrap_or(false))
                .collect();
            return Err(fail(format!(
                "rank {me}: memory admission: local rank(s) {missing:?} of {} published no \
                 prediction within {timeout:?} (LOCAL_WORLD_SIZE={}: did a rank fail to \
                 start?)",
                self.host, self.env.local_world_size
            )));
        }
        let mut shares = Vec::new();
        for key in &keys {
            let value = self.store.get(key)?;
            match Entry::decode(&String::from_utf8_lossy(&value)) {
                Some(Entry::Share(s)) => shares.push(s),
                Some(Entry::Failed { rank, error }) => {
                    return Err(fail(format!(
                        "rank {me}: rank {rank} of {} failed before the memory admission: \
                         {error}",
                        self.host
                    )))
                }
                None => {
                    return Err(fail(format!(
                        "rank {me}: memory admission: malformed entry {key:?} in the store"
                    )))
                }
            }
        }
        Ok(shares)
    }

    /// The host's total of `shares` and the smallest memory a rank of the host saw.
    pub(crate) fn add_up(
        &self,
        shares: &[Share],
    ) -> Result<(u64, Option<AvailableMemory>), CliError> {
        let total = shares
            .iter()
            .try_fold(0u64, |t, s| t.checked_add(s.bytes))
            .ok_or_else(|| overflow("the ranks of this host"))?;
        let available = shares
            .iter()
            .filter_map(|s| s.available.clone())
            .min_by_key(|a| a.bytes);
        Ok((total, available))
    }

    /// This rank stops with `error` before or during the admission: publishes it in every
    /// round it has not published in, so that the host's other ranks stop with it instead of
    /// waiting, then says it is done with the store. Best effort (store errors are ignored).
    pub(crate) fn abandon(&self, error: &CliError) {
        for round in self.published.get()..ROUNDS.len() {
            let _ = self.publish(
                round,
                &Entry::Failed {
                    rank: self.env.rank,
                    error: error.msg.clone(),
                },
            );
        }
        self.leave();
    }

    /// Says this rank is done with the store. The rank hosting the store waits (at most
    /// [`LEAVE_GRACE`]) until the other ranks of its host are done too, so that none loses the
    /// store before it has read the figures it needs.
    fn leave(&self) {
        if self.left.replace(true) {
            return;
        }
        let done = |l: usize| format!("{}/done/{l}", self.prefix);
        let _ = self.store.set(&done(self.env.local_rank), b"1");
        if self.store.is_server() {
            let keys: Vec<String> = (0..self.env.local_world_size).map(done).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let _ = self
                .store
                .wait(&refs, self.store.timeout().min(LEAVE_GRACE));
        }
    }
}

/// How long the rank hosting the store waits, when it stops at the admission, for the other
/// ranks of its host to read what they need (a rank that is alive takes milliseconds; one
/// that died, which a launcher would have noticed, is not waited for any longer).
const LEAVE_GRACE: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip() {
        let entries = [
            Entry::Share(Share {
                rank: 3,
                bytes: 1 << 40,
                available: Some(AvailableMemory {
                    bytes: 12345,
                    source: "MemAvailable in /proc/meminfo".into(),
                }),
            }),
            Entry::Share(Share {
                rank: 0,
                bytes: 7,
                available: None,
            }),
            Entry::Failed {
                rank: 1,
                error: "--batch-size 3 is not divisible by --ranks 2".into(),
            },
        ];
        for e in entries {
            assert_eq!(Entry::decode(&e.encode()), Some(e));
        }
        assert_eq!(Entry::decode("ok x 1 -"), None);
        assert_eq!(Entry::decode("what 1 2"), None);
    }

    #[test]
    fn shares_are_listed_when_few() {
        let share = |rank, bytes| Share {
            rank,
            bytes,
            available: None,
        };
        let two = [share(0, 1 << 20), share(1, 2 << 20)];
        assert_eq!(list_shares(&two), "rank 0 1.0 MiB, rank 1 2.0 MiB");
        let same: Vec<Share> = (0..16).map(|r| share(r, 1 << 30)).collect();
        assert_eq!(list_shares(&same), "16 ranks of 1.0 GiB each");
        let mut mixed = same.clone();
        mixed[5].bytes = 2 << 30;
        mixed[9].bytes = 1 << 29;
        assert_eq!(
            list_shares(&mixed),
            "16 ranks of 512.0 MiB (rank 9) to 2.0 GiB (rank 5)"
        );
    }
}
