//! Tests of the shared call description: both encodings round-trip, unreadable bytes are
//! refused, and the comparison names the ranks and the differing field.

use super::fixed::REASON_BYTES;
use super::*;

fn sample() -> OpDesc {
    let mut d = OpDesc::new("reduce");
    d.seq = 7;
    d.dtype = Some(DType::BF16);
    d.count = 1 << 40;
    d.reduce = Some(ReduceOp::Avg);
    d.root = Some(3);
    d
}

fn d(op: &'static str, count: usize) -> OpDesc {
    OpDesc {
        count,
        dtype: Some(DType::F32),
        ..OpDesc::new(op)
    }
}

#[test]
fn both_encodings_round_trip() {
    for op in OPS {
        let mut d = sample();
        d.op = op;
        assert_eq!(OpDesc::decode(&d.encode()), Ok(d.clone()));
        assert_eq!(OpDesc::decode_fixed(&d.encode_fixed()), Ok(d.clone()));
        d.invalid = Some("root 7 >= world size 2 — ünïcode".into());
        d.root = None;
        d.split = Some((Some(9), 4));
        d.sizes = Some(Sizes::List(vec![1, 2, 3]));
        assert_eq!(OpDesc::decode(&d.encode()), Ok(d.clone()));
        let fixed = OpDesc::decode_fixed(&d.encode_fixed()).unwrap();
        assert_eq!(
            fixed.sizes,
            Some(Sizes::Fingerprint(sizes_fingerprint(&[1, 2, 3])))
        );
        assert_eq!(fixed.invalid, d.invalid);
        assert_eq!(fixed.split, d.split);
        d.split = Some((None, 5));
        assert_eq!(
            OpDesc::decode_fixed(&d.encode_fixed()).unwrap().split,
            d.split
        );
    }
    for dt in DType::ALL {
        let mut d = sample();
        d.dtype = Some(dt);
        assert_eq!(
            OpDesc::decode_fixed(&d.encode_fixed()).unwrap().dtype,
            Some(dt)
        );
        assert_eq!(OpDesc::decode(&d.encode()).unwrap().dtype, Some(dt));
    }
    for op in ReduceOp::ALL {
        let mut d = sample();
        d.reduce = Some(op);
        assert_eq!(
            OpDesc::decode_fixed(&d.encode_fixed()).unwrap().reduce,
            Some(op)
        );
    }
    // A long reason is cut at a character boundary.
    let mut long = sample();
    long.invalid = Some("é".repeat(200));
    let back = OpDesc::decode_fixed(&long.encode_fixed()).unwrap();
    let why = back.invalid.unwrap();
    assert!(
        why.len() <= REASON_BYTES && why.chars().all(|c| c == 'é'),
        "{why}"
    );
}

#[test]
fn unreadable_bytes_are_refused() {
    assert!(OpDesc::decode(&[1, 0, 0, 0, b'x']).is_err());
    let mut trailing = sample().encode();
    trailing.push(0);
    assert!(OpDesc::decode(&trailing).unwrap_err().contains("trailing"));
    let err = decode_all_fixed(&[&sample().encode_fixed(), &[0u8; FIXED_BYTES]]).unwrap_err();
    assert!(
        err.contains("rank 1 sent an unreadable call description"),
        "{err}"
    );
    let mut bad_op = sample().encode_fixed();
    bad_op[16] = 99;
    assert!(OpDesc::decode_fixed(&bad_op)
        .unwrap_err()
        .contains("operation code 99"));
    assert_eq!(dtype_code(None), 0);
    assert_eq!(
        dtype_from_code(9),
        Err("unknown element type code 9".into())
    );
}

#[test]
fn compare_names_ranks_and_differences() {
    assert!(compare(&[d("all_reduce", 4), d("all_reduce", 4)], 0).is_ok());
    let err = compare(
        &[d("all_reduce", 4), d("all_reduce", 5), d("all_reduce", 4)],
        0,
    )
    .unwrap_err();
    assert!(
        err.contains("ranks [0, 2] issued all_reduce(dtype=float32, count=4"),
        "{err}"
    );
    assert!(
        err.contains("rank 1 issued all_reduce(dtype=float32, count=5"),
        "{err}"
    );
    let mut bad = d("broadcast", 3);
    bad.invalid = Some("root 7 >= world size 2".into());
    let err = compare(&[d("broadcast", 3), bad], 0).unwrap_err();
    assert!(
        err.contains("rank 1 issued broadcast with invalid arguments: root 7"),
        "{err}"
    );
    let mut late = d("barrier", 0);
    late.seq = 4;
    let err = compare(&[d("barrier", 0), late], 0).unwrap_err();
    assert!(
        err.contains("it is collective #4 on that rank, #0 here"),
        "{err}"
    );
}

#[test]
fn unequal_all_gather_sizes_must_be_the_input_lengths() {
    let ag = |count: usize, sizes: Sizes| OpDesc {
        sizes: Some(sizes),
        ..d("all_gather", count)
    };
    let list = Sizes::List(vec![1, 2]);
    assert!(compare(&[ag(1, list.clone()), ag(2, list.clone())], 0).is_ok());
    let err = compare(&[ag(1, list.clone()), ag(3, list)], 0).unwrap_err();
    assert!(err.contains("input lengths [1, 3]"), "{err}");
    let fp = Sizes::Fingerprint(sizes_fingerprint(&[1, 2]));
    assert!(compare(&[ag(1, fp.clone()), ag(2, fp)], 0).is_ok());
    let err = compare(
        &[
            ag(1, Sizes::List(vec![1, 2])),
            ag(2, Sizes::List(vec![2, 2])),
        ],
        0,
    )
    .unwrap_err();
    assert!(
        err.contains("rank 1 issued all_gather(dtype=float32, sizes=[2, 2])"),
        "{err}"
    );
    assert_ne!(sizes_fingerprint(&[1, 2]), sizes_fingerprint(&[2, 1]));
}
