//! The embeddings' and the attention heads' kernels (`cu/nn_embed_heads.cu` of the nn program;
//! the bias kernels are held elsewhere) run on the host (`common::emulator`: the program as
//! NVRTC compiles it, a block's threads as host threads), each launched as its launcher
//! launches it (`launch::plan`: the launchers' own kernels, grids and parameters, on the
//! emulator's buffers), against its twin in `host::nn` **bitwise** (a NaN row of an
//! id out of range: any NaN, as `tests/gpu_nn.rs` holds it): embedding_forward_f32 (ids out of
//! range among them), embedding_backward_tokens_f32, embedding_backward_tokens_grouped_f32 on
//! the tokens grouped by id by the launcher's own `host::nn::group_by_id` (as
//! `launch::embedding_backward_tokens_host_ids` groups them), embedding_backward_positions_f32,
//! and heads_split / heads_merge into f32, bf16 and f16 for every layout `HeadsLayout::check`
//! accepts (q, k and v of qkv, the heads' own rows, heads from a column inside a wider row). The inputs repeat ids with gradients of mixed magnitudes,
//! so that an order of the additions other than the tokens' changes the bits (checked here:
//! the grouped kernel fed its tokens reversed differs from the twin); vocabularies and widths
//! are no multiples of the block (256) or the warp, rows are longer than a block, and the
//! 16-bit stores get values halfway between neighbours, past f16's range, subnormals, NaN and
//! infinities. Each output buffer has a guard tail past what the launcher allocates, which no
//! kernel may touch. What this cannot check is the hardware itself: `tests/gpu_nn.rs` does,
//! on a GPU.

mod common;

use common::emulator::{addr, bytes_of, values_of, Emulator};
use fsdp_kernels::host::{f32_to_bf16, f32_to_f16, nn};
use fsdp_kernels::launch::plan::{self, KernelLaunch};
use fsdp_kernels::Program;
use half::{bf16, f16};

/// Elements past each output buffer's end (the launcher's length) that must stay as they were.
const GUARD: usize = 19;
/// The guard tail's value.
const GUARD_F32: f32 = -1234.5;

fn emulator(test: &str) -> Option<&'static Emulator> {
    Emulator::build(Program::Nn, test)
}

/// Equal bits, or both NaN (`tests/gpu_nn.rs`'s `same`).
#[track_caller]
fn same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{what} [{i}]: kernel {a:e} ({:#x}) vs twin {b:e} ({:#x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

/// Equal 16-bit patterns.
#[track_caller]
fn same_u16(what: &str, got: &[u16], want: &[u16]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a, b, "{what} [{i}]: kernel {a:#06x} vs twin {b:#06x}");
    }
}

/// `v` with [`GUARD`] elements of [`GUARD_F32`] after it, as bytes.
fn guarded(v: &[f32]) -> Vec<u8> {
    let mut g = v.to_vec();
    g.extend([GUARD_F32; GUARD]);
    bytes_of(&g)
}

/// An f32 output buffer read back: its first `n` values, its guard tail checked.
#[track_caller]
fn unguarded(what: &str, b: &[u8], n: usize) -> Vec<f32> {
    let v: Vec<f32> = values_of(b);
    assert_eq!(v.len(), n + GUARD, "{what}: buffer length");
    assert!(
        v[n..].iter().all(|x| x.to_bits() == GUARD_F32.to_bits()),
        "{what}: written past the launcher's {n} elements: {:?}",
        &v[n..]
    );
    v[..n].to_vec()
}

/// The same for a 16-bit output buffer (guard elements of `guard` bits).
#[track_caller]
fn unguarded_u16(what: &str, b: &[u8], n: usize, guard: u16) -> Vec<u16> {
    let v: Vec<u16> = values_of(b);
    assert_eq!(v.len(), n + GUARD, "{what}: buffer length");
    assert!(
        v[n..].iter().all(|&x| x == guard),
        "{what}: written past the launcher's {n} elements: {:?}",
        &v[n..]
    );
    v[..n].to_vec()
}

/// Gradients whose additions do not commute in f32: `common::data` values scaled per row by
/// 10^0 … 10^8 (sign alternating), and some zeros of both signs and subnormals.
fn mixed_rows(n: usize, c: usize, seed: u64) -> Vec<f32> {
    let base = common::data(n * c, seed, 1.0);
    base.iter()
        .enumerate()
        .map(|(i, &x)| {
            let r = i / c;
            match i % 23 {
                5 => -0.0,
                11 => 0.0,
                17 => 3.0e-39 * if r % 2 == 0 { 1.0 } else { -1.0 },
                _ => {
                    let scale = [1.0f32, 1.0e4, 1.0e8, 1.0e2, 1.0e6][r % 5];
                    let sign = if (r / 5) % 2 == 0 { 1.0 } else { -1.0 };
                    x * scale * sign
                }
            }
        })
        .collect()
}

