//! How much memory this process may still take: the smaller of `/proc/meminfo`'s
//! `MemAvailable` and the headroom of every memory cgroup the process lies in (cgroup v2:
//! `memory.max − memory.current`; cgroup v1: `memory.limit_in_bytes − memory.usage_in_bytes`;
//! each less the cgroup's reclaimable inactive file cache, as `docker stats` counts it), for the
//! cgroup and each of its ancestors up to the hierarchy's root.
//!
//! The parsers are public so that they can be tested on sample texts; [`available_memory`]
//! reads the real files (Linux), and [`available_memory_from`] reads through any function.

use std::path::{Path, PathBuf};

/// Memory this process may still take, and where the figure comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AvailableMemory {
    /// Bytes.
    pub bytes: u64,
    /// The source of the figure: `MemAvailable in /proc/meminfo`, or the cgroup whose
    /// headroom is the smallest, e.g. `the cgroup v2 limit of /sys/fs/cgroup/job (memory.max
    /// 8589934592 − memory.current 1048576)`.
    pub source: String,
}

/// The memory this process may still take (from `/proc/meminfo` and the cgroup limit), or `None`
/// where neither `/proc/meminfo` nor a cgroup limit can be read (not Linux).
pub fn available_memory() -> Option<AvailableMemory> {
    available_memory_from(|p| std::fs::read_to_string(p).ok())
}

/// [`available_memory`] with the files read through `read` (`None`: the file does not exist
/// or cannot be read): `/proc/meminfo`, `/proc/self/cgroup`, `/proc/self/mountinfo` and the
/// cgroup files under the mount points that `mountinfo` names (`/sys/fs/cgroup` for v2 and
/// `/sys/fs/cgroup/memory` for v1 when it names none).
pub fn available_memory_from(read: impl Fn(&Path) -> Option<String>) -> Option<AvailableMemory> {
    let mut best: Option<AvailableMemory> = read(Path::new("/proc/meminfo"))
        .as_deref()
        .and_then(parse_meminfo_available)
        .map(|bytes| AvailableMemory {
            bytes,
            source: "MemAvailable in /proc/meminfo".into(),
        });
    let mut consider = |c: AvailableMemory| {
        if best.as_ref().is_none_or(|b| c.bytes < b.bytes) {
            best = Some(c);
        }
    };
    if let Some(cgroup) = read(Path::new("/proc/self/cgroup")) {
        let paths = parse_cgroup_paths(&cgroup);
        let mounts = read(Path::new("/proc/self/mountinfo")).unwrap_or_default();
        for (version, path) in [
            (CgroupVersion::V2, paths.v2),
            (CgroupVersion::V1, paths.v1_memory),
        ] {
            let Some(path) = path else { continue };
            let (root, mount) = cgroup_mount(&mounts, version).unwrap_or_else(|| {
                let m = match version {
                    CgroupVersion::V2 => "/sys/fs/cgroup",
                    CgroupVersion::V1 => "/sys/fs/cgroup/memory",
                };
                ("/".to_string(), PathBuf::from(m))
            });
            if let Some(c) = cgroup_chain_headroom(&read, version, &root, &mount, &path) {
                consider(c);
            }
        }
    }
    best
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes (`None` when it is missing, malformed or
/// overflows).
pub fn parse_meminfo_available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("MemAvailable:")?;
        let mut f = rest.split_whitespace();
        let n: u64 = f.next()?.parse().ok()?;
        match f.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// A cgroup hierarchy's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The unified hierarchy (`memory.max`, `memory.current`).
    V2,
    /// The legacy memory controller (`memory.limit_in_bytes`, `memory.usage_in_bytes`).
    V1,
}

/// The process's cgroups as `/proc/self/cgroup` lists them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupPaths {
    /// The unified (v2) hierarchy's path (the line `0::/path`).
    pub v2: Option<String>,
    /// The v1 memory controller's path (the line `N:memory:/path`, also when `memory` is one
    /// of several comma-separated controllers).
    pub v1_memory: Option<String>,
}

/// The cgroup paths of a `/proc/self/cgroup` text.
pub fn parse_cgroup_paths(text: &str) -> CgroupPaths {
    let mut paths = CgroupPaths::default();
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            paths.v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            paths.v1_memory = Some(path.to_string());
        }
    }
    paths
}

/// A v1 limit at or above this is "no limit" (the kernel's unlimited value is `i64::MAX`
/// rounded down to a page, which depends on the page size).
const V1_UNLIMITED: u64 = 1 << 62;

