//! The model's API: configuration, parameter specs, initialisation, the Params/Grads traits over
//! flat buffers, the errors of the stages, accumulation, speed, and learning the synthetic
//! corpus.

use std::collections::HashMap;
use std::time::Instant;

use fsdp::optim::{AdamWConfig, AdamWState};
use fsdp::FsdpError;
use fsdp_gpt::data::{get_batch, synthetic_corpus, Batch};
use fsdp_gpt::model::{
    block_backward, block_forward, embed_backward, embed_forward, forward_backward, forward_loss,
    head_backward, head_forward, init_params, named_params, param_specs, zeros_like_params,
    BatchShape, GptConfig, Grads, Params,
};

fn tiny() -> GptConfig {
    GptConfig::tiny()
}

fn params(cfg: &GptConfig, seed: u64) -> HashMap<String, Vec<f32>> {
    named_params(cfg, init_params(cfg, seed)).unwrap()
}

fn batch(cfg: &GptConfig, k: u64, b: usize, t: usize) -> Batch {
    let toks = synthetic_corpus(5000, cfg.vocab_size as u16, 3);
    get_batch(&toks, k, b, t, 0, 1).unwrap()
}

#[test]
fn config_validation() {
    assert!(GptConfig::new(2, 2, 32, 16, 96).is_ok());
    assert!(GptConfig::gpt2().validate().is_ok());
    let err = GptConfig::new(2, 3, 32, 16, 96).unwrap_err();
    assert!(matches!(err, FsdpError::InvalidConfig { .. }));
    assert!(
        err.to_string().contains("not divisible by n_head 3"),
        "{err}"
    );
    for bad in [
        (0, 2, 32, 16, 96),
        (2, 0, 32, 16, 96),
        (2, 2, 0, 16, 96),
        (2, 2, 32, 0, 96),
        (2, 2, 32, 16, 0),
    ] {
        let err = GptConfig::new(bad.0, bad.1, bad.2, bad.3, bad.4).unwrap_err();
        assert!(err.to_string().contains("at least 1"), "{err}");
    }
    assert!(GptConfig::new(1, 1, usize::MAX / 2, 1, 1).is_err());
    assert_eq!(tiny().head_dim(), 16);
}

#[test]
fn param_specs_follow_nanogpt() {
    let cfg = tiny();
    let specs = param_specs(&cfg);
    assert_eq!(specs.len(), 2 + 12 * cfg.n_layer + 2);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        &names[..14],
        &[
            "transformer.wte.weight",
            "transformer.wpe.weight",
            "transformer.h.0.ln_1.weight",
            "transformer.h.0.ln_1.bias",
            "transformer.h.0.attn.c_attn.weight",
            "transformer.h.0.attn.c_attn.bias",
            "transformer.h.0.attn.c_proj.weight",
            "transformer.h.0.attn.c_proj.bias",
            "transformer.h.0.ln_2.weight",
            "transformer.h.0.ln_2.bias",
            "transformer.h.0.mlp.c_fc.weight",
            "transformer.h.0.mlp.c_fc.bias",
            "transformer.h.0.mlp.c_proj.weight",
            "transformer.h.0.mlp.c_proj.bias",
        ]
    );
    assert_eq!(
        &names[names.len() - 2..],
        &["transformer.ln_f.weight", "transformer.ln_f.bias"]
    );
    assert!(!names.iter().any(|n| n.starts_with("lm_head")));
    let shape = |n: &str| specs.iter().find(|s| s.name == n).unwrap().shape.clone();
    assert_eq!(shape("transformer.wte.weight"), vec![96, 32]);
    assert_eq!(shape("transformer.wpe.weight"), vec![16, 32]);
    assert_eq!(shape("transformer.h.1.attn.c_attn.weight"), vec![96, 32]);
    assert_eq!(shape("transformer.h.1.attn.c_proj.weight"), vec![32, 32]);
    assert_eq!(shape("transformer.h.1.mlp.c_fc.weight"), vec![128, 32]);
    assert_eq!(shape("transformer.h.1.mlp.c_proj.weight"), vec![32, 128]);
    assert_eq!(shape("transformer.h.1.mlp.c_fc.bias"), vec![128]);
    // GPT-2 small: 124,439,808 parameters with the tied head counted once.
    assert_eq!(GptConfig::gpt2().num_params(), 124_439_808);
    assert_eq!(tiny().num_params(), 29_056);
}