/// `n` values for the copies: `common::data` and, every third element, what rounding to 16 bits
/// gets wrong (halfway between bf16 and f16 neighbours, past f16's range, subnormals of both,
/// zeros of both signs, NaN and infinities).
fn copy_values(n: usize, seed: u64) -> Vec<f32> {
    let special = [
        f32::from_bits(0x3f80_8000), // halfway between two bf16 values (ties to even: down)
        f32::from_bits(0x3f81_8000), // halfway (ties to even: up)
        f32::from_bits(0x3f80_8001), // just past halfway
        f32::from_bits(0x3f80_1000), // halfway between two f16 values
        f32::from_bits(0x3f80_3000), // halfway, the other way
        f32::from_bits(0x3380_0000), // half an f16 subnormal's step
        6.0e-8,                      // an f16 subnormal
        65504.0,                     // f16's largest
        65520.0,                     // rounds to f16's infinity
        -70000.0,
        1.0e-40, // an f32 subnormal
        -3.0e-39,
        f32::MAX,
        0.0,
        -0.0,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // a signalling NaN's payload
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    common::data(n, seed, 3.0)
        .into_iter()
        .enumerate()
        .map(|(i, x)| {
            if i % 3 == 1 {
                special[(i / 3) % special.len()]
            } else {
                x
            }
        })
        .collect()
}

/// An embedding's shapes: `vocab` rows of `c` columns, `seqs` sequences of `t` tokens, `wpe`
/// (or `dwpe`) of `positions ≥ t` rows.
#[derive(Clone, Copy, Debug)]
struct Shape {
    vocab: usize,
    c: usize,
    t: usize,
    seqs: usize,
    positions: usize,
}

/// Several blocks with the last one partial (945 and 1665 elements); a row longer than a block
/// (c = 300) with `wpe` of exactly `t` rows; one position and one column; one sequence of a
/// block's worth plus one of tokens (257) in a vocabulary of 3 (ids repeated ~86 times).
const SHAPES: [Shape; 4] = [
    Shape {
        vocab: 37,
        c: 45,
        t: 7,
        seqs: 3,
        positions: 9,
    },
    Shape {
        vocab: 5,
        c: 300,
        t: 4,
        seqs: 2,
        positions: 4,
    },
    Shape {
        vocab: 3,
        c: 1,
        t: 1,
        seqs: 5,
        positions: 2,
    },
    Shape {
        vocab: 3,
        c: 33,
        t: 257,
        seqs: 1,
        positions: 260,
    },
];

/// `n` ids in `0..vocab`, repeated (a few ids many times), not sorted.
fn in_range_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|r| {
            if r % 3 == 0 {
                (vocab / 2) as u32
            } else {
                ((r * r * 31 + 7) % vocab) as u32
            }
        })
        .collect()
}

/// [`in_range_ids`] with ids out of range: `vocab` itself, past it, and `u32::MAX`.
fn ids_with_out_of_range(n: usize, vocab: usize) -> Vec<u32> {
    let mut ids = in_range_ids(n, vocab);
    for (at, id) in [
        (1, vocab as u32),
        (n / 2, vocab as u32 + 5),
        (n - 1, u32::MAX),
    ] {
        ids[at] = id;
    }
    ids
}

/// x[r] = wte[ids[r]] + wpe[r mod t], a NaN row for an id out of range; launched as
/// `launch::embedding_forward` launches it (`plan::embedding_forward`).
#[test]
fn embedding_forward_is_its_twin() {
    let Some(emu) = emulator("embedding_forward_is_its_twin") else {
        return;
    };
    for (s, sh) in SHAPES.iter().enumerate() {
        let Shape {
            vocab,
            c,
            t,
            seqs,
            positions,
        } = *sh;
        let n = t * seqs;
        let ids = ids_with_out_of_range(n, vocab);
        let seed = 10 * s as u64;
        let wte = mixed_rows(vocab, c, seed + 1);
        let wpe = mixed_rows(positions, c, seed + 2);
        let mut want = vec![0.0; n * c];
        nn::embedding_forward(&ids, &wte, &wpe, t, c, &mut want).unwrap();
        let mut bufs = vec![
            bytes_of(&ids),
            bytes_of(&wte),
            bytes_of(&wpe),
            guarded(&vec![f32::from_bits(0x7fab_cdef); n * c]),
        ];
        let launches = plan::embedding_forward(addr(0), addr(1), addr(2), addr(3), n, c, t, vocab);
        emu.run_plan(&mut bufs, &launches);
        let what = format!("embedding_forward_f32 {sh:?}");
        let got = unguarded(&what, &bufs[3], n * c);
        same(&what, &got, &want);
        // The rows of ids out of range are NaN (the kernel's canonical one), the others not.
        for (r, &id) in ids.iter().enumerate() {
            let row = &got[r * c..(r + 1) * c];
            if id as usize >= vocab {
                assert!(
                    row.iter().all(|x| x.to_bits() == 0x7fc0_0000),
                    "{what}: row {r}"
                );
            } else {
                assert!(row.iter().all(|x| !x.is_nan()), "{what}: row {r}");
            }
        }
    }
}

