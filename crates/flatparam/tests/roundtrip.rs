//! Property tests: flatten, shard, gather and view round-trip bit for bit for random parameter
//! lists (zero-element and scalar parameters, aliases), world sizes 1..=16 and alignments.

use fsdp_device::{DType, Element};
use fsdp_flatparam::{FlatParamLayout, FlatParamLayoutBuilder, SegmentKind};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::FileFailurePersistence;

#[derive(Clone, Debug)]
enum Decl {
    Param(Vec<usize>),
    /// An alias of an earlier name, picked by the index (dropped when nothing precedes it).
    Alias(Index),
}

#[derive(Clone, Copy, Debug)]
enum Align {
    Off,
    Bytes(usize, DType),
    Numel(usize),
}

#[derive(Clone, Debug)]
struct Case {
    decls: Vec<Decl>,
    world_size: usize,
    align: Align,
    seed: u64,
}

fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        3 => prop::collection::vec(0usize..=6, 0..=3), // scalars, zero-element, small tensors
        1 => prop::collection::vec(1usize..=80, 1..=1), // longer vectors
        1 => Just(Vec::new()),                          // scalars, more often
    ]
}

fn case() -> impl Strategy<Value = Case> {
    let decl = prop_oneof![
        5 => shape().prop_map(Decl::Param),
        1 => any::<Index>().prop_map(Decl::Alias),
    ];
    let align = prop_oneof![
        2 => Just(Align::Off),
        1 => Just(Align::Bytes(16, DType::F32)),
        1 => Just(Align::Bytes(16, DType::BF16)),
        1 => Just(Align::Bytes(64, DType::F64)),
        1 => (1usize..=7).prop_map(Align::Numel),
    ];
    (
        prop::collection::vec(decl, 0..12),
        1usize..=16,
        align,
        any::<u64>(),
    )
        .prop_map(|(decls, world_size, align, seed)| Case {
            decls,
            world_size,
            align,
            seed,
        })
}

