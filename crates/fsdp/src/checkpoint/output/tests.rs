//! Unit tests of the output rules: every file type, links, temporaries.

use super::*;

/// A fresh directory for one test, removed when the test ends.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("fsdp-output-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

fn reason(e: FsdpError) -> String {
    match e {
        FsdpError::Checkpoint { reason, .. } => reason,
        other => panic!("{other}"),
    }
}

/// Runs a tool such as `mkfifo`; false (with a message) when it is unavailable or fails.
#[cfg(unix)]
fn tool(program: &str, args: &[&str]) -> bool {
    match std::process::Command::new(program).args(args).status() {
        Ok(s) if s.success() => true,
        other => {
            println!("skipped: `{program} {}` failed: {other:?}", args.join(" "));
            false
        }
    }
}

#[test]
fn absent_and_regular_files_are_accepted_and_replaced_atomically() {
    let d = scratch("regular");
    let p = d.join("out.bin");
    assert_eq!(check_output_path(&p, false).unwrap(), OutputKind::Absent);
    write_atomic(&p, |w| w.write_all(b"one")).unwrap();
    assert_eq!(check_output_path(&p, false).unwrap(), OutputKind::File);
    assert_eq!(check_output_path(&p, true).unwrap(), OutputKind::File);
    write_output(&p, |w| w.write_all(b"two")).unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"two");
    // A failed write keeps the previous content and leaves no temporary or probe.
    let e = write_atomic(&p, |_| Err(io::Error::other("boom"))).unwrap_err();
    assert!(reason(e).contains("boom"));
    assert_eq!(fs::read(&p).unwrap(), b"two");
    let names: Vec<_> = fs::read_dir(&d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("out.bin")]);
    // A bare file name is in the current directory.
    assert!(check_output_path(Path::new("bare-name.bin"), false).is_ok());
}

#[test]
fn directories_and_missing_directories_are_refused() {
    let d = scratch("dirs");
    for allow in [false, true] {
        let r = reason(check_output_path(&d, allow).unwrap_err());
        assert!(
            r.starts_with("is a directory; expected an absent path"),
            "{r}"
        );
        assert_eq!(r.contains("FIFO"), allow, "{r}");
    }
    let r = reason(check_output_path(&d.join("no/such/f"), true).unwrap_err());
    assert!(r.contains("does not exist"), "{r}");
    fs::write(d.join("file"), b"x").unwrap();
    let r = reason(check_output_path(&d.join("file/f"), false).unwrap_err());
    assert!(r.contains("is not a directory"), "{r}");
    assert!(check_output_path(Path::new("/"), false).is_err());
    // Writing onto a directory fails and leaves it alone.
    assert!(write_atomic(&d, |w| w.write_all(b"x")).is_err());
    assert!(d.is_dir());
}

#[cfg(unix)]
#[test]
fn a_read_only_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let d = scratch("read-only");
    let ro = d.join("ro");
    fs::create_dir(&ro).unwrap();
    fs::set_permissions(&ro, fs::Permissions::from_mode(0o555)).unwrap();
    if fs::write(ro.join("x"), b"x").is_ok() {
        println!("skipped: a read-only directory is writable here (root)");
        return;
    }
    let r = reason(check_output_path(&ro.join("f"), false).unwrap_err());
    assert!(r.contains("is not writable"), "{r}");
    // A stream needs no directory to write in.
    assert!(check_output_path(Path::new("/dev/null"), true).is_ok());
    fs::set_permissions(&ro, fs::Permissions::from_mode(0o755)).unwrap();
}

#[cfg(unix)]
#[test]
fn symbolic_links_are_followed_and_stay_links() {
    use std::os::unix::fs::symlink;
    let d = scratch("links");
    let target = d.join("target.bin");
    fs::write(&target, b"old").unwrap();
    let link = d.join("link.bin");
    symlink("target.bin", &link).unwrap();
    let link2 = d.join("link2.bin");
    symlink(&link, &link2).unwrap();
    assert_eq!(resolve_output_path(&link2).unwrap(), d.join("target.bin"));
    assert_eq!(check_output_path(&link2, false).unwrap(), OutputKind::File);
    write_atomic(&link2, |w| w.write_all(b"new")).unwrap();
    assert!(fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(fs::symlink_metadata(&link2)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read(&target).unwrap(), b"new");
    // A dangling link names the file to create.
    let dangling = d.join("dangling.bin");
    symlink("created.bin", &dangling).unwrap();
    assert_eq!(
        check_output_path(&dangling, false).unwrap(),
        OutputKind::Absent
    );
    write_atomic(&dangling, |w| w.write_all(b"c")).unwrap();
    assert!(fs::symlink_metadata(&dangling)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read(d.join("created.bin")).unwrap(), b"c");
    // A link to a directory names both.
    let to_dir = d.join("to-dir");
    symlink(&d, &to_dir).unwrap();
    let r = reason(check_output_path(&to_dir, false).unwrap_err());
    assert!(r.starts_with("is a symbolic link to "), "{r}");
    assert!(r.contains("which is a directory"), "{r}");
    // A loop.
    let a = d.join("loop-a");
    let b = d.join("loop-b");
    symlink(&b, &a).unwrap();
    symlink(&a, &b).unwrap();
    let r = reason(check_output_path(&a, true).unwrap_err());
    assert!(r.contains("too many levels"), "{r}");
}

#[cfg(unix)]
#[test]
fn permissions_of_a_replaced_file_are_kept() {
    use std::os::unix::fs::PermissionsExt;
    let d = scratch("perms");
    let p = d.join("p.bin");
    fs::write(&p, b"x").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o640)).unwrap();
    write_atomic(&p, |w| w.write_all(b"y")).unwrap();
    assert_eq!(
        fs::metadata(&p).unwrap().permissions().mode() & 0o777,
        0o640
    );
}

