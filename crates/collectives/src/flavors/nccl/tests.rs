//! Unit tests of the NCCL backend that run without a GPU.

use super::*;

/// Without the libraries (this machine), every entry point fails with `Unavailable` naming
/// the library, never a panic. Where they are present, the probe succeeds.
#[test]
fn missing_libraries_are_an_error_not_a_panic() {
    // SAFETY: only tries to open the libraries.
    let (cuda, nccl) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nccl::sys::is_culib_present(),
        )
    };
    let probe = ffi::probe_libraries(3);
    match (cuda, nccl) {
        (true, true) => assert!(probe.is_ok(), "{probe:?}"),
        _ => {
            let err = probe.unwrap_err();
            let want = if cuda { "libnccl" } else { "libcuda" };
            assert!(matches!(
                err,
                CollectiveError::Unavailable {
                    rank: 3,
                    backend: "nccl",
                    ..
                }
            ));
            assert!(err.to_string().contains(want), "{err}");
            assert!(err.to_string().contains("LD_LIBRARY_PATH"), "{err}");
            let err = UniqueId::new().unwrap_err();
            assert!(err.to_string().contains(want), "{err}");
            let id = UniqueId::from_bytes(&[0u8; 128]).unwrap();
            let err =
                NcclCommunicator::from_unique_id(&id, 1, 2, 0, NcclOptions::default()).unwrap_err();
            assert!(
                matches!(err, CollectiveError::Unavailable { rank: 1, .. }),
                "{err}"
            );
            assert!(version().is_err());
            assert!(available().is_err());
        }
    }
}

#[test]
fn constructor_arguments_are_checked_first() {
    let id = UniqueId::from_bytes(&[7u8; 128]).unwrap();
    assert_eq!(id.to_bytes(), [7u8; 128]);
    let err = UniqueId::from_bytes(&[0u8; 5]).unwrap_err();
    assert!(err.to_string().contains("5 bytes, expected 128"), "{err}");
    let err = NcclCommunicator::from_unique_id(&id, 2, 2, 0, NcclOptions::default()).unwrap_err();
    assert!(err.to_string().contains("rank 2 >= world size 2"), "{err}");
    let err = NcclCommunicator::from_unique_id(&id, 0, 0, 0, NcclOptions::default()).unwrap_err();
    assert!(err.to_string().contains("world size 0"), "{err}");
}

#[test]
fn verify_is_on_in_debug_builds_only() {
    let o = NcclOptions::default();
    assert_eq!(o.verify, cfg!(debug_assertions));
    let o = o
        .with_timeout(Duration::from_secs(3))
        .with_init_timeout(Duration::from_secs(30));
    assert_eq!(o.timeout, Duration::from_secs(3));
    assert_eq!(o.init_timeout, Duration::from_secs(30));
}

#[test]
fn local_abort_flags_are_shared_by_key() {
    let a = AbortFlag::local("test/flag/a".into());
    let b = AbortFlag::local("test/flag/a".into());
    let c = AbortFlag::local("test/flag/c".into());
    assert_eq!(a.read(), None);
    b.publish("rank 1 timed out");
    a.publish("a later reason");
    assert_eq!(a.read().as_deref(), Some("rank 1 timed out"));
    assert_eq!(c.read(), None);
    let child = a.child(0, 3);
    assert_eq!(child.read(), None, "a child has its own flag");
}

/// The abort flag of ranks in several processes: a key in the store, read by every rank; a
/// child's flag is its own key.
#[test]
#[cfg_attr(miri, ignore = "opens sockets")]
fn store_abort_flags_reach_every_rank() {
    use crate::store::StoreOptions;
    let t = Duration::from_secs(10);
    let server = TcpStore::new(StoreOptions::new("127.0.0.1", 0, 0, 2).with_timeout(t)).unwrap();
    let client =
        TcpStore::new(StoreOptions::new("127.0.0.1", server.port(), 1, 2).with_timeout(t)).unwrap();
    let mine = AbortFlag::Store {
        store: server.clone(),
        key: "nccl/0/abort".into(),
    };
    let theirs = AbortFlag::Store {
        store: client,
        key: "nccl/0/abort".into(),
    };
    assert_eq!(theirs.read(), None);
    let child = theirs.child(0, 1);
    mine.publish("rank 0 timed out in all_reduce");
    assert_eq!(
        theirs.read().as_deref(),
        Some("rank 0 timed out in all_reduce")
    );
    assert_eq!(child.read(), None);
    mine.child(0, 1).publish("split child failed");
    assert_eq!(child.read().as_deref(), Some("split child failed"));
}