fn std_of(v: &[f32]) -> f64 {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    (v.iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt()
}

#[test]
fn init_follows_nanogpt() {
    let cfg = GptConfig::new(4, 4, 64, 64, 512).unwrap();
    let p = params(&cfg, 42);
    assert_eq!(params(&cfg, 42), p, "deterministic in the seed");
    assert_ne!(params(&cfg, 43), p);
    let s = |n: &str| std_of(&p[n]);
    assert!((s("transformer.wte.weight") - 0.02).abs() < 0.001);
    assert!((s("transformer.wpe.weight") - 0.02).abs() < 0.001);
    assert!((s("transformer.h.2.attn.c_attn.weight") - 0.02).abs() < 0.001);
    assert!((s("transformer.h.2.mlp.c_fc.weight") - 0.02).abs() < 0.001);
    let proj = 0.02 / (2.0f64 * 4.0).sqrt();
    assert!((s("transformer.h.3.attn.c_proj.weight") - proj).abs() < 0.0005);
    assert!((s("transformer.h.0.mlp.c_proj.weight") - proj).abs() < 0.0005);
    for (name, v) in &p {
        if name.ends_with(".bias") {
            assert!(v.iter().all(|&x| x == 0.0), "{name}");
        } else if name.contains(".ln_") {
            assert!(v.iter().all(|&x| x == 1.0), "{name}");
        }
    }
}

/// Views of one flat buffer, as the FSDP runtime will hand them.
fn split_views<'a>(cfg: &GptConfig, mut flat: &'a mut [f32]) -> HashMap<String, &'a mut [f32]> {
    let mut views = HashMap::new();
    for s in param_specs(cfg) {
        let (head, rest) = flat.split_at_mut(s.numel());
        views.insert(s.name, head);
        flat = rest;
    }
    views
}

#[test]
fn flat_buffer_views_give_the_same_results() {
    let cfg = tiny();
    let p = params(&cfg, 1);
    let b = batch(&cfg, 0, 4, 16);
    let mut grads = zeros_like_params(&cfg);
    let loss = forward_backward(&cfg, &p, &mut grads, &b, 64).unwrap();

    // Parameters as borrowed slices of one flat buffer, gradients as mutable views of another.
    let flat_p: Vec<f32> = param_specs(&cfg)
        .iter()
        .flat_map(|s| p[&s.name].iter().copied())
        .collect();
    let mut pviews: HashMap<&str, &[f32]> = HashMap::new();
    let specs = param_specs(&cfg);
    let mut off = 0;
    for s in &specs {
        pviews.insert(s.name.as_str(), &flat_p[off..off + s.numel()]);
        off += s.numel();
    }
    let mut flat_g = vec![0.0f32; cfg.num_params()];
    let loss2 = {
        let mut gviews = split_views(&cfg, &mut flat_g);
        forward_backward(&cfg, &pviews, &mut gviews, &b, 64).unwrap()
    };
    assert_eq!(loss, loss2);
    let mut off = 0;
    for s in &specs {
        assert_eq!(
            &flat_g[off..off + s.numel()],
            &grads[&s.name][..],
            "{}",
            s.name
        );
        off += s.numel();
    }
}

#[test]
fn gradients_accumulate_and_forward_loss_agrees() {
    let cfg = tiny();
    let p = params(&cfg, 2);
    let b = batch(&cfg, 1, 2, 16);
    let mut g1 = zeros_like_params(&cfg);
    let l1 = forward_backward(&cfg, &p, &mut g1, &b, 32).unwrap();
    let mut g2 = zeros_like_params(&cfg);
    forward_backward(&cfg, &p, &mut g2, &b, 32).unwrap();
    forward_backward(&cfg, &p, &mut g2, &b, 32).unwrap();
    // Equal up to rounding (backward adds into the buffers as it goes).
    for (name, g) in &g1 {
        let scale = g.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in g.iter().zip(&g2[name]) {
            assert!((2.0 * a - b).abs() <= 1e-6 * scale, "{name}");
        }
    }
    assert_eq!(forward_loss(&cfg, &p, &b, 32).unwrap(), l1);
    // The normaliser scales loss and gradients.
    let mut g3 = zeros_like_params(&cfg);
    let l3 = forward_backward(&cfg, &p, &mut g3, &b, 64).unwrap();
    assert!((l3 * 2.0 - l1).abs() < 1e-6);
    let w = "transformer.h.0.mlp.c_fc.weight";
    for (a, b) in g3[w].iter().zip(&g1[w]) {
        assert!((2.0 * a - b).abs() <= 1e-6 * b.abs().max(1e-6));
    }
}