#[cfg(unix)]
#[test]
fn fifos_are_streams_or_refused() {
    use std::os::unix::fs::FileTypeExt;
    let d = scratch("fifo");
    let f = d.join("pipe");
    if !tool("mkfifo", &[f.to_str().unwrap()]) {
        return;
    }
    let r = reason(check_output_path(&f, false).unwrap_err());
    assert_eq!(
        r,
        "is a FIFO; expected an absent path, a regular file or a symbolic link to one"
    );
    assert_eq!(check_output_path(&f, true).unwrap(), OutputKind::Fifo);
    assert!(write_atomic(&f, |w| w.write_all(b"x")).is_err());
    let reader = {
        let f = f.clone();
        std::thread::spawn(move || fs::read(f).unwrap())
    };
    write_output(&f, |w| w.write_all(b"through the pipe")).unwrap();
    assert_eq!(reader.join().unwrap(), b"through the pipe");
    assert!(fs::symlink_metadata(&f).unwrap().file_type().is_fifo());
}

#[cfg(unix)]
#[test]
fn character_devices_are_streams_or_refused() {
    use std::os::unix::fs::FileTypeExt;
    let null = Path::new("/dev/null");
    if !null.exists() {
        println!("skipped: no /dev/null");
        return;
    }
    let r = reason(check_output_path(null, false).unwrap_err());
    assert!(r.starts_with("is a character device; expected"), "{r}");
    assert_eq!(
        check_output_path(null, true).unwrap(),
        OutputKind::CharDevice
    );
    assert!(write_atomic(null, |w| w.write_all(b"x")).is_err());
    write_output(null, |w| w.write_all(b"discarded")).unwrap();
    assert!(fs::metadata(null).unwrap().file_type().is_char_device());
    // Through a link.
    let d = scratch("chardev");
    let link = d.join("null-link");
    std::os::unix::fs::symlink(null, &link).unwrap();
    let r = reason(check_output_path(&link, false).unwrap_err());
    assert_eq!(
        r,
        "is a symbolic link to /dev/null, which is a character device; expected an absent \
         path, a regular file or a symbolic link to one"
    );
    assert_eq!(
        check_output_path(&link, true).unwrap(),
        OutputKind::CharDevice
    );
}

#[cfg(unix)]
#[test]
fn sockets_are_refused() {
    use std::os::unix::net::UnixListener;
    let d = scratch("socket");
    let s = d.join("sock");
    let _listener = match UnixListener::bind(&s) {
        Ok(l) => l,
        Err(e) => {
            println!("skipped: cannot bind a Unix socket: {e}");
            return;
        }
    };
    for allow in [false, true] {
        let r = reason(check_output_path(&s, allow).unwrap_err());
        assert!(r.starts_with("is a socket; expected"), "{r}");
    }
}

#[cfg(unix)]
#[test]
fn block_devices_are_refused() {
    use std::os::unix::fs::FileTypeExt;
    let d = scratch("block");
    let b = d.join("blk");
    // A block device node (the kernel's RAM disk numbers; never opened).
    if !tool("mknod", &[b.to_str().unwrap(), "b", "1", "0"]) {
        return;
    }
    for allow in [false, true] {
        let r = reason(check_output_path(&b, allow).unwrap_err());
        assert!(r.starts_with("is a block device; expected"), "{r}");
    }
    assert!(write_output(&b, |w| w.write_all(b"x")).is_err());
    assert!(fs::symlink_metadata(&b)
        .unwrap()
        .file_type()
        .is_block_device());
}

#[test]
fn temporary_names_are_recognised() {
    assert_eq!(temporary_pid(".s.st.fsdp-tmp.123", "s.st"), Some(123));
    assert_eq!(temporary_pid(".s.st.fsdp-tmp.123.7", "s.st"), Some(123));
    assert_eq!(temporary_pid(".s.st.fsdp-tmp.123.", "s.st"), None);
    assert_eq!(temporary_pid(".s.st.fsdp-tmp.12a", "s.st"), None);
    assert_eq!(temporary_pid(".s.st.fsdp-tmp.", "s.st"), None);
    assert_eq!(temporary_pid(".t.st.fsdp-tmp.123", "s.st"), None);
    assert_eq!(temporary_pid("s.st.fsdp-tmp.123", "s.st"), None);
    assert_eq!(temporary_pid(".s.st.fsdp-probe.123", "s.st"), None);
}

#[cfg(target_os = "linux")]
#[test]
fn stale_temporaries_of_dead_processes_are_removed() {
    let d = scratch("stale");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = d.join(format!(".s.st.fsdp-tmp.{dead}"));
    let stale_n = d.join(format!(".s.st.fsdp-tmp.{dead}.3"));
    let mine = d.join(format!(".s.st.fsdp-tmp.{}", std::process::id()));
    let other_name = d.join(format!(".t.st.fsdp-tmp.{dead}"));
    // pid 1 is always running.
    let live = d.join(".s.st.fsdp-tmp.1");
    for p in [&stale, &stale_n, &mine, &other_name, &live] {
        fs::write(p, b"partial").unwrap();
    }
    write_atomic(&d.join("s.st"), |w| w.write_all(b"weights")).unwrap();
    assert!(!stale.exists() && !stale_n.exists());
    assert!(mine.exists() && other_name.exists() && live.exists());
    assert_eq!(fs::read(d.join("s.st")).unwrap(), b"weights");
}
