//! Every error case: bad input gives an error, never a panic.

use fsdp_device::{Buffer, DType};
use fsdp_flatparam::{cast_buffer, cast_into, FlatParamError, FlatParamLayout};

fn mlp(world_size: usize) -> FlatParamLayout {
    FlatParamLayout::builder(world_size)
        .param("fc1.weight", &[8, 4])
        .param("fc1.bias", &[8])
        .param("fc2.weight", &[2, 8])
        .param("fc2.bias", &[2])
        .build()
        .unwrap()
}

fn params() -> Vec<Vec<f32>> {
    vec![vec![1.0; 32], vec![2.0; 8], vec![3.0; 16], vec![4.0; 2]]
}

#[test]
fn world_size_zero() {
    let err = FlatParamLayout::builder(0)
        .param("w", &[2])
        .build()
        .unwrap_err();
    assert_eq!(err, FlatParamError::ZeroWorldSize);
    assert_eq!(
        FlatParamLayout::builder(0).build().unwrap_err(),
        FlatParamError::ZeroWorldSize
    );
}

#[test]
fn duplicate_names() {
    let dup = |b: fsdp_flatparam::FlatParamLayoutBuilder| b.build().unwrap_err();
    let expected = FlatParamError::DuplicateName { name: "w".into() };
    // parameter, parameter
    assert_eq!(
        dup(FlatParamLayout::builder(2)
            .param("w", &[2])
            .param("w", &[3])),
        expected
    );
    // alias named like a parameter
    assert_eq!(
        dup(FlatParamLayout::builder(2)
            .param("w", &[2])
            .param("v", &[2])
            .alias("w", "v")),
        expected
    );
    // parameter named like an alias
    assert_eq!(
        dup(FlatParamLayout::builder(2)
            .param("v", &[2])
            .alias("w", "v")
            .param("w", &[1])),
        expected
    );
    // alias, alias
    assert_eq!(
        dup(FlatParamLayout::builder(2)
            .param("v", &[2])
            .alias("w", "v")
            .alias("w", "v")),
        expected
    );
}

#[test]
fn alias_of_unknown_name() {
    let err = FlatParamLayout::builder(2)
        .param("wte.weight", &[4, 2])
        .alias("lm_head.weight", "wte.wieght")
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        FlatParamError::UnknownAliasTarget {
            alias: "lm_head.weight".into(),
            target: "wte.wieght".into()
        }
    );
    // A later parameter is not an earlier one.
    let err = FlatParamLayout::builder(2)
        .alias("lm_head.weight", "wte.weight")
        .param("wte.weight", &[4, 2])
        .build()
        .unwrap_err();
    assert!(matches!(err, FlatParamError::UnknownAliasTarget { .. }));
    // An alias of an alias resolves to the parameter.
    let layout = FlatParamLayout::builder(2)
        .param("a", &[3])
        .alias("b", "a")
        .alias("c", "b")
        .build()
        .unwrap();
    assert_eq!(layout.index_of("c"), Some(0));
    assert_eq!(layout.shared_params()[1].prim_index(), 0);
}

#[test]
fn numel_overflow() {
    // Of one parameter's shape.
    let err = FlatParamLayout::builder(1)
        .param("huge", &[usize::MAX, 2])
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        FlatParamError::NumelOverflow {
            what: "huge".into()
        }
    );
    // Of the running total.
    let err = FlatParamLayout::builder(1)
        .param("a", &[usize::MAX / 2 + 1])
        .param("b", &[usize::MAX / 2 + 1])
        .build()
        .unwrap_err();
    assert_eq!(err, FlatParamError::NumelOverflow { what: "b".into() });
    // Of the alignment padding before a parameter.
    let err = FlatParamLayout::builder(1)
        .align_numel(4)
        .param("a", &[usize::MAX - 1])
        .param("b", &[0])
        .build()
        .unwrap_err();
    assert_eq!(err, FlatParamError::NumelOverflow { what: "b".into() });
    // Of the end padding.
    let err = FlatParamLayout::builder(4)
        .param("a", &[usize::MAX - 1])
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        FlatParamError::NumelOverflow {
            what: "padding".into()
        }
    );
    // Of the size in bytes (the layout must fit in memory for every element type).
    let err = FlatParamLayout::builder(1)
        .param("a", &[usize::MAX / 8 + 1])
        .build()
        .unwrap_err();
    assert!(matches!(err, FlatParamError::NumelOverflow { .. }));
    // A zero dimension makes the product 0 whatever the others are.
    let layout = FlatParamLayout::builder(1)
        .param("empty", &[usize::MAX, 0, usize::MAX])
        .build()
        .unwrap();
    assert_eq!(layout.padded_numel(), 0);
}