/// The headroom of one cgroup: its limit less its usage, the usage less the reclaimable
/// inactive file cache of its `memory.stat` text (`inactive_file` for v2,
/// `total_inactive_file` for v1) when given. `None` when there is no limit (`max`, a v1 value
/// of 2^62 or more) or a text is malformed.
pub fn cgroup_headroom(
    version: CgroupVersion,
    limit: &str,
    usage: &str,
    stat: Option<&str>,
) -> Option<u64> {
    let limit = limit.trim();
    if limit == "max" {
        return None;
    }
    let limit: u64 = limit.parse().ok()?;
    if version == CgroupVersion::V1 && limit >= V1_UNLIMITED {
        return None;
    }
    let usage: u64 = usage.trim().parse().ok()?;
    let key = match version {
        CgroupVersion::V2 => "inactive_file",
        CgroupVersion::V1 => "total_inactive_file",
    };
    let inactive = stat
        .and_then(|s| {
            s.lines().find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next()? == key).then(|| f.next()?.parse::<u64>().ok())?
            })
        })
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(inactive)))
}

/// The root and the mount point of the hierarchy of `version` in a `/proc/self/mountinfo`
/// text: fields 4 and 5, of the line whose file system type (after ` - `) is `cgroup2`, or
/// `cgroup` with `memory` among its super options.
fn cgroup_mount(mountinfo: &str, version: CgroupVersion) -> Option<(String, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        let (before, after) = line.split_once(" - ")?;
        let mut a = after.split_whitespace();
        let fstype = a.next()?;
        let _source = a.next();
        let options = a.next().unwrap_or("");
        let wanted = match version {
            CgroupVersion::V2 => fstype == "cgroup2",
            CgroupVersion::V1 => fstype == "cgroup" && options.split(',').any(|o| o == "memory"),
        };
        if !wanted {
            return None;
        }
        let mut b = before.split_whitespace();
        let root = b.nth(3)?;
        let mount = b.next()?;
        Some((unescape(root), PathBuf::from(unescape(mount))))
    })
}