/// dwte[v] += dx[r] for each token r of id v, tokens in order, ids out of range adding nowhere;
/// launched as `launch::embedding_backward_tokens` launches it
/// (`plan::embedding_backward_tokens`).
#[test]
fn embedding_backward_tokens_is_its_twin() {
    let Some(emu) = emulator("embedding_backward_tokens_is_its_twin") else {
        return;
    };
    for (s, sh) in SHAPES.iter().enumerate() {
        let Shape {
            vocab, c, t, seqs, ..
        } = *sh;
        let n = t * seqs;
        let seed = 100 + 10 * s as u64;
        let dx = mixed_rows(n, c, seed + 1);
        let dwte0 = common::data(vocab * c, seed + 2, 0.1);
        for ids in [in_range_ids(n, vocab), ids_with_out_of_range(n, vocab)] {
            let mut want = dwte0.clone();
            nn::embedding_backward_tokens(&ids, &dx, c, &mut want).unwrap();
            let mut bufs = vec![bytes_of(&ids), bytes_of(&dx), guarded(&dwte0)];
            let launches = plan::embedding_backward_tokens(addr(0), addr(1), addr(2), n, c, vocab);
            emu.run_plan(&mut bufs, &launches);
            let what = format!("embedding_backward_tokens_f32 {sh:?}");
            same(&what, &unguarded(&what, &bufs[2], vocab * c), &want);
        }
    }
}

/// The grouped kernel's launch as `launch::embedding_backward_tokens_host_ids` makes it on the
/// uploaded groups (`plan::embedding_backward_tokens_host_ids`); `dwte` read back.
fn run_grouped(
    emu: &Emulator,
    (distinct, offsets, tokens): (&[u32], &[u32], &[u32]),
    dx: &[f32],
    c: usize,
    dwte0: &[f32],
    what: &str,
) -> Vec<f32> {
    let mut bufs = vec![
        bytes_of(distinct),
        bytes_of(offsets),
        bytes_of(tokens),
        bytes_of(dx),
        guarded(dwte0),
    ];
    let launches = plan::embedding_backward_tokens_host_ids(
        addr(0),
        addr(1),
        addr(2),
        addr(3),
        addr(4),
        distinct.len(),
        c,
    );
    emu.run_plan(&mut bufs, &launches);
    unguarded(what, &bufs[4], dwte0.len())
}

/// The grouped token backward gives the twin's bits (`host::nn::embedding_backward_tokens`, as
/// `tests/gpu_nn.rs` holds it): ids in range (the launcher refuses others), repeated, some of
/// the vocabulary never seen (its rows untouched). Fed each id's tokens reversed, it gives
/// other bits: the inputs make the order of the additions matter.
#[test]
fn embedding_backward_tokens_grouped_is_its_twin() {
    let Some(emu) = emulator("embedding_backward_tokens_grouped_is_its_twin") else {
        return;
    };
    let mut reversal_shows = false;
    for (s, sh) in SHAPES.iter().enumerate() {
        let Shape {
            vocab, c, t, seqs, ..
        } = *sh;
        let n = t * seqs;
        let seed = 200 + 10 * s as u64;
        let ids = in_range_ids(n, vocab);
        let dx = mixed_rows(n, c, seed + 1);
        let dwte0 = common::data(vocab * c, seed + 2, 0.1);
        let mut want = dwte0.clone();
        nn::embedding_backward_tokens(&ids, &dx, c, &mut want).unwrap();
        let (distinct, offsets, tokens) = nn::group_by_id(&ids, vocab);
        let what = format!("embedding_backward_tokens_grouped_f32 {sh:?}");
        let got = run_grouped(emu, (&distinct, &offsets, &tokens), &dx, c, &dwte0, &what);
        same(&what, &got, &want);

        let mut reversed = tokens.clone();
        for u in 0..distinct.len() {
            reversed[offsets[u] as usize..offsets[u + 1] as usize].reverse();
        }
        let other = run_grouped(emu, (&distinct, &offsets, &reversed), &dx, c, &dwte0, &what);
        reversal_shows |= other
            .iter()
            .zip(&want)
            .any(|(a, b)| a.to_bits() != b.to_bits());
    }
    assert!(
        reversal_shows,
        "the tokens' order never changed a bit: the inputs do not test the order"
    );
}

