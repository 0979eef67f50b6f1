//! Full safetensors checkpoints: nanoGPT names, PyTorch-readable, converted from bf16 and f16,
//! clear errors, atomic writes.

use super::*;

#[test]
fn full_round_trip_is_bitwise_and_has_nanogpt_names_and_shapes() {
    let (cfg, p) = small();
    let dir = temp_dir("round-trip");
    let path = dir.join("model.safetensors");
    save_full(&path, &cfg, &p).unwrap();
    let back = load_full(&path, &cfg).unwrap();
    assert_eq!(bits(&back), bits(&p));

    // The file itself: nanoGPT's names and shapes, F32, no lm_head, format = pt.
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), param_specs(&cfg).len());
    for s in param_specs(&cfg) {
        let t = st.tensor(&s.name).unwrap();
        assert_eq!(t.shape(), s.shape.as_slice(), "{}", s.name);
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
    }
    assert!(st.tensor("lm_head.weight").is_err());
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata()
            .as_ref()
            .unwrap()
            .get("format")
            .map(String::as_str),
        Some("pt")
    );
    // No temporary file left behind.
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);

    // Saving what was loaded gives the same bytes.
    let again = dir.join("again.safetensors");
    save_full(&again, &cfg, &back).unwrap();
    assert_eq!(fs::read(&again).unwrap(), bytes);
}

#[test]
fn golden_init_loads_to_the_fixture_values() {
    let cfg = cfg();
    let p = load_full(&common::fixture("gpt_tiny_init.safetensors"), &cfg).unwrap();
    assert_eq!(bits(&p), bits(&init()));
    // The golden weights after training too.
    let f = load_full(&common::fixture("expected_final.safetensors"), &cfg).unwrap();
    assert_eq!(bits(&f), bits(&load("expected_final.safetensors")));
}

#[test]
fn lm_head_equal_to_wte_is_accepted_and_a_different_one_is_not() {
    let (cfg, p) = small();
    let dir = temp_dir("lm-head");
    let path = dir.join("tied.safetensors");
    let mut t = spec_tensors(&cfg, &p);
    let wte = p["transformer.wte.weight"].clone();
    t.push((
        "lm_head.weight".into(),
        vec![cfg.vocab_size, cfg.n_embd],
        wte.clone(),
    ));
    write_safetensors(&path, &t);
    assert_eq!(bits(&load_full(&path, &cfg).unwrap()), bits(&p));

    // save_full accepts a map holding the tied lm_head and omits it.
    let mut with_head = p.clone();
    with_head.insert("lm_head.weight".into(), wte.clone());
    let saved = dir.join("saved.safetensors");
    save_full(&saved, &cfg, &with_head).unwrap();
    assert_eq!(bits(&load_full(&saved, &cfg).unwrap()), bits(&p));

    let mut other = wte;
    other[3] += 1.0;
    t.last_mut().unwrap().2 = other;
    write_safetensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(e.contains("`lm_head.weight` differs"), "{e}");
}

#[test]
fn bf16_and_f16_tensors_are_converted() {
    let (cfg, p) = small();
    let dir = temp_dir("half");
    let path = dir.join("half.safetensors");
    // Values exactly representable in bf16 (and f16 for the small ones): round each to bf16.
    let rounded: HashMap<String, Vec<f32>> = p
        .iter()
        .map(|(k, v)| {
            let r = v
                .iter()
                .map(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
                .collect();
            (k.clone(), r)
        })
        .collect();
    let specs = param_specs(&cfg);
    let data: Vec<RawTensor> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let v = &rounded[&s.name];
            if i % 2 == 0 {
                let b = v
                    .iter()
                    .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                    .collect();
                (s.name.clone(), safetensors::Dtype::BF16, s.shape.clone(), b)
            } else {
                f32_tensor(&s.name, &s.shape, v)
            }
        })
        .collect();
    write_raw_safetensors(&path, &data);
    assert_eq!(bits(&load_full(&path, &cfg).unwrap()), bits(&rounded));

    // F16: 1.0, -2.5, 2^-24 (smallest subnormal), 65504 (largest), 0, -0.
    let halves: [(u16, f32); 6] = [
        (0x3c00, 1.0),
        (0xc100, -2.5),
        (0x0001, 2f32.powi(-24)),
        (0x7bff, 65504.0),
        (0x0000, 0.0),
        (0x8000, -0.0),
    ];
    let mut t = spec_tensors(&cfg, &p);
    t.retain(|(n, _, _)| n != "transformer.h.0.ln_1.bias");
    let e = cfg.n_embd;
    let vals: Vec<u16> = (0..e).map(|i| halves[i % 6].0).collect();
    let b16: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut data: Vec<RawTensor> = t.iter().map(|(n, s, v)| f32_tensor(n, s, v)).collect();
    data.push((
        "transformer.h.0.ln_1.bias".to_owned(),
        safetensors::Dtype::F16,
        vec![e],
        b16,
    ));
    write_raw_safetensors(&path, &data);
    let got = load_full(&path, &cfg).unwrap();
    let ln = &got["transformer.h.0.ln_1.bias"];
    for (i, x) in ln.iter().enumerate() {
        assert_eq!(x.to_bits(), halves[i % 6].1.to_bits(), "element {i}");
    }
}