/// `mountinfo`'s octal escapes (`\040` for a space) undone.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = |c: &u8| (b'0'..=b'7').contains(c);
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(octal) {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |v, &d| v * 8 + u32::from(d - b'0'));
            out.push(u8::try_from(v).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The smallest headroom of the cgroup `path` (relative to the hierarchy's `root`, mounted at
/// `mount`) and of its ancestors up to the mount point.
fn cgroup_chain_headroom(
    read: &impl Fn(&Path) -> Option<String>,
    version: CgroupVersion,
    root: &str,
    mount: &Path,
    path: &str,
) -> Option<AvailableMemory> {
    // Inside a cgroup namespace the path is relative to the namespace's root, which is what is
    // mounted; without one the mount's root is a prefix of the path.
    let rel = match path.strip_prefix(root.trim_end_matches('/')) {
        Some(r) if root != "/" && (r.is_empty() || r.starts_with('/')) => r,
        _ => path,
    };
    let (limit_file, usage_file, what) = match version {
        CgroupVersion::V2 => ("memory.max", "memory.current", "v2"),
        CgroupVersion::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes", "v1"),
    };
    let mut dir = mount.join(rel.trim_start_matches('/'));
    let mut best: Option<AvailableMemory> = None;
    loop {
        if let (Some(limit), Some(usage)) =
            (read(&dir.join(limit_file)), read(&dir.join(usage_file)))
        {
            let stat = read(&dir.join("memory.stat"));
            if let Some(bytes) = cgroup_headroom(version, &limit, &usage, stat.as_deref()) {
                if best.as_ref().is_none_or(|b| bytes < b.bytes) {
                    best = Some(AvailableMemory {
                        bytes,
                        source: format!(
                            "the cgroup {what} limit of {} ({limit_file} {} − {usage_file} {}, \
                             less inactive file cache)",
                            dir.display(),
                            limit.trim(),
                            usage.trim()
                        ),
                    });
                }
            }
        }
        if dir == mount || !dir.pop() || !dir.starts_with(mount) {
            break;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const MEMINFO: &str = "MemTotal:       24684092 kB\nMemFree:        16746712 kB\n\
                           MemAvailable:   23877972 kB\nBuffers:           82148 kB\n";

    #[test]
    fn meminfo_available_is_read_in_bytes() {
        assert_eq!(parse_meminfo_available(MEMINFO), Some(23877972 * 1024));
        assert_eq!(parse_meminfo_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_meminfo_available("MemAvailable: x kB\n"), None);
        assert_eq!(
            parse_meminfo_available("MemAvailable: 99999999999999999 kB\n"),
            None
        );
    }

    #[test]
    fn cgroup_paths_of_v1_v2_and_hybrid_hosts() {
        let hybrid = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n";
        assert_eq!(
            parse_cgroup_paths(hybrid),
            CgroupPaths {
                v2: Some("/".into()),
                v1_memory: Some("/process_api/abc".into()),
            }
        );
        let v2 = "0::/user.slice/user-1000.slice/session-2.scope\n";
        assert_eq!(
            parse_cgroup_paths(v2).v2.as_deref(),
            Some("/user.slice/user-1000.slice/session-2.scope")
        );
        let joined = "5:cpuacct,memory:/docker/x\n";
        assert_eq!(
            parse_cgroup_paths(joined).v1_memory.as_deref(),
            Some("/docker/x")
        );
    }

    #[test]
    fn headroom_of_limits() {
        use CgroupVersion::*;
        assert_eq!(cgroup_headroom(V2, "max\n", "123\n", None), None);
        assert_eq!(cgroup_headroom(V2, "1000\n", "300\n", None), Some(700));
        assert_eq!(cgroup_headroom(V2, "1000\n", "1300\n", None), Some(0));
        let stat = "anon 100\nfile 200\ninactive_file 150\nactive_file 50\n";
        assert_eq!(cgroup_headroom(V2, "1000", "300", Some(stat)), Some(850));
        assert_eq!(
            cgroup_headroom(V1, "9223372036854771712\n", "3497984\n", None),
            None
        );
        let stat1 = "cache 10\ntotal_inactive_file 40\n";
        assert_eq!(
            cgroup_headroom(V1, "2147483648", "1000", Some(stat1)),
            Some(2147483648 - 960)
        );
        assert_eq!(cgroup_headroom(V2, "lots", "1", None), None);
    }

    fn files(list: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let map: HashMap<PathBuf, String> = list
            .iter()
            .map(|(p, t)| (PathBuf::from(p), t.to_string()))
            .collect();
        move |p| map.get(p).cloned()
    }

    #[test]
    fn the_smallest_of_meminfo_and_every_cgroup_level() {
        // A v2 host: the job's cgroup has 2 GiB left, its parent only 1 GiB.
        let read = files(&[
            ("/proc/meminfo", MEMINFO),
            ("/proc/self/cgroup", "0::/jobs/42\n"),
            (
                "/proc/self/mountinfo",
                "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n",
            ),
            ("/sys/fs/cgroup/jobs/42/memory.max", "3221225472\n"),
            ("/sys/fs/cgroup/jobs/42/memory.current", "1073741824\n"),
            ("/sys/fs/cgroup/jobs/memory.max", "2147483648\n"),
            ("/sys/fs/cgroup/jobs/memory.current", "1073741824\n"),
        ]);
        let a = available_memory_from(read).unwrap();
        assert_eq!(a.bytes, 1 << 30);
        assert!(a.source.contains("/sys/fs/cgroup/jobs "), "{}", a.source);
        // Unlimited cgroups leave MemAvailable.
        let read = files(&[
            ("/proc/meminfo", MEMINFO),
            ("/proc/self/cgroup", "4:memory:/a\n0::/\n"),
            (
                "/sys/fs/cgroup/memory/a/memory.limit_in_bytes",
                "9223372036854771712",
            ),
            ("/sys/fs/cgroup/memory/a/memory.usage_in_bytes", "5"),
        ]);
        let a = available_memory_from(read).unwrap();
        assert_eq!(a.bytes, 23877972 * 1024);
        assert_eq!(a.source, "MemAvailable in /proc/meminfo");
        // A v1 limit below MemAvailable, with a mount root that prefixes the path.
        let read = files(&[
            ("/proc/meminfo", MEMINFO),
            ("/proc/self/cgroup", "4:memory:/docker/c1\n"),
            (
                "/proc/self/mountinfo",
                "35 31 0:32 /docker/c1 /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
            ),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "1048576"),
            ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "524288"),
        ]);
        assert_eq!(available_memory_from(read).unwrap().bytes, 524288);
        // Nothing readable: unknown.
        assert_eq!(available_memory_from(files(&[])), None);
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