/// dwpe[p] += dx[r] for r = p, p + t, …, in order, rows of `dwpe` past `t` untouched; launched
/// as `launch::embedding_backward_positions` launches it (`plan::embedding_backward_positions`).
#[test]
fn embedding_backward_positions_is_its_twin() {
    let Some(emu) = emulator("embedding_backward_positions_is_its_twin") else {
        return;
    };
    // SHAPES, and sequences of a block's worth plus one of positions (t·c = 257) repeated.
    let more = [Shape {
        vocab: 1,
        c: 1,
        t: 257,
        seqs: 3,
        positions: 257,
    }];
    for (s, sh) in SHAPES.iter().chain(&more).enumerate() {
        let Shape {
            c,
            t,
            seqs,
            positions,
            ..
        } = *sh;
        let n = t * seqs;
        let seed = 300 + 10 * s as u64;
        let dx = mixed_rows(n, c, seed + 1);
        let dwpe0 = common::data(positions * c, seed + 2, 0.1);
        let mut want = dwpe0.clone();
        nn::embedding_backward_positions(&dx, t, c, &mut want).unwrap();
        let mut bufs = vec![bytes_of(&dx), guarded(&dwpe0)];
        emu.run_plan(
            &mut bufs,
            &plan::embedding_backward_positions(addr(0), addr(1), n, c, t),
        );
        let what = format!("embedding_backward_positions_f32 {sh:?}");
        same(&what, &unguarded(&what, &bufs[1], positions * c), &want);
    }
}

/// Every layout `HeadsLayout::check` accepts: q, k and v of qkv `[b·t, 3·h·d]`, the heads' own
/// rows `[b·t, h·d]`, heads from column 3 of rows 5 wider than they (offset + h·d < row), and one
/// head of one element. 546 and 4·2·5·70 = 2800 dense elements: several blocks, the last
/// partial; d = 7 and 70 no multiples of the warp.
fn layouts() -> Vec<nn::HeadsLayout> {
    let l = |b, t, h, d, row, offset| nn::HeadsLayout {
        b,
        t,
        h,
        d,
        row,
        offset,
    };
    let (b, t, h, d) = (2usize, 13usize, 3usize, 7usize);
    let e = h * d;
    vec![
        l(b, t, h, d, 3 * e, 0),
        l(b, t, h, d, 3 * e, e),
        l(b, t, h, d, 3 * e, 2 * e),
        l(b, t, h, d, e, 0),
        l(b, t, h, d, e + 5, 3),
        l(4, 2, 5, 70, 5 * 70, 0),
        l(3, 5, 1, 1, 1, 0),
        l(3, 5, 1, 1, 4, 3),
    ]
}

/// The twin's rounding of an f32 into a 16-bit destination's bits (none for f32).
type Rounding = Option<fn(f32) -> u16>;

/// The kernels' destination types: (suffix, rounding).
const KINDS: [(&str, Rounding); 3] = [
    ("f32", None),
    ("bf16", Some(f32_to_bf16)),
    ("f16", Some(f32_to_f16)),
];

/// The launch of `kernel` (`heads_split_<suffix>` or `heads_merge_<suffix>`) from buffer 0 to
/// buffer 1 as `launch::heads_split` and `launch::heads_merge` make it (`plan::heads_split`,
/// `plan::heads_merge` for the suffix's type), its kernel checked to be `kernel`.
fn heads_launch(kernel: &str, l: nn::HeadsLayout) -> Vec<KernelLaunch> {
    let (src, dst) = (addr(0), addr(1));
    let launches = match kernel {
        "heads_split_f32" => plan::heads_split::<f32>(src, dst, l),
        "heads_split_bf16" => plan::heads_split::<bf16>(src, dst, l),
        "heads_split_f16" => plan::heads_split::<f16>(src, dst, l),
        "heads_merge_f32" => plan::heads_merge::<f32>(src, dst, l),
        "heads_merge_bf16" => plan::heads_merge::<bf16>(src, dst, l),
        "heads_merge_f16" => plan::heads_merge::<f16>(src, dst, l),
        other => panic!("no heads kernel {other}"),
    }
    .unwrap();
    assert_eq!(launches.len(), 1, "{kernel}: one launch");
    assert_eq!(launches[0].kernel, kernel);
    launches
}