#[test]
fn invalid_alignment() {
    for b in [
        FlatParamLayout::builder(2).align_bytes(0, DType::F32),
        FlatParamLayout::builder(2).align_bytes(6, DType::F32),
        FlatParamLayout::builder(2).align_bytes(4, DType::F64),
        FlatParamLayout::builder(2).align_numel(0),
    ] {
        assert!(matches!(
            b.param("w", &[3]).build(),
            Err(FlatParamError::InvalidAlignment { .. })
        ));
    }
}

#[test]
fn flatten_with_wrong_parameters() {
    let layout = mlp(3);
    let mut p = params();
    p.pop();
    assert_eq!(
        layout.flatten(&p).unwrap_err(),
        FlatParamError::CountMismatch {
            what: "parameters",
            expected: 4,
            actual: 3
        }
    );
    let mut p = params();
    p[1].push(0.0);
    assert_eq!(
        layout.flatten(&p).unwrap_err(),
        FlatParamError::LengthMismatch {
            what: "parameter `fc1.bias`".into(),
            expected: 8,
            actual: 9
        }
    );
    let mut flat = vec![0.0f32; 60];
    assert!(layout.flatten_into(&p, &mut flat).is_err());
    let mut shard = vec![0.0f32; 20];
    assert!(layout.flatten_shard_into(&p, 0, &mut shard).is_err());
}

#[test]
fn buffer_length_mismatch() {
    let layout = mlp(3);
    let p = params();
    let length_err = |r: Result<(), FlatParamError>| {
        assert!(
            matches!(r, Err(FlatParamError::LengthMismatch { .. })),
            "{r:?}"
        )
    };
    // Flat buffers must be padded_numel (60) long: 58 (unpadded) is not enough.
    let mut short = vec![0.0f32; 58];
    length_err(layout.flatten_into(&p, &mut short));
    length_err(layout.views(&short).map(drop));
    length_err(layout.named_views(&short).map(drop));
    length_err(layout.view(&short, "fc1.bias").map(drop));
    length_err(layout.view_at(&short, 0).map(drop));
    length_err(layout.views_mut(&mut short).map(drop));
    length_err(layout.view_at_mut(&mut short, 0).map(drop));
    length_err(layout.shard(&short, 0).map(drop));
    length_err(layout.shard_mut(&mut short, 0).map(drop));
    length_err(layout.shards(&short).map(drop));
    length_err(layout.shards_mut(&mut short).map(drop));
    // Shards must be shard_numel (20) long.
    let mut bad_shard = vec![0.0f32; 21];
    length_err(layout.flatten_shard_into(&p, 1, &mut bad_shard));
    length_err(layout.shard_views(&bad_shard, 1).map(drop));
    length_err(layout.shard_views_mut(&mut bad_shard, 1).map(drop));
    length_err(layout.scatter_param_to_shard(0, &p[0], 1, &mut bad_shard));
    let shards = vec![vec![0.0f32; 20], vec![0.0f32; 19], vec![0.0f32; 20]];
    let mut flat = vec![0.0f32; 60];
    length_err(layout.unshard_into(&shards, &mut flat));
    length_err(layout.gather_param(0, &shards).map(drop));
    let mut shards_mut = shards.clone();
    length_err(layout.scatter_param(0, &p[0], &mut shards_mut));
    // The parameter given to gather/scatter must have its numel.
    let good = vec![vec![0.0f32; 20]; 3];
    let mut out = vec![0.0f32; 31];
    length_err(layout.gather_param_into(0, &good, &mut out));
    let mut good_mut = good.clone();
    length_err(layout.scatter_param(0, &out, &mut good_mut));
    let mut shard = vec![0.0f32; 20];
    length_err(layout.scatter_param_to_shard(0, &out, 0, &mut shard));
    // Casts need equal lengths.
    let mut dst = vec![half::bf16::ZERO; 3];
    length_err(cast_into(&[1.0f32; 4], &mut dst));
    // So do device buffers.
    let buf = Buffer::zeros(DType::F32, 59).unwrap();
    length_err(layout.buffer_views(&buf).map(drop));
    length_err(layout.buffer_view(&buf, 0).map(drop));
    length_err(layout.shard_buffer(&buf, 0).map(drop));
    length_err(cast_buffer(&buf, &Buffer::zeros(DType::BF16, 58).unwrap()));
}

