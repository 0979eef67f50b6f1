//! `AllocatorConfig::from_env`: `PYTORCH_ALLOC_CONF` first, then `PYTORCH_CUDA_ALLOC_CONF`,
//! unset or empty meaning the defaults. One test, as it changes the process environment.

use fsdp_allocator::{alloc_conf_from_env, AllocError, AllocatorConfig};

#[test]
fn from_env_reads_pytorch_variables() {
    std::env::remove_var("PYTORCH_ALLOC_CONF");
    std::env::remove_var("PYTORCH_CUDA_ALLOC_CONF");
    assert_eq!(
        AllocatorConfig::from_env().unwrap(),
        AllocatorConfig::default()
    );
    assert_eq!(alloc_conf_from_env().unwrap(), None);

    std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True");
    let c = AllocatorConfig::from_env().unwrap();
    assert_eq!(c, AllocatorConfig::default().with_expandable_segments(true));

    // The newer name wins; an empty one is as unset.
    std::env::set_var("PYTORCH_ALLOC_CONF", "max_split_size_mb:64");
    let c = AllocatorConfig::from_env().unwrap();
    assert_eq!(c, AllocatorConfig::default().with_max_split_size(64 << 20));
    std::env::set_var("PYTORCH_ALLOC_CONF", "");
    assert!(AllocatorConfig::from_env().unwrap().expandable_segments);
    std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "");
    assert_eq!(
        AllocatorConfig::from_env().unwrap(),
        AllocatorConfig::default()
    );

    std::env::set_var("PYTORCH_CUDA_ALLOC_CONF", "expandable_segment:True");
    match AllocatorConfig::from_env() {
        Err(AllocError::AllocConf { key, .. }) => assert_eq!(key, "expandable_segment"),
        other => panic!("{other:?}"),
    }
    std::env::remove_var("PYTORCH_CUDA_ALLOC_CONF");
    std::env::remove_var("PYTORCH_ALLOC_CONF");
}