/// Heads out of token rows into dense `[b, h, t, d]` of f32, bf16 and f16: the twin's copy
/// (`host::nn::heads_split`), rounded as the cast kernel rounds (`f32_to_bf16`, `f32_to_f16`)
/// for the 16-bit kernels; every element written (the destination starts as NaN).
#[test]
fn heads_split_is_its_twin() {
    let Some(emu) = emulator("heads_split_is_its_twin") else {
        return;
    };
    for (i, l) in layouts().into_iter().enumerate() {
        let rows = copy_values(l.rows_len(), 400 + i as u64);
        let mut want = vec![0.0; l.heads_len()];
        nn::heads_split(&rows, l, &mut want).unwrap();
        for (suffix, round) in KINDS {
            let kernel = format!("heads_split_{suffix}");
            let what = format!("{kernel} {l:?}");
            let n = l.heads_len();
            let out = match round {
                None => guarded(&vec![f32::from_bits(0x7fab_cdef); n]),
                Some(_) => bytes_of(&vec![0x7fabu16; n + GUARD]),
            };
            let mut bufs = vec![bytes_of(&rows), out];
            emu.run_plan(&mut bufs, &heads_launch(&kernel, l));
            match round {
                None => same(&what, &unguarded(&what, &bufs[1], n), &want),
                Some(round) => {
                    let want: Vec<u16> = want.iter().map(|&x| round(x)).collect();
                    same_u16(&what, &unguarded_u16(&what, &bufs[1], n, 0x7fab), &want);
                }
            }
        }
    }
}

/// Dense heads into their places in token rows of f32, bf16 and f16: the twin's copy
/// (`host::nn::heads_merge`) over the rows' values (widened from 16 bits for the 16-bit
/// kernels, so that the columns no head covers round back to themselves), rounded as the cast
/// kernel rounds; the columns outside the heads untouched.
#[test]
fn heads_merge_is_its_twin() {
    let Some(emu) = emulator("heads_merge_is_its_twin") else {
        return;
    };
    for (i, l) in layouts().into_iter().enumerate() {
        let heads = copy_values(l.heads_len(), 500 + i as u64);
        let rows0 = common::data(l.rows_len(), 600 + i as u64, 2.0);
        for (suffix, round) in KINDS {
            let kernel = format!("heads_merge_{suffix}");
            let what = format!("{kernel} {l:?}");
            let n = l.rows_len();
            match round {
                None => {
                    let mut want = rows0.clone();
                    nn::heads_merge(&heads, l, &mut want).unwrap();
                    let mut bufs = vec![bytes_of(&heads), guarded(&rows0)];
                    emu.run_plan(&mut bufs, &heads_launch(&kernel, l));
                    same(&what, &unguarded(&what, &bufs[1], n), &want);
                }
                Some(round) => {
                    let rows16: Vec<u16> = rows0.iter().map(|&x| round(x)).collect();
                    let widen = |h: u16| {
                        if suffix == "bf16" {
                            bf16::from_bits(h).to_f32()
                        } else {
                            f16::from_bits(h).to_f32()
                        }
                    };
                    let mut want: Vec<f32> = rows16.iter().map(|&h| widen(h)).collect();
                    nn::heads_merge(&heads, l, &mut want).unwrap();
                    let want: Vec<u16> = want.iter().map(|&x| round(x)).collect();
                    let mut out = rows16.clone();
                    out.extend([0x7fabu16; GUARD]);
                    let mut bufs = vec![bytes_of(&heads), bytes_of(&out)];
                    emu.run_plan(&mut bufs, &heads_launch(&kernel, l));
                    same_u16(&what, &unguarded_u16(&what, &bufs[1], n, 0x7fab), &want);
                    // The columns no head covers are the rows' own values.
                    let got = values_of::<u16>(&bufs[1]);
                    for (k, (&g, &r)) in got.iter().zip(&rows16).enumerate() {
                        let col = k % l.row;
                        if col < l.offset || col >= l.offset + l.h * l.d {
                            assert_eq!(g, r, "{what}: column {col} of row {}", k / l.row);
                        }
                    }
                }
            }
        }
    }
}