#[test]
fn wrong_number_of_shards() {
    let layout = mlp(3);
    let two = vec![vec![0.0f32; 20]; 2];
    let mut flat = vec![0.0f32; 60];
    let count = FlatParamError::CountMismatch {
        what: "shards",
        expected: 3,
        actual: 2,
    };
    assert_eq!(layout.unshard_into(&two, &mut flat).unwrap_err(), count);
    assert_eq!(layout.gather_param(1, &two).unwrap_err(), count);
    let mut two_mut = two.clone();
    assert_eq!(
        layout
            .scatter_param(1, &[0.0f32; 8], &mut two_mut)
            .unwrap_err(),
        count
    );
}

#[test]
fn rank_out_of_range() {
    let layout = mlp(3);
    let expected = FlatParamError::RankOutOfRange {
        rank: 3,
        world_size: 3,
    };
    let flat = vec![0.0f32; 60];
    let mut flat_mut = flat.clone();
    let shard = vec![0.0f32; 20];
    let mut shard_mut = shard.clone();
    assert_eq!(layout.shard_range(3).unwrap_err(), expected);
    assert_eq!(
        layout.shard_byte_range(3, DType::F32).unwrap_err(),
        expected
    );
    assert_eq!(layout.numel_padded_in_shard(3).unwrap_err(), expected);
    assert_eq!(layout.shard_param_info(0, 3).unwrap_err(), expected);
    assert_eq!(layout.shard_param_infos(3).unwrap_err(), expected);
    assert_eq!(layout.shard(&flat, 3).unwrap_err(), expected);
    assert_eq!(layout.shard_mut(&mut flat_mut, 3).unwrap_err(), expected);
    assert_eq!(layout.shard_views(&shard, 3).unwrap_err(), expected);
    assert_eq!(
        layout.shard_views_mut(&mut shard_mut, 3).unwrap_err(),
        expected
    );
    assert_eq!(
        layout
            .flatten_shard_into(&params(), 3, &mut shard_mut)
            .unwrap_err(),
        expected
    );
    assert_eq!(
        layout
            .scatter_param_to_shard(0, &[0.0f32; 32], 3, &mut shard_mut)
            .unwrap_err(),
        expected
    );
    let buf = Buffer::zeros(DType::F32, 60).unwrap();
    assert_eq!(layout.shard_buffer(&buf, 3).unwrap_err(), expected);
}

#[test]
fn unknown_parameter() {
    let layout = mlp(3);
    let expected = FlatParamError::ParamIndexOutOfRange {
        index: 4,
        num_params: 4,
    };
    let flat = vec![0.0f32; 60];
    let mut flat_mut = flat.clone();
    let shards = vec![vec![0.0f32; 20]; 3];
    let mut shards_mut = shards.clone();
    assert_eq!(layout.param(4).unwrap_err(), expected);
    assert_eq!(layout.param_pieces(4).unwrap_err(), expected);
    assert_eq!(layout.shard_param_info(4, 0).unwrap_err(), expected);
    assert_eq!(
        layout.param_byte_range(4, DType::BF16).unwrap_err(),
        expected
    );
    assert_eq!(layout.view_at(&flat, 4).unwrap_err(), expected);
    assert_eq!(layout.view_at_mut(&mut flat_mut, 4).unwrap_err(), expected);
    assert_eq!(layout.gather_param(4, &shards).unwrap_err(), expected);
    assert_eq!(
        layout
            .scatter_param(4, &[0.0f32; 1], &mut shards_mut)
            .unwrap_err(),
        expected
    );
    let buf = Buffer::zeros(DType::F32, 60).unwrap();
    assert_eq!(layout.buffer_view(&buf, 4).unwrap_err(), expected);
    assert_eq!(
        layout.view(&flat, "fc3.weight").unwrap_err(),
        FlatParamError::UnknownName {
            name: "fc3.weight".into()
        }
    );
    assert_eq!(layout.index_of("fc3.weight"), None);
}

#[test]
fn cast_buffer_refuses_overlap() {
    let buf = Buffer::zeros(DType::F32, 8).unwrap();
    let a = buf.slice(0..4).unwrap();
    let b = buf.slice(2..6).unwrap();
    assert!(matches!(
        cast_buffer(&a, &b),
        Err(FlatParamError::Overlap(_))
    ));
    // Disjoint slices of one storage are fine.
    let c = buf.slice(4..8).unwrap();
    cast_buffer(&a, &c).unwrap();
}

#[test]
fn errors_display_their_context() {
    let err = mlp(3).flatten(&[vec![0.0f32; 31]]).unwrap_err();
    assert_eq!(err.to_string(), "expected 4 parameters, got 1");
    let err = mlp(3).views(&[0.0f32; 58]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the unsharded flat buffer has 58 elements, the layout requires 60"
    );
}
