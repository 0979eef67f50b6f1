//! Unit tests of concrete layouts: offsets, alignment, aliases, empty and scalar parameters,
//! shard infos, byte ranges and device buffers.

use fsdp_device::{Buffer, DType};
use fsdp_flatparam::{cast_buffer, FlatParamLayout, Segment, SegmentKind, ShardParamInfo};
use half::bf16;

#[test]
fn sixteen_byte_alignment_matches_pytorch_use_orig_params() {
    // PyTorch with use_orig_params pads before each parameter to 16 bytes (4 f32 elements),
    // then pads the flat parameter itself to a multiple of the world size (a padding tensor in
    // `_init_flat_param_and_metadata`): alignment padding, no end padding when sharding.
    let layout = FlatParamLayout::builder(3)
        .param("a", &[3])
        .param("b", &[5])
        .param("c", &[2, 2])
        .align_bytes(16, DType::F32)
        .build()
        .unwrap();
    assert_eq!(layout.align_numel(), 4);
    let offsets: Vec<usize> = layout.params().iter().map(|p| p.offset()).collect();
    assert_eq!(offsets, [0, 4, 12]);
    assert_eq!(layout.unpadded_numel(), 18);
    assert_eq!(layout.padded_numel(), 18);
    assert_eq!(layout.shard_numel(), 6);
    assert_eq!(layout.end_padding_numel(), 0);
    assert_eq!(
        layout.segments(),
        [
            Segment {
                kind: SegmentKind::Param(0),
                range: 0..3
            },
            Segment {
                kind: SegmentKind::AlignmentPadding,
                range: 3..4
            },
            Segment {
                kind: SegmentKind::Param(1),
                range: 4..9
            },
            Segment {
                kind: SegmentKind::AlignmentPadding,
                range: 9..12
            },
            Segment {
                kind: SegmentKind::Param(2),
                range: 12..16
            },
            Segment {
                kind: SegmentKind::AlignmentPadding,
                range: 16..18
            },
        ]
    );
    assert_eq!(layout.padding_ranges(), [3..4, 9..12, 16..18]);
    assert_eq!(layout.numel_padded_in_shard(0).unwrap(), 0);
    assert_eq!(layout.numel_padded_in_shard(2).unwrap(), 0);
    // Byte ranges for device code.
    assert_eq!(layout.param_byte_range(1, DType::F32).unwrap(), 16..36);
    assert_eq!(layout.param_byte_range(1, DType::BF16).unwrap(), 8..18);
    assert_eq!(layout.shard_byte_range(2, DType::F32).unwrap(), 48..72);

    let flat = layout
        .flatten(&[vec![1.0f32; 3], vec![2.0; 5], vec![3.0; 4]])
        .unwrap();
    assert_eq!(
        flat,
        [1., 1., 1., 0., 2., 2., 2., 2., 2., 0., 0., 0., 3., 3., 3., 3., 0., 0.]
    );
}

#[test]
fn bf16_alignment_counts_elements_of_that_type() {
    let layout = FlatParamLayout::builder(1)
        .align_bytes(16, DType::BF16)
        .param("a", &[1])
        .param("b", &[1])
        .build()
        .unwrap();
    assert_eq!(layout.align_numel(), 8);
    assert_eq!(layout.params()[1].offset(), 8);
    assert_eq!(layout.padded_numel(), 9); // world size 1: no end padding
}

#[test]
fn shard_param_infos_of_a_parameter_spanning_ranks() {
    // 10 + 1 elements over 4 ranks: padded to 12, shards of 3.
    let layout = FlatParamLayout::builder(4)
        .param("w", &[2, 5])
        .param("s", &[])
        .build()
        .unwrap();
    assert_eq!(layout.padded_numel(), 12);
    assert_eq!(layout.params()[1].numel(), 1); // a scalar has one element
    assert_eq!(layout.params()[1].shape(), &[] as &[usize]);
    let piece = |off, n, start| ShardParamInfo {
        in_shard: true,
        offset_in_shard: off,
        numel_in_shard: n,
        intra_param_start_idx: start,
        intra_param_end_idx: start + n,
    };
    assert_eq!(
        layout.param_pieces(0).unwrap(),
        [
            (0, piece(0, 3, 0)),
            (1, piece(0, 3, 3)),
            (2, piece(0, 3, 6)),
            (3, piece(0, 1, 9))
        ]
    );
    assert_eq!(layout.param_pieces(1).unwrap(), [(3, piece(1, 1, 0))]);
    assert_eq!(
        layout.shard_param_infos(3).unwrap(),
        [piece(0, 1, 9), piece(1, 1, 0)]
    );
    assert_eq!(
        layout.shard_param_info(1, 0).unwrap(),
        ShardParamInfo::default()
    );
    assert_eq!(layout.numel_padded_in_shard(3).unwrap(), 1);
    assert_eq!(layout.numel_padded_in_shard(2).unwrap(), 0);
}

