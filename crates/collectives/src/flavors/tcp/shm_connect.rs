//! Setting up the shared-memory transport of a group: rank 0 creates the file under
//! `/dev/shm` and publishes its path in the store, every rank maps it, rank 0 unlinks the name
//! once all have, and each reader tests cross-memory attach with its writer (see [`super`]).

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::shm_map::{can_pull, cma_works, io_err, Mapping, MAGIC, PROBE};
use super::super::shm_region::PeerRegions;
use super::{Shm, ShmControl};
use crate::store::TcpStore;
use crate::{CollectiveError, Result};

/// Map the group's shared file: rank 0 creates it, the others open it; every rank's transport
/// and the group's abort control.
pub(crate) fn connect(
    store: &TcpStore,
    group: &str,
    rank: usize,
    world: usize,
    segment_bytes: usize,
    timeout: Duration,
) -> Result<(Shm, ShmControl)> {
    let slot_bytes = segment_bytes.max(64 << 10).next_multiple_of(64);
    let size = Mapping::size(world, slot_bytes);
    let key = format!("fsdp/shm/{group}/path");
    let mapped_key = format!("fsdp/shm/{group}/mapped");
    let probed_key = format!("fsdp/shm/{group}/probed");
    let (file, path) = if rank == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = PathBuf::from(format!(
            "/dev/shm/fsdp-{}-{nanos:x}-{group}",
            std::process::id()
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_err(rank, &format!("creating {}", path.display()), e))?;
        let cleanup = scopeguard(path.clone());
        file.set_len(size as u64)
            .map_err(|e| io_err(rank, "sizing the shared file", e))?;
        store.set(&key, path.to_string_lossy().as_bytes())?;
        std::mem::forget(cleanup);
        (file, Some(path))
    } else {
        let p = store.get_timeout(&key, timeout)?;
        let path = PathBuf::from(String::from_utf8_lossy(&p).into_owned());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_err(rank, &format!("opening {}", path.display()), e))?;
        (file, None)
    };
    let mut map = Mapping::map(&file, world, slot_bytes, rank);
    if let (Err(_), Some(p)) = (&map, &path) {
        let _ = std::fs::remove_file(p);
    }
    if let Ok(m) = &mut map {
        m.path = path;
    }
    let mut map = map?;
    if rank == 0 {
        map.u64_at(0).store(MAGIC, Ordering::Release);
    }
    map.pid(rank).store(std::process::id(), Ordering::Release);
    map.probe(rank)
        .store(std::ptr::addr_of!(PROBE) as u64, Ordering::Release);
    store.add(&mapped_key, 1)?;
    let deadline = Instant::now() + timeout;
    let what = format!("ranks to map the shared file of group {group}");
    wait_for_all(store, &mapped_key, world, deadline, rank, timeout, &what)?;
    if rank == 0 {
        // Every rank has the file open: take its name away, so nothing is left behind.
        if let Some(p) = map.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
    // Cross-memory attach between sibling processes may be refused where it works on our own
    // memory (Yama's ptrace_scope 1): each reader tries its writer once, and a writer sends by
    // address only if its reader could pull.
    let prev = (rank + world - 1) % world;
    let pulls = cma_works()
        && can_pull(
            map.pid(prev).load(Ordering::Acquire),
            map.probe(prev).load(Ordering::Acquire),
        );
    map.reader_pulls(prev)
        .store(u32::from(pulls), Ordering::Release);
    store.add(&probed_key, 1)?;
    let what = format!("ranks to test cross-memory attach in group {group}");
    wait_for_all(store, &probed_key, world, deadline, rank, timeout, &what)?;
    let map = Arc::new(map);
    let cma = cma_works() && map.reader_pulls(rank).load(Ordering::Acquire) == 1;
    if !cma {
        tracing::debug!(
            rank,
            "shm: data to rank {} goes through the slots",
            (rank + 1) % world
        );
    }
    Ok((
        Shm {
            map: map.clone(),
            rank,
            world,
            cma,
            seq: 0,
            deadline: Instant::now(),
            staging: Vec::new(),
            peers: PeerRegions::default(),
        },
        ShmControl { map, rank },
    ))
}

/// Wait until the store's counter `key` reaches `world` (every rank added to it).
fn wait_for_all(
    store: &TcpStore,
    key: &str,
    world: usize,
    deadline: Instant,
    rank: usize,
    timeout: Duration,
    what: &str,
) -> Result<()> {
    while store.add(key, 0)? < world as i64 {
        if Instant::now() >= deadline {
            return Err(CollectiveError::MissingRanks {
                rank,
                missing: Vec::new(),
                waited: timeout,
                what: what.to_string(),
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Removes a path when dropped (undone with `mem::forget`).
struct PathGuard(PathBuf);
impl Drop for PathGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
fn scopeguard(p: PathBuf) -> PathGuard {
    PathGuard(p)
}