/// The layout of a case, and each parameter's shape in order (aliases left out).
fn build(case: &Case) -> (FlatParamLayout, Vec<Vec<usize>>, Vec<(String, String)>) {
    let mut b: FlatParamLayoutBuilder = FlatParamLayout::builder(case.world_size);
    b = match case.align {
        Align::Off => b,
        Align::Bytes(bytes, dtype) => b.align_bytes(bytes, dtype),
        Align::Numel(n) => b.align_numel(n),
    };
    let mut names: Vec<String> = Vec::new();
    let mut shapes = Vec::new();
    let mut aliases = Vec::new();
    for (i, d) in case.decls.iter().enumerate() {
        match d {
            Decl::Param(shape) => {
                let name = format!("layer{i}.weight");
                b = b.param(name.clone(), shape);
                names.push(name);
                shapes.push(shape.clone());
            }
            Decl::Alias(idx) if !names.is_empty() => {
                let target = names[idx.index(names.len())].clone();
                let name = format!("tied{i}");
                b = b.alias(name.clone(), target.clone());
                names.push(name.clone());
                aliases.push((name, target));
            }
            Decl::Alias(_) => {}
        }
    }
    (b.build().expect("valid case"), shapes, aliases)
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Random bit patterns (NaNs and negative zeros included): comparisons are bitwise.
fn random_values<T: Element>(numel: usize, rng: &mut Rng) -> Vec<T> {
    let mut v = vec![T::zeroed(); numel];
    for b in bytemuck::cast_slice_mut::<T, u8>(&mut v) {
        *b = rng.next() as u8;
    }
    v
}

fn bits<T: Element>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn roundtrip<T: Element>(case: &Case) -> Result<(), TestCaseError> {
    let (layout, shapes, aliases) = build(case);
    let ws = layout.world_size();
    let mut rng = Rng(case.seed);
    let params: Vec<Vec<T>> = layout
        .params()
        .iter()
        .map(|p| random_values(p.numel(), &mut rng))
        .collect();

    // Flatten, also into a buffer full of garbage: the same bits, padding zeroed.
    let flat = layout.flatten(&params).unwrap();
    prop_assert_eq!(flat.len(), layout.padded_numel());
    let mut flat2: Vec<T> = random_values(layout.padded_numel(), &mut rng);
    layout.flatten_into(&params, &mut flat2).unwrap();
    prop_assert_eq!(bits(&flat), bits(&flat2));

    // Shard on every rank (also built directly from the parameters): equal lengths.
    let mut shards: Vec<Vec<T>> = Vec::new();
    for rank in 0..ws {
        let shard = layout.shard(&flat, rank).unwrap();
        prop_assert_eq!(shard.len(), layout.shard_numel());
        let mut direct: Vec<T> = random_values(layout.shard_numel(), &mut rng);
        layout
            .flatten_shard_into(&params, rank, &mut direct)
            .unwrap();
        prop_assert_eq!(bits(shard), bits(&direct));
        shards.push(shard.to_vec());
    }
    prop_assert_eq!(layout.shard_numel() * ws, layout.padded_numel());
    prop_assert_eq!(layout.padded_numel() % ws, 0);
    prop_assert!(layout.padded_numel() - layout.unpadded_numel() < ws);

    // Concatenate the shards (all-gather) and view: the originals, bit for bit.
    let concat: Vec<T> = shards.concat();
    prop_assert_eq!(bits(&concat), bits(&flat));
    let mut gathered: Vec<T> = random_values(layout.padded_numel(), &mut rng);
    layout.unshard_into(&shards, &mut gathered).unwrap();
    prop_assert_eq!(bits(&gathered), bits(&flat));
    let views = layout.views(&gathered).unwrap();
    prop_assert_eq!(views.len(), params.len());
    for (i, v) in views.iter().enumerate() {
        prop_assert_eq!(bits(v), bits(&params[i]));
        prop_assert_eq!(v.shape(), &shapes[i][..]);
        prop_assert_eq!(v.numel(), shapes[i].iter().product::<usize>());
        prop_assert_eq!(v.index(), i);
    }
    // Aliases view the data of the parameter they tie to.
    let named = layout.named_views(&gathered).unwrap();
    prop_assert_eq!(named.len(), params.len() + aliases.len());
    for (alias, target) in &aliases {
        let a = layout.view(&gathered, alias).unwrap();
        let t = layout.view(&gathered, target).unwrap();
        prop_assert_eq!(a.name(), alias.as_str());
        prop_assert!(std::ptr::eq(a.data(), t.data()));
        prop_assert!(named
            .iter()
            .any(|v| v.name() == alias && v.index() == t.index()));
    }

    // Mutable views: writing every parameter through them rebuilds the flat buffer.
    let mut grad = vec![T::zeroed(); layout.padded_numel()];
    for mut g in layout.views_mut(&mut grad).unwrap() {
        let i = g.index();
        g.copy_from_slice(&params[i]);
    }
    prop_assert_eq!(bits(&grad), bits(&flat));
    Ok(())
}

fn pieces_and_padding(case: &Case) -> Result<(), TestCaseError> {
    let (layout, _, _) = build(case);
    let ws = layout.world_size();
    let n = layout.shard_numel();
    let mut rng = Rng(case.seed);
    let params: Vec<Vec<f32>> = layout
        .params()
        .iter()
        .map(|p| random_values(p.numel(), &mut rng))
        .collect();
    let flat = layout.flatten(&params).unwrap();
    let shards = layout.shards(&flat).unwrap();

    // The pieces of every parameter cover it exactly once and in order.
    for (i, p) in layout.params().iter().enumerate() {
        let pieces = layout.param_pieces(i).unwrap();
        let mut next = 0;
        let mut last_rank = None;
        for &(rank, piece) in &pieces {
            prop_assert!(piece.in_shard && (piece.numel_in_shard > 0 || p.numel() == 0));
            if p.numel() == 0 {
                // PyTorch lists it in the shard holding elements offset - 1 and offset.
                prop_assert!(p.offset() > rank * n && p.offset() < (rank + 1) * n);
                prop_assert_eq!(pieces.len(), 1);
            }
            prop_assert!(last_rank.is_none_or(|r| rank > r));
            prop_assert_eq!(piece.intra_param_start_idx, next);
            prop_assert_eq!(
                piece.intra_param_end_idx - piece.intra_param_start_idx,
                piece.numel_in_shard
            );
            prop_assert_eq!(
                rank * n + piece.offset_in_shard,
                p.offset() + piece.intra_param_start_idx
            );
            prop_assert!(piece.offset_in_shard + piece.numel_in_shard <= n);
            prop_assert_eq!(
                bits(&shards[rank][piece.shard_range()]),
                bits(&params[i][piece.intra_param_range()])
            );
            next = piece.intra_param_end_idx;
            last_rank = Some(rank);
        }
        prop_assert_eq!(next, p.numel());
        for rank in 0..ws {
            let info = layout.shard_param_info(i, rank).unwrap();
            let listed = pieces.iter().find(|(r, _)| *r == rank);
            prop_assert_eq!(info.in_shard, listed.is_some());
            if let Some((_, piece)) = listed {
                prop_assert_eq!(info, *piece);
            }
            prop_assert_eq!(layout.shard_param_infos(rank).unwrap()[i], info);
        }
    }
    // Views of a shard's pieces are exactly the pieces in it.
    for (rank, shard) in shards.iter().enumerate() {
        let views = layout.shard_views(shard, rank).unwrap();
        let expected: Vec<usize> = (0..layout.num_params())
            .filter(|&i| layout.shard_param_info(i, rank).unwrap().in_shard)
            .collect();
        prop_assert_eq!(
            views.iter().map(|v| v.index()).collect::<Vec<_>>(),
            expected
        );
        for v in &views {
            let piece = v.shard_param_info();
            prop_assert_eq!(bits(v), bits(&params[v.index()][piece.intra_param_range()]));
        }
    }

    // Padding only at the end, plus alignment gaps; all of it zero.
    let align = layout.align_numel();
    let segments = layout.segments();
    let mut pos = 0;
    let mut next_param = 0;
    for (k, s) in segments.iter().enumerate() {
        prop_assert_eq!(s.range.start, pos);
        pos = s.range.end;
        match s.kind {
            SegmentKind::Param(i) => {
                prop_assert_eq!(i, next_param);
                next_param += 1;
                prop_assert_eq!(s.range.clone(), layout.params()[i].range());
                prop_assert_eq!(s.range.start % align, 0);
            }
            SegmentKind::AlignmentPadding => {
                prop_assert!(align > 1 && !s.range.is_empty());
                match segments.get(k + 1).map(|s| s.kind) {
                    Some(SegmentKind::Param(_)) => prop_assert!(s.range.len() < align),
                    // With alignment, PyTorch pads the flat parameter to the world size.
                    None => {
                        prop_assert!(s.range.len() < ws);
                        prop_assert_eq!(s.range.end, layout.unpadded_numel());
                        prop_assert_eq!(layout.unpadded_numel() % ws, 0);
                    }
                    other => prop_assert!(false, "alignment padding before {:?}", other),
                }
            }
            SegmentKind::EndPadding => {
                prop_assert_eq!(k, segments.len() - 1);
                prop_assert_eq!(align, 1, "alignment leaves no end padding");
                prop_assert_eq!(s.range.start, layout.unpadded_numel());
                prop_assert!(!s.range.is_empty() && s.range.len() < ws);
            }
        }
    }
    prop_assert_eq!(pos, layout.padded_numel());
    prop_assert_eq!(next_param, layout.num_params());
    for r in layout.padding_ranges() {
        prop_assert!(flat[r].iter().all(|x| x.to_bits() == 0));
    }
    let end_padding: usize = (0..ws)
        .map(|r| layout.numel_padded_in_shard(r).unwrap())
        .sum();
    prop_assert_eq!(end_padding, layout.end_padding_numel());
    Ok(())
}

fn gather_scatter<T: Element>(case: &Case, which: Index) -> Result<(), TestCaseError> {
    let (layout, _, _) = build(case);
    if layout.num_params() == 0 {
        return Ok(());
    }
    let i = which.index(layout.num_params());
    let mut rng = Rng(case.seed);
    let mut params: Vec<Vec<T>> = layout
        .params()
        .iter()
        .map(|p| random_values(p.numel(), &mut rng))
        .collect();
    let flat = layout.flatten(&params).unwrap();
    let mut shards: Vec<Vec<T>> = layout
        .shards(&flat)
        .unwrap()
        .into_iter()
        .map(<[T]>::to_vec)
        .collect();
    let gathered = layout.gather_param(i, &shards).unwrap();
    prop_assert_eq!(bits(&gathered), bits(&params[i]));

    // Scatter new values for parameter i: only its pieces change, and they gather back.
    let new: Vec<T> = random_values(layout.params()[i].numel(), &mut rng);
    layout.scatter_param(i, &new, &mut shards).unwrap();
    let mut out: Vec<T> = random_values(new.len(), &mut rng);
    layout.gather_param_into(i, &shards, &mut out).unwrap();
    prop_assert_eq!(bits(&out), bits(&new));
    params[i] = new.clone();
    let expected = layout.flatten(&params).unwrap();
    let concat = shards.concat();
    prop_assert_eq!(bits(&concat), bits(&expected));

    // Rank by rank gives the same shards.
    for (rank, shard) in shards.iter().enumerate() {
        let mut own = layout.shard(&flat, rank).unwrap().to_vec();
        layout
            .scatter_param_to_shard(i, &new, rank, &mut own)
            .unwrap();
        prop_assert_eq!(bits(&own), bits(shard));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2048,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn flatten_shard_gather_view_roundtrip_f32(case in case()) {
        roundtrip::<f32>(&case)?;
    }

    #[test]
    fn flatten_shard_gather_view_roundtrip_16bit(case in case(), bf in any::<bool>()) {
        if bf { roundtrip::<bf16>(&case)?; } else { roundtrip::<f16>(&case)?; }
    }

    #[test]
    fn flatten_shard_gather_view_roundtrip_f64(case in case()) {
        roundtrip::<f64>(&case)?;
    }

    #[test]
    fn pieces_cover_params_once_and_padding_is_zero_at_the_end(case in case()) {
        pieces_and_padding(&case)?;
    }

    #[test]
    fn gather_scatter_of_one_param_roundtrips(case in case(), which in any::<Index>()) {
        gather_scatter::<f32>(&case, which)?;
        gather_scatter::<bf16>(&case, which)?;
    }
}