#[test]
fn zero_element_parameters_are_listed_as_pytorch_lists_them() {
    // "empty" sits at offset 3; shards of 2 are [0, 2) and [2, 4): rank 1 holds elements 2
    // and 3, so PyTorch's `_get_shard_metadata` lists it there with 0 elements.
    let layout = FlatParamLayout::builder(2)
        .param("a", &[3])
        .param("empty", &[4, 0])
        .param("b", &[1])
        .build()
        .unwrap();
    assert_eq!(layout.params()[1].range(), 3..3);
    let listed = ShardParamInfo {
        in_shard: true,
        offset_in_shard: 1,
        numel_in_shard: 0,
        intra_param_start_idx: 0,
        intra_param_end_idx: 0,
    };
    assert_eq!(layout.param_pieces(1).unwrap(), [(1, listed)]);
    assert!(!layout.shard_param_info(1, 0).unwrap().in_shard);
    assert_eq!(layout.shard_param_info(1, 1).unwrap(), listed);
    let flat = layout
        .flatten(&[vec![1.0f32; 3], vec![], vec![2.0]])
        .unwrap();
    let views = layout.views(&flat).unwrap();
    assert_eq!(views[1].shape(), &[4, 0]);
    assert!(views[1].is_empty());
    assert_eq!(
        layout
            .gather_param(1, &layout.shards(&flat).unwrap())
            .unwrap(),
        Vec::<f32>::new()
    );
    // The shard's views are the parameters it lists, the empty one included.
    let shard1 = layout.shard(&flat, 1).unwrap();
    let names: Vec<&str> = layout
        .shard_views(shard1, 1)
        .unwrap()
        .iter()
        .map(|v| v.name())
        .collect();
    assert_eq!(names, ["a", "empty", "b"]);

    // At offset 0, or on a shard boundary, or at the very end: in no shard.
    // (elements before, elements after, world size): shards of 2, 2, 3, and the end of 3.
    for (before, after, world) in [(0, 4, 2), (2, 2, 2), (6, 3, 3), (3, 0, 1)] {
        let mut b = FlatParamLayout::builder(world);
        if before > 0 {
            b = b.param("x", &[before]);
        }
        b = b.param("empty", &[0]);
        if after > 0 {
            b = b.param("y", &[after]);
        }
        let layout = b.build().unwrap();
        let i = layout.index_of("empty").unwrap();
        assert!(
            layout.param_pieces(i).unwrap().is_empty(),
            "offset {before}, world {world}"
        );
        for r in 0..world {
            assert!(!layout.shard_param_info(i, r).unwrap().in_shard);
        }
    }
}

#[test]
fn alignment_padding_is_counted_as_pytorch_counts_it() {
    // [3, 5, 7] aligned to 4 elements on 4 ranks: 3 | pad 1 | 5 | pad 3 | 7 = 19 elements,
    // then PyTorch pads the flat parameter to 20; no rank has end padding.
    let layout = FlatParamLayout::builder(4)
        .param("a", &[3])
        .param("b", &[5])
        .param("c", &[7])
        .align_numel(4)
        .build()
        .unwrap();
    assert_eq!(layout.unpadded_numel(), 20);
    assert_eq!(layout.padded_numel(), 20);
    assert_eq!(layout.end_padding_numel(), 0);
    for r in 0..4 {
        assert_eq!(layout.numel_padded_in_shard(r).unwrap(), 0);
    }
    assert_eq!(layout.padding_ranges(), [3..4, 9..12, 19..20]);
    // Without alignment: 15 elements, 1 of end padding on rank 3.
    let plain = FlatParamLayout::builder(4)
        .param("a", &[3])
        .param("b", &[5])
        .param("c", &[7])
        .build()
        .unwrap();
    assert_eq!((plain.unpadded_numel(), plain.padded_numel()), (15, 16));
    assert_eq!(plain.numel_padded_in_shard(3).unwrap(), 1);
}

#[test]
fn empty_layouts() {
    for layout in [
        FlatParamLayout::builder(4).build().unwrap(),
        FlatParamLayout::builder(4)
            .param("e", &[0])
            .build()
            .unwrap(),
    ] {
        assert_eq!(layout.padded_numel(), 0);
        assert_eq!(layout.shard_numel(), 0);
        let flat: Vec<f32> = layout
            .flatten(&vec![Vec::<f32>::new(); layout.num_params()])
            .unwrap();
        assert!(flat.is_empty());
        assert_eq!(layout.shards(&flat).unwrap().len(), 4);
        assert!(layout.segments().iter().all(|s| s.range.is_empty()));
    }
}