#[test]
fn load_full_errors_name_the_tensor_and_the_file() {
    let (cfg, p) = small();
    let dir = temp_dir("errors");
    let path = dir.join("bad.safetensors");

    // Missing tensor.
    let mut t = spec_tensors(&cfg, &p);
    t.retain(|(n, _, _)| n != "transformer.h.1.mlp.c_fc.bias");
    write_safetensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(
        e.contains("missing tensor `transformer.h.1.mlp.c_fc.bias`"),
        "{e}"
    );
    assert!(e.contains("bad.safetensors"), "{e}");

    // Wrong shape (same number of elements, transposed).
    let mut t = spec_tensors(&cfg, &p);
    for (n, s, _) in t.iter_mut() {
        if n == "transformer.h.0.attn.c_attn.weight" {
            *s = vec![s[1], s[0]];
        }
    }
    write_safetensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(
        e.contains(
            "tensor `transformer.h.0.attn.c_attn.weight` has shape [32, 96], expected [96, 32]"
        ),
        "{e}"
    );

    // Unexpected tensor.
    let mut t = spec_tensors(&cfg, &p);
    t.push((
        "transformer.h.2.ln_1.weight".into(),
        vec![32],
        vec![0.0; 32],
    ));
    write_safetensors(&path, &t);
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(
        e.contains("unexpected tensor `transformer.h.2.ln_1.weight`"),
        "{e}"
    );

    // A checkpoint of another model size: the first mismatch is named.
    let big = GptConfig::new(2, 2, 64, 16, 96).unwrap();
    let e = message(load_full(&common::fixture("gpt_tiny_init.safetensors"), &big).unwrap_err());
    assert!(
        e.contains("transformer.wte.weight") && e.contains("expected"),
        "{e}"
    );

    // Not a safetensors file.
    fs::write(&path, b"definitely not a safetensors file").unwrap();
    let e = message(load_full(&path, &cfg).unwrap_err());
    assert!(e.contains("not a safetensors file"), "{e}");
    assert!(e.contains("bad.safetensors"), "{e}");

    // Missing file.
    let e = message(load_full(&dir.join("nope.safetensors"), &cfg).unwrap_err());
    assert!(
        e.contains("nope.safetensors") && e.contains("cannot read"),
        "{e}"
    );
}

#[test]
fn save_full_validates_before_writing_and_is_atomic() {
    let (cfg, p) = small();
    let dir = temp_dir("atomic");
    let path = dir.join("model.safetensors");
    save_full(&path, &cfg, &p).unwrap();
    let before = fs::read(&path).unwrap();

    let mut changed = p.clone();
    for v in changed.values_mut() {
        v.iter_mut().for_each(|x| *x += 1.0);
    }

    // A parameter with the wrong size: an error naming it; the previous file is untouched.
    let mut bad = changed.clone();
    bad.get_mut("transformer.h.1.attn.c_proj.weight")
        .unwrap()
        .pop();
    let e = message(save_full(&path, &cfg, &bad).unwrap_err());
    assert!(e.contains("`transformer.h.1.attn.c_proj.weight`"), "{e}");
    // Missing and unexpected parameters.
    let mut bad = changed.clone();
    bad.remove("transformer.ln_f.bias");
    let e = message(save_full(&path, &cfg, &bad).unwrap_err());
    assert!(e.contains("missing tensor `transformer.ln_f.bias`"), "{e}");
    let mut bad = changed.clone();
    bad.insert("extra.weight".into(), vec![1.0]);
    let e = message(save_full(&path, &cfg, &bad).unwrap_err());
    assert!(e.contains("unexpected tensor `extra.weight`"), "{e}");
    assert_eq!(fs::read(&path).unwrap(), before);

    // A failure in the middle of writing (half of the new bytes written, then an I/O error):
    // the previous file is byte-identical and no temporary file is left.
    let e = write_atomic(&path, |w| {
        w.write_all(&vec![0xAB; before.len() / 2])?;
        Err(std::io::Error::other("simulated crash mid-save"))
    })
    .unwrap_err();
    assert!(message(e).contains("simulated crash"));
    assert_eq!(fs::read(&path).unwrap(), before);
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);

    // A successful save replaces it.
    save_full(&path, &cfg, &changed).unwrap();
    assert_eq!(bits(&load_full(&path, &cfg).unwrap()), bits(&changed));
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
}

#[test]
fn save_full_of_the_golden_init_matches_pytorchs_file() {
    // PyTorch's `safetensors.torch.save_file` wrote the fixture; ours has the same tensors in the
    // same order at the same offsets with the same bytes (only the metadata `format = pt` differs).
    let cfg = cfg();
    let fixture = fs::read(common::fixture("gpt_tiny_init.safetensors")).unwrap();
    let dir = temp_dir("golden-bytes");
    let path = dir.join("init.safetensors");
    save_full(
        &path,
        &cfg,
        &load_full(&common::fixture("gpt_tiny_init.safetensors"), &cfg).unwrap(),
    )
    .unwrap();
    let ours = fs::read(&path).unwrap();
    let header =
        |b: &[u8]| usize::try_from(u64::from_le_bytes(b[..8].try_into().unwrap())).unwrap();
    let (hf, ho) = (header(&fixture), header(&ours));
    assert_eq!(&ours[8 + ho..], &fixture[8 + hf..], "tensor data");
    let (_, mf) = safetensors::SafeTensors::read_metadata(&fixture).unwrap();
    let (_, mo) = safetensors::SafeTensors::read_metadata(&ours).unwrap();
    let infos = |m: &safetensors::tensor::Metadata| {
        let mut v: Vec<_> = m
            .tensors()
            .into_iter()
            .map(|(k, i)| (k, i.dtype, i.shape.clone(), i.data_offsets))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(infos(&mo), infos(&mf));
}