#[test]
fn stages_touch_only_their_own_gradients() {
    let cfg = tiny();
    let p = params(&cfg, 3);
    let b = batch(&cfg, 2, 2, 8); // shorter than the block size
    let s = b.shape;
    let x = embed_forward(&cfg, &p, &b.inputs, s).unwrap();
    let (x, c0) = block_forward(&cfg, &p, 0, x, s).unwrap();
    let (x, c1) = block_forward(&cfg, &p, 1, x, s).unwrap();
    assert_eq!((c0.layer(), c1.layer(), c1.shape()), (0, 1, s));
    assert!(c0.bytes() > 0);
    let (_, hc) = head_forward(&cfg, &p, x, &b.targets, s, 16).unwrap();
    assert_eq!(hc.global_tokens(), 16);

    let nonzero = |g: &HashMap<String, Vec<f32>>| -> Vec<String> {
        let mut v: Vec<String> = g
            .iter()
            .filter(|(_, v)| v.iter().any(|&x| x != 0.0))
            .map(|(k, _)| k.clone())
            .collect();
        v.sort();
        v
    };
    let mut g = zeros_like_params(&cfg);
    let dx = head_backward(&cfg, &p, &mut g, &hc, 1.0).unwrap();
    assert_eq!(
        nonzero(&g),
        [
            "transformer.ln_f.bias",
            "transformer.ln_f.weight",
            "transformer.wte.weight"
        ]
    );
    let mut g = zeros_like_params(&cfg);
    let dx = block_backward(&cfg, &p, &mut g, 1, &c1, &dx).unwrap();
    assert!(nonzero(&g)
        .iter()
        .all(|n| n.starts_with("transformer.h.1.")));
    assert_eq!(nonzero(&g).len(), 12);
    let mut g = zeros_like_params(&cfg);
    let dx = block_backward(&cfg, &p, &mut g, 0, &c0, &dx).unwrap();
    assert!(nonzero(&g)
        .iter()
        .all(|n| n.starts_with("transformer.h.0.")));
    let mut g = zeros_like_params(&cfg);
    embed_backward(&cfg, &mut g, &b.inputs, s, &dx).unwrap();
    assert_eq!(
        nonzero(&g),
        ["transformer.wpe.weight", "transformer.wte.weight"]
    );
    // Positions beyond the sequence length get no gradient.
    assert!(g["transformer.wpe.weight"][8 * 32..]
        .iter()
        .all(|&v| v == 0.0));

    // The head backward's dloss scales its gradients linearly.
    let mut g1 = zeros_like_params(&cfg);
    let mut g4 = zeros_like_params(&cfg);
    head_backward(&cfg, &p, &mut g1, &hc, 1.0).unwrap();
    head_backward(&cfg, &p, &mut g4, &hc, 4.0).unwrap();
    for (a, b) in g1["transformer.ln_f.weight"]
        .iter()
        .zip(&g4["transformer.ln_f.weight"])
    {
        assert!((4.0 * a - b).abs() <= 1e-6 * b.abs().max(1e-6));
    }
}