#[test]
fn tied_parameters_take_no_space_and_share_data() {
    let layout = FlatParamLayout::builder(2)
        .param("transformer.wte.weight", &[5, 2])
        .param("transformer.ln_f.weight", &[2])
        .alias("lm_head.weight", "transformer.wte.weight")
        .build()
        .unwrap();
    assert_eq!(layout.num_params(), 2);
    assert_eq!(layout.unpadded_numel(), 12);
    assert!(layout.is_alias("lm_head.weight"));
    assert!(!layout.is_alias("transformer.wte.weight"));
    let names: Vec<(&str, usize)> = layout.names().collect();
    assert_eq!(
        names,
        [
            ("transformer.wte.weight", 0),
            ("transformer.ln_f.weight", 1),
            ("lm_head.weight", 0)
        ]
    );
    let wte: Vec<f32> = (0..10).map(|i| i as f32).collect();
    let flat = layout.flatten(&[wte.clone(), vec![7.0, 8.0]]).unwrap();
    let head = layout.view(&flat, "lm_head.weight").unwrap();
    assert_eq!(head.name(), "lm_head.weight");
    assert_eq!(head.shape(), &[5, 2]);
    assert_eq!(&head[..], &wte[..]);
    let all = layout.named_views(&flat).unwrap();
    assert_eq!(all.len(), 3);
    assert!(std::ptr::eq(all[0].data(), all[2].data()));
}

#[test]
fn gradient_views_write_into_the_flat_buffer() {
    let layout = FlatParamLayout::builder(2)
        .param("w", &[2, 2])
        .param("b", &[3])
        .build()
        .unwrap();
    let mut grad = vec![bf16::ZERO; layout.padded_numel()];
    {
        let mut views = layout.views_mut(&mut grad).unwrap();
        let (first, rest) = views.split_at_mut(1);
        // Both views are alive at once: a backward pass may fill them in any order.
        rest[0].fill(bf16::from_f32(2.0));
        first[0].copy_from_slice(&[bf16::ONE; 4]);
        assert_eq!(first[0].shape(), &[2, 2]);
        assert_eq!(rest[0].name(), "b");
    }
    let expected: Vec<f32> = vec![1., 1., 1., 1., 2., 2., 2., 0.];
    assert_eq!(
        grad.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
        expected
    );
    // One parameter alone.
    layout.view_at_mut(&mut grad, 1).unwrap().into_data()[2] = bf16::from_f32(5.0);
    assert_eq!(grad[6].to_f32(), 5.0);
    // The gradient shard after an in-place reduce-scatter.
    let shard = layout.shard_mut(&mut grad, 1).unwrap();
    assert_eq!(shard.len(), 4);
    let mut shards = layout.shards_mut(&mut grad).unwrap();
    shards[1][3] = bf16::from_f32(9.0);
    assert_eq!(grad[7].to_f32(), 9.0);
}

#[test]
fn sharded_optimizer_steps_on_its_pieces() {
    let layout = FlatParamLayout::builder(2)
        .param("w", &[4])
        .param("b", &[2])
        .build()
        .unwrap();
    let flat = layout
        .flatten(&[vec![1.0f32, 2.0, 3.0, 4.0], vec![5.0, 6.0]])
        .unwrap();
    let mut shard = layout.shard(&flat, 1).unwrap().to_vec(); // [4, 5, 6]
    for mut piece in layout.shard_views_mut(&mut shard, 1).unwrap() {
        let info = piece.shard_param_info();
        if piece.name() == "w" {
            assert_eq!(
                (info.intra_param_start_idx, info.intra_param_end_idx),
                (3, 4)
            );
        }
        for x in piece.iter_mut() {
            *x *= 10.0;
        }
    }
    assert_eq!(shard, [40.0, 50.0, 60.0]);
}

#[test]
fn device_buffer_views_share_storage() {
    let layout = FlatParamLayout::builder(2)
        .param("w", &[2, 2])
        .param("b", &[3])
        .build()
        .unwrap();
    let flat = Buffer::zeros(DType::F32, layout.padded_numel()).unwrap();
    let views = layout.buffer_views(&flat).unwrap();
    assert_eq!(views.len(), 2);
    assert!(views.iter().all(|v| v.same_storage(&flat)));
    assert!(!views[0].overlaps(&views[1]));
    assert_eq!(
        views[1].byte_range(),
        layout.param_byte_range(1, DType::F32).unwrap()
    );
    views[1].copy_from_slice(&[1.0f32, 2.0, 3.0]).unwrap();
    let shard1 = layout.shard_buffer(&flat, 1).unwrap();
    assert_eq!(shard1.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 0.0]);
    assert_eq!(
        layout.buffer_view(&flat, 0).unwrap().byte_range(),
        layout.param_byte_range(0, DType::F32).unwrap()
    );

    // Mixed precision: cast the f32 shard into a bf16 shard buffer and back.
    let low = Buffer::zeros(DType::BF16, layout.shard_numel()).unwrap();
    cast_buffer(&shard1, &low).unwrap();
    let again = Buffer::zeros(DType::F32, layout.shard_numel()).unwrap();
    cast_buffer(&low, &again).unwrap();
    assert_eq!(again.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 0.0]);
}
