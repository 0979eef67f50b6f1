//! Unit tests of the `PYTORCH_CUDA_ALLOC_CONF` parser: values from PyTorch's own test
//! (`c10/test/core/AllocatorConfig_test.cpp`) and documentation (`notes/cuda.rst`), each
//! expected array written out by hand.

use proptest::prelude::*;

use super::*;
use crate::MemoryLimit;

// The Miri-aware proptest configuration the integration tests use too.
#[path = "../tests/common/miri.rs"]
mod miri;

fn parse(text: &str) -> AllocatorConfig {
    AllocatorConfig::from_pytorch_conf(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// The error of `text`, checked to be an `AllocConf` naming `key` and `value`.
fn refused(text: &str, key: &str, value: &str) -> String {
    let err = AllocatorConfig::from_pytorch_conf(text).expect_err(text);
    match &err {
        AllocError::AllocConf {
            key: k, value: v, ..
        } => {
            assert_eq!((k.as_str(), v.as_str()), (key, value), "{text}: {err}");
        }
        other => panic!("{text}: not an AllocConf error: {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(key) && msg.contains(value), "{msg}");
    msg
}

#[test]
fn pytorch_c10_test_settings() {
    // PyTorch's AllocatorConfig_test with the CUDA spellings of its keys.
    let c = parse(
        "max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,\
         roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],backend:native,\
         expandable_segments:True,release_lock_on_cudamalloc:True,\
         pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
         pinned_use_background_threads:True",
    );
    assert_eq!(c.max_split_size, Some(40 << 20));
    assert_eq!(c.garbage_collection_threshold, Some(0.5));
    assert!(c.expandable_segments);
    // 32 MiB → 8, 64 → 8, 128 → 2, 256 → 4, 512 → 2, 1024 → 4, 2048 and above → 1.
    assert_eq!(
        c.roundup_power2_divisions,
        [8, 8, 8, 8, 8, 8, 8, 2, 4, 2, 4, 1, 1, 1, 1, 1]
    );
    assert_eq!(c.memory_limit, None);
}

#[test]
fn pytorch_docs_examples() {
    // notes/cuda.rst: 1 below 256 MiB, 2 up to 512 MiB, 4 up to 1 GiB, 8 above.
    let c = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
    assert_eq!(
        c.roundup_power2_divisions,
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]
    );
    // notes/cuda.rst: with 4 divisions a 1200 MiB request rounds to 1280 MiB.
    let c = parse("roundup_power2_divisions:4");
    assert_eq!(c.roundup_power2_divisions, [4; ROUNDUP_POWER2_INTERVALS]);
    assert_eq!(c.round_size(1200 << 20), Some(1280 << 20));
    let c = parse("max_split_size_mb:128");
    assert_eq!(c.max_split_size, Some(128 << 20));
    let c = parse("garbage_collection_threshold:0.6,expandable_segments:True");
    assert_eq!(c.garbage_collection_threshold, Some(0.6));
    assert!(c.expandable_segments);
    assert!(!parse("expandable_segments:False").expandable_segments);
}

#[test]
fn roundup_list_follows_pytorch_filling() {
    // `>` first fills from interval 1 (PyTorch's last_index + 1), leaving interval 0.
    let c = parse("roundup_power2_divisions:[>:4]");
    assert_eq!(
        c.roundup_power2_divisions,
        [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    );
    // The first numbered entry fills every interval below it, whatever came before.
    let c = parse("roundup_power2_divisions:[>:4,64:8]");
    assert_eq!(
        c.roundup_power2_divisions,
        [8, 8, 8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4]
    );
    // An entry after `>` overrides its interval only.
    let c = parse("roundup_power2_divisions:[64:8,>:2,256:4]");
    assert_eq!(
        c.roundup_power2_divisions,
        [8, 8, 8, 8, 8, 8, 8, 2, 4, 2, 2, 2, 2, 2, 2, 2]
    );
    // Intervals past 32 GiB clamp to the last one; 0 switches an interval off.
    let c = parse("roundup_power2_divisions:[65536:2]");
    assert_eq!(c.roundup_power2_divisions, [2; ROUNDUP_POWER2_INTERVALS]);
    let c = parse("roundup_power2_divisions:[1:0,2:16]");
    assert_eq!(
        c.roundup_power2_divisions,
        [0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        parse("roundup_power2_divisions:[]").roundup_power2_divisions,
        [0; 16]
    );
    // The intervals apply to rounding: 64 to 128 MiB in 8 steps of 8 MiB.
    let c = parse("roundup_power2_divisions:[64:8,>:1]");
    assert_eq!(c.round_size((64 << 20) + 1), Some(72 << 20));
    assert_eq!(c.round_size((128 << 20) + 1), Some((128 << 20) + 512));
}

#[test]
fn syntax_as_pytorch_reads_it() {
    // Whitespace anywhere, a trailing comma, a later key overriding an earlier one.
    let c = parse(" expandable_segments : True ,\tmax_split_size_mb : 6 4 ,");
    assert!(c.expandable_segments);
    assert_eq!(c.max_split_size, Some(64 << 20));
    let c = parse("max_split_size_mb:64,max_split_size_mb:256");
    assert_eq!(c.max_split_size, Some(256 << 20));
    assert_eq!(parse(""), AllocatorConfig::default());
    assert_eq!(parse("  "), AllocatorConfig::default());
    // Keys PyTorch knows and this allocator ignores.
    let ignored = "backend:native,max_non_split_rounding_mb:20,large_segment_size_mb:64,\
                   release_lock_on_cudamalloc:False,release_lock_on_hipmalloc:True,\
                   pinned_use_cuda_host_register:False,pinned_use_hip_host_register:True,\
                   pinned_num_register_threads:128,pinned_reserve_segment_size_mb:1,\
                   pinned_use_background_threads:False,graph_capture_record_stream_reuse:True";
    assert_eq!(parse(ignored), AllocatorConfig::default());
    // A huge max_split_size_mb clamps as in PyTorch (no overflow).
    let c = parse("max_split_size_mb:18446744073709551615");
    assert_eq!(c.max_split_size, Some(usize::MAX / (1 << 20) * (1 << 20)));
}

#[test]
fn malformed_values_name_key_and_value() {
    refused("max_split_mb:128", "max_split_mb", "128");
    refused("max_split_size_mb:20", "max_split_size_mb", "20");
    refused("max_split_size_mb:abc", "max_split_size_mb", "abc");
    refused("max_split_size_mb:128MB", "max_split_size_mb", "128MB");
    refused("max_split_size_mb:-64", "max_split_size_mb", "-64");
    refused(
        "max_split_size_mb:99999999999999999999",
        "max_split_size_mb",
        "99999999999999999999",
    );
    refused("max_split_size_mb:[64]", "max_split_size_mb", "[64]");
    for t in ["0", "1", "1.0", "-0.5", "nan", "inf", "x"] {
        let text = format!("garbage_collection_threshold:{t}");
        refused(&text, "garbage_collection_threshold", t);
    }
    refused("expandable_segments:true", "expandable_segments", "true");
    refused("expandable_segments:1", "expandable_segments", "1");
    refused(
        "roundup_power2_divisions:3",
        "roundup_power2_divisions",
        "3",
    );
    refused(
        "roundup_power2_divisions:0",
        "roundup_power2_divisions",
        "0",
    );
    refused(
        "roundup_power2_divisions:[64:3]",
        "roundup_power2_divisions",
        "[64:3]",
    );
    refused(
        "roundup_power2_divisions:[63:4]",
        "roundup_power2_divisions",
        "[63:4]",
    );
    refused(
        "roundup_power2_divisions:[64:4",
        "roundup_power2_divisions",
        "[64:4",
    );
    refused(
        "roundup_power2_divisions:[64:4128:2]",
        "roundup_power2_divisions",
        "[64:4128:2]",
    );
    refused(
        "roundup_power2_divisions:[64:4,128]",
        "roundup_power2_divisions",
        "[64:4,128]",
    );
    refused(
        "roundup_power2_divisions:[64:8>:2]",
        "roundup_power2_divisions",
        "[64:8>:2]",
    );
    let msg = refused("backend:cudaMallocAsync", "backend", "cudaMallocAsync");
    assert!(msg.contains("not supported"), "{msg}");
    refused("backend:magic", "backend", "magic");
    refused(
        "pinned_num_register_threads:3",
        "pinned_num_register_threads",
        "3",
    );
    refused(
        "pinned_num_register_threads:256",
        "pinned_num_register_threads",
        "256",
    );
    refused(
        "pinned_reserve_segment_size_mb:0",
        "pinned_reserve_segment_size_mb",
        "0",
    );
    refused(
        "max_non_split_rounding_mb:19",
        "max_non_split_rounding_mb",
        "19",
    );
    refused(
        "release_lock_on_cudamalloc:yes",
        "release_lock_on_cudamalloc",
        "yes",
    );
}

#[test]
fn backend_is_read_where_the_driver_allocator_is_offered() {
    let with = |t: &str| {
        AllocatorConfig::from_pytorch_conf_with_backend(t).unwrap_or_else(|e| panic!("{t}: {e}"))
    };
    assert_eq!(with("").1, AllocatorBackend::Native);
    assert_eq!(with("backend:native").1, AllocatorBackend::Native);
    let (c, b) = with("expandable_segments:True, backend : cudaMallocAsync");
    assert_eq!(b, AllocatorBackend::CudaMallocAsync);
    assert!(c.expandable_segments, "the other keys are still read");
    // A later pair overrides an earlier one, the backend as every key.
    assert_eq!(
        with("backend:cudaMallocAsync,backend:native").1,
        AllocatorBackend::Native
    );
    assert_eq!(
        AllocatorBackend::CudaMallocAsync.to_string(),
        "cudaMallocAsync"
    );
    // Errors are the same as without the backend: a bad backend, a bad other key.
    for (t, key, value) in [
        ("backend:magic", "backend", "magic"),
        (
            "backend:cudaMallocAsync,max_split_size_mb:1",
            "max_split_size_mb",
            "1",
        ),
    ] {
        match AllocatorConfig::from_pytorch_conf_with_backend(t) {
            Err(AllocError::AllocConf {
                key: k, value: v, ..
            }) => {
                assert_eq!((k.as_str(), v.as_str()), (key, value), "{t}")
            }
            other => panic!("{t}: {other:?}"),
        }
    }
    // The caching allocator alone still refuses the driver's.
    refused("backend:cudaMallocAsync", "backend", "cudaMallocAsync");
}

#[test]
fn malformed_syntax_is_refused() {
    refused("expandable_segments", "expandable_segments", "");
    refused("expandable_segments:", "expandable_segments", "");
    refused(
        "expandable_segments:,max_split_size_mb:64",
        "expandable_segments",
        "",
    );
    refused(",expandable_segments:True", ",", "");
    refused("expandable_segments:True,,max_split_size_mb:64", ",", "");
    refused(
        "expandable_segments:True:False",
        "expandable_segments",
        "True",
    );
    // A missing comma runs two pairs together (whitespace is dropped, as in PyTorch).
    refused(
        "expandable_segments:True max_split_size_mb:64",
        "expandable_segments",
        "Truemax_split_size_mb",
    );
}

#[test]
fn apply_sets_only_the_named_options() {
    let base = AllocatorConfig::default()
        .with_memory_limit(MemoryLimit::Fraction(0.5))
        .with_max_split_size(64 << 20)
        .with_roundup_power2_divisions(4);
    let c = base.apply_pytorch_conf("expandable_segments:True").unwrap();
    assert_eq!(c, base.with_expandable_segments(true));
    // A list sets every interval.
    let c = base
        .apply_pytorch_conf("roundup_power2_divisions:[1:2]")
        .unwrap();
    assert_eq!(
        c.roundup_power2_divisions,
        [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(c.max_split_size, Some(64 << 20));
    assert_eq!(c.memory_limit, Some(MemoryLimit::Fraction(0.5)));
}

#[test]
fn to_pytorch_conf_writes_the_keys() {
    assert_eq!(AllocatorConfig::default().to_pytorch_conf().unwrap(), "");
    let c = AllocatorConfig::default()
        .with_max_split_size(128 << 20)
        .with_roundup_power2_divisions(4)
        .with_garbage_collection_threshold(0.6)
        .with_expandable_segments(true);
    assert_eq!(
        c.to_pytorch_conf().unwrap(),
        "max_split_size_mb:128,roundup_power2_divisions:4,garbage_collection_threshold:0.6,\
         expandable_segments:True"
    );
    let c = AllocatorConfig::default().with_max_split_size((128 << 20) + 1);
    assert!(matches!(
        c.to_pytorch_conf(),
        Err(AllocError::InvalidConfig(_))
    ));
}

fn divisions() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), (0u32..=12).prop_map(|k| 1usize << k)]
}

fn config() -> impl Strategy<Value = AllocatorConfig> {
    (
        proptest::option::of(21usize..=1 << 20),
        prop_oneof![
            divisions().prop_map(|d| [d; ROUNDUP_POWER2_INTERVALS]),
            proptest::array::uniform16(divisions()),
        ],
        proptest::option::of(1e-9f64..1.0),
        any::<bool>(),
    )
        .prop_map(|(mb, d, gc, exp)| {
            let mut c = AllocatorConfig::default()
                .with_roundup_power2_divisions_per_interval(d)
                .with_expandable_segments(exp);
            if let Some(mb) = mb {
                c = c.with_max_split_size(mb << 20);
            }
            if let Some(t) = gc.filter(|&t| t > 0.0 && t < 1.0) {
                c = c.with_garbage_collection_threshold(t);
            }
            c
        })
}

/// Cases of the round trip (proptest's default); a few under Miri, which interprets every step.
const CASES: u32 = 256;
const CASES_UNDER_MIRI: u32 = 4;

proptest! {
    #![proptest_config(miri::miri_aware_config(CASES, CASES_UNDER_MIRI))]

    #[test]
    fn round_trip(c in config()) {
        let text = c.to_pytorch_conf().unwrap();
        let back = AllocatorConfig::from_pytorch_conf(&text).unwrap();
        prop_assert_eq!(&back, &c, "{}", text);
        // With spaces around every token and a trailing comma, the same.
        let mut spaced: String = text.chars().flat_map(|ch| [' ', ch]).collect();
        if !text.is_empty() {
            spaced.push_str(" ,");
        }
        prop_assert_eq!(AllocatorConfig::from_pytorch_conf(&spaced).unwrap(), c);
    }
}