#[test]
fn bad_inputs_are_errors() {
    let cfg = tiny();
    let p = params(&cfg, 4);
    let b = batch(&cfg, 0, 2, 16);
    let s = b.shape;
    let mut g = zeros_like_params(&cfg);

    let mut bad = b.clone();
    bad.inputs[3] = 96;
    assert!(matches!(
        forward_backward(&cfg, &p, &mut g, &bad, 32),
        Err(FsdpError::TokenOutOfVocab {
            token: 96,
            vocab_size: 96
        })
    ));
    let mut bad = b.clone();
    bad.targets[0] = 1000;
    assert!(matches!(
        forward_loss(&cfg, &p, &bad, 32),
        Err(FsdpError::TokenOutOfVocab { token: 1000, .. })
    ));
    let long = batch(&cfg, 0, 1, 17);
    let err = forward_loss(&cfg, &p, &long, 17).unwrap_err();
    assert!(
        err.to_string().contains("exceeds the block size 16"),
        "{err}"
    );
    let mut bad = b.clone();
    bad.inputs.pop();
    assert!(matches!(
        embed_forward(&cfg, &p, &bad.inputs, s),
        Err(FsdpError::InvalidShape { .. })
    ));
    assert!(matches!(
        forward_loss(&cfg, &p, &b, 0),
        Err(FsdpError::InvalidShape { .. })
    ));

    // Missing and mis-sized parameters.
    let mut missing = p.clone();
    missing.remove("transformer.h.1.ln_2.bias");
    let err = forward_loss(&cfg, &missing, &b, 32).unwrap_err();
    assert!(
        matches!(err, FsdpError::UnknownParameter { ref name } if name == "transformer.h.1.ln_2.bias")
    );
    let mut short = p.clone();
    short.get_mut("transformer.wpe.weight").unwrap().pop();
    assert!(matches!(
        forward_loss(&cfg, &short, &b, 32),
        Err(FsdpError::ParameterLength {
            expected: 512,
            actual: 511,
            ..
        })
    ));

    // Layers and caches.
    let x = embed_forward(&cfg, &p, &b.inputs, s).unwrap();
    assert!(matches!(
        block_forward(&cfg, &p, 2, x.clone(), s),
        Err(FsdpError::LayerOutOfRange {
            layer: 2,
            n_layer: 2
        })
    ));
    assert!(matches!(
        block_forward(&cfg, &p, 0, x[1..].to_vec(), s),
        Err(FsdpError::InvalidShape { .. })
    ));
    let (y, c0) = block_forward(&cfg, &p, 0, x, s).unwrap();
    assert!(block_backward(&cfg, &p, &mut g, 1, &c0, &y).is_err());
    assert!(block_backward(&cfg, &p, &mut g, 0, &c0, &y[1..]).is_err());

    // A missing gradient is reported before any gradient is written.
    let mut g_missing = zeros_like_params(&cfg);
    g_missing.remove("transformer.h.0.ln_1.weight");
    let err = forward_backward(&cfg, &p, &mut g_missing, &b, 32).unwrap_err();
    assert!(matches!(err, FsdpError::UnknownParameter { .. }));
    assert!(g_missing.values().all(|v| v.iter().all(|&x| x == 0.0)));
    let err = block_backward(&cfg, &p, &mut g_missing, 0, &c0, &y).unwrap_err();
    assert!(matches!(err, FsdpError::UnknownParameter { .. }));
    assert!(g_missing.values().all(|v| v.iter().all(|&x| x == 0.0)));

    // The traits report unknown names.
    assert!(p.param("lm_head.weight").is_err());
    assert!(g.grad_mut("nope").is_err());
    assert!(named_params(&cfg, vec![vec![0.0; 3]]).is_err());
    let mut vals = init_params(&cfg, 0);
    vals[0].push(0.0);
    assert!(matches!(
        named_params(&cfg, vals),
        Err(FsdpError::ParameterLength { .. })
    ));
    let _ = BatchShape {
        rows: 1,
        seq_len: 1,
    }
    .tokens();
}

#[test]
fn forward_backward_is_fast_enough() {
    // 2 blocks, E = 32, 8×16 tokens: the runtime's tests call this many times.
    let cfg = tiny();
    let p = params(&cfg, 5);
    let b = batch(&cfg, 0, 8, 16);
    let mut g = zeros_like_params(&cfg);
    for _ in 0..5 {
        forward_backward(&cfg, &p, &mut g, &b, 128).unwrap();
    }
    let mut times = Vec::new();
    for _ in 0..30 {
        let t0 = Instant::now();
        forward_backward(&cfg, &p, &mut g, &b, 128).unwrap();
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "tiny GPT forward+backward, 8×16 tokens: median {:.1} µs",
        median * 1e6
    );
    // Generous bound (shared 2-core machines); the measured figure is printed above.
    assert!(median < 0.05, "median {median} s");
}

#[test]
fn the_tiny_model_learns_the_synthetic_corpus() {
    let cfg = tiny();
    let toks = synthetic_corpus(20_000, 96, 11);
    let mut p = params(&cfg, 6);
    let opt = AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut states: HashMap<String, AdamWState> = p
        .iter()
        .map(|(k, v)| (k.clone(), AdamWState::new(v.len())))
        .collect();
    let mut g = zeros_like_params(&cfg);
    let mut losses = Vec::new();
    for k in 0..150 {
        for v in g.values_mut() {
            v.fill(0.0);
        }
        let b = get_batch(&toks, k, 8, 16, 0, 1).unwrap();
        losses.push(forward_backward(&cfg, &p, &mut g, &b, 128).unwrap());
        for (name, v) in p.iter_mut() {
            states
                .get_mut(name)
                .unwrap()
                .step(&opt, v, &g[name])
                .unwrap();
        }
    }
    let first = losses[0];
    let last = losses[losses.len() - 10..].iter().sum::<f32>() / 10.0;
    println!("synthetic corpus: loss {first:.3} → {last:.3} (ln 96 = 4.564, entropy ≈ 1.14)");
    assert!((first - 96f32.ln()).abs() < 0.1);
    assert!(last < 2.5, "loss only fell to {last}");
}
