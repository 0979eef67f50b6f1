//! Wrap policies over the reference GPT's module tree: the block policy, PyTorch's size rule on
//! hand-computed examples, custom closures, ignored modules, the tied-parameter error, and
//! random policies that always give a valid plan (or the tie error exactly when expected).

use std::sync::{Arc, Mutex};

use fsdp::wrap::{plan_units, Module, WrapOptions, WrapPolicy};
use fsdp::FsdpError;
use fsdp_gpt::model::{block_param_specs, param_specs, GptConfig};
use fsdp_gpt::tree::gpt_block_plan;
use fsdp_gpt::tree::gpt_module_tree;
use proptest::prelude::*;

#[path = "common/wrap.rs"]
mod helpers;
use helpers::{
    assert_covers_model, expected_owner, names, plan, size, small, tie_error, unit_names,
};

#[test]
fn block_policy_equals_the_hand_written_block_plan() {
    for cfg in [small(), GptConfig::tiny(), GptConfig::gpt2()] {
        let p = plan(&cfg, &WrapOptions::new(WrapPolicy::module_type(["Block"]))).unwrap();
        assert_eq!(p, gpt_block_plan(&cfg));
        assert_covers_model(&cfg, &p);
    }
}

#[test]
fn size_policy_hand_computed() {
    let cfg = small();
    let block = |i: usize| format!("transformer.h.{i}");

    // min 2000 > 1920 = the whole model: the root's recursion gate fails, one root unit.
    let p = size(&cfg, 2000).unwrap();
    assert_eq!(unit_names(&p), [""]);
    assert_eq!(p.units[0].params, param_specs(&cfg));

    // min 1920: the root recurses (1920 ≥ 1920), so does `transformer` (1920); `h` (1744) and
    // every block (872) are below the threshold, so nothing under them is wrapped. The remainder
    // of `transformer` is 1920 ≥ 1920 but it is a ModuleDict, which the size policy never wraps
    // (without that exclusion `transformer` would be a unit and split `wte` from `lm_head`).
    // `lm_head` (128) is small: one root unit.
    let p = size(&cfg, 1920).unwrap();
    assert_eq!(unit_names(&p), [""]);

    // min 872: inside a block nothing reaches 872 (ln 16, attn 288, mlp 552), so each block's
    // remainder is its full 872 ≥ 872: wrapped. `h`'s remainder is 0; `transformer`'s is
    // 128 + 32 + 16 = 176 < 872; the root owns wte, wpe, ln_f: exactly the block plan.
    let p = size(&cfg, 872).unwrap();
    assert_eq!(p, gpt_block_plan(&cfg));
    // One less changes nothing; one more (873) wraps no block: one root unit.
    assert_eq!(size(&cfg, 871).unwrap(), p);
    assert_eq!(unit_names(&size(&cfg, 873).unwrap()), [""]);

    // min 500: a block (872) recurses; `attn` (288) is below 500; `mlp` (552) recurses into
    // c_fc 288 and c_proj 264 (both < 500), then its remainder 552 ≥ 500 wraps it. The block's
    // remainder 872 − 552 = 320 < 500: not wrapped. `h`: 1744 − 2·552 = 640 ≥ 500 but a
    // ModuleList; `transformer`: 1920 − 1104 = 816 ≥ 500 but a ModuleDict; `lm_head` 128.
    // Units: root, h.0.mlp, h.1.mlp; the root owns the rest in pre-order, interleaved.
    let p = size(&cfg, 500).unwrap();
    assert_eq!(
        unit_names(&p),
        ["", "transformer.h.0.mlp", "transformer.h.1.mlp"]
    );
    let mut root = vec![
        "transformer.wte.weight".to_string(),
        "transformer.wpe.weight".to_string(),
    ];
    for i in 0..2 {
        let b: Vec<String> = block_param_specs(&cfg, i)
            .into_iter()
            .map(|s| s.name)
            .filter(|n| !n.contains(".mlp."))
            .collect();
        assert_eq!(b.len(), 8); // ln_1, attn.c_attn, attn.c_proj, ln_2: weight and bias each
        root.extend(b);
    }
    root.extend([
        "transformer.ln_f.weight".to_string(),
        "transformer.ln_f.bias".to_string(),
    ]);
    assert_eq!(names(&p.units[0].params), root);
    assert_eq!(
        names(&p.units[1].params),
        [
            "transformer.h.0.mlp.c_fc.weight",
            "transformer.h.0.mlp.c_fc.bias",
            "transformer.h.0.mlp.c_proj.weight",
            "transformer.h.0.mlp.c_proj.bias"
        ]
    );
    assert_eq!(p.units[1].numel(), 552);
    assert_eq!(p.units[0].numel(), 1920 - 2 * 552);
    assert_covers_model(&cfg, &p);

    // min 200: c_attn (216), mlp.c_fc (288) and mlp.c_proj (264) are wrapped; attn.c_proj (72)
    // is not, nor `attn` (remainder 72), nor `mlp` (remainder 0), nor the block (remainder
    // 16 + 72 + 16 = 104). `h` (remainder 208) and `transformer` (384) are containers;
    // `lm_head` (128) is small. Units in pre-order: the root, then per block its three Linears.
    let p = size(&cfg, 200).unwrap();
    let mut expected = vec![String::new()];
    for i in 0..2 {
        for m in ["attn.c_attn", "mlp.c_fc", "mlp.c_proj"] {
            expected.push(format!("{}.{m}", block(i)));
        }
    }
    assert_eq!(unit_names(&p), expected);
    let numels: Vec<usize> = p.units.iter().map(|u| u.numel()).collect();
    assert_eq!(numels, [1920 - 2 * 768, 216, 288, 264, 216, 288, 264]);
    assert_covers_model(&cfg, &p);

    // min 129 wraps the same Linears plus nothing else (ln 16, c_proj 72, wte/lm_head 128).
    assert_eq!(unit_names(&size(&cfg, 129).unwrap()), expected);

    // min 128: `wte` (128) and `lm_head` (128, its alias alone) each become a unit: the tie is
    // split, an error naming both parameters and both units.
    let (param, param_unit, tied_to, tied_to_unit) = tie_error(size(&cfg, 128).unwrap_err());
    assert_eq!(param, "lm_head.weight");
    assert_eq!(param_unit, "unit `lm_head`");
    assert_eq!(tied_to, "transformer.wte.weight");
    assert_eq!(tied_to_unit, "unit `transformer.wte`");

    // min 0: every module "reaches" 0, so every non-container module would be a unit (the
    // parameter-less and emptied ones would then be dropped): the same split.
    tie_error(size(&cfg, 0).unwrap_err());
}

#[test]
fn size_policy_on_gpt2_small() {
    // GPT-2 small: a block holds 12·768² + 13·768 = 7_087_872 elements; wte 50257·768 =
    // 38_597_376, and lm_head (the same storage) as much on its own. A threshold of 7M would
    // wrap every block (nothing inside one reaches it: its MLP holds 4_722_432), but also wte
    // and lm_head separately: the tie is split.
    let cfg = GptConfig::gpt2();
    tie_error(size(&cfg, 7_000_000).unwrap_err());
    // With the embedding and lm_head out of the way (both ignored), 7M is one unit per block.
    let opts = WrapOptions::new(WrapPolicy::size(7_000_000))
        .with_ignored_module("transformer.wte")
        .with_ignored_module("lm_head");
    let p = plan(&cfg, &opts).unwrap();
    assert_eq!(p.units.len(), 13);
    assert_eq!(p.units[1..], gpt_block_plan(&cfg).units[1..]);
    assert_covers_model(&cfg, &p);
    // 40M is above every module but the containers and the root (124M in all): one root unit.
    let p = size(&cfg, 40_000_000).unwrap();
    assert_eq!(unit_names(&p), [""]);
    // The default threshold (1e8) is above every module but the root: one root unit too.
    let p = size(&cfg, fsdp::wrap::DEFAULT_MIN_NUM_PARAMS).unwrap();
    assert_eq!(unit_names(&p), [""]);
    assert_eq!(p.units[0].numel(), cfg.num_params());
}

#[test]
fn custom_closure_sees_unwrapped_numel_bottom_up() {
    let cfg = small();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&calls);
    // Wrap every MLP, and every block whose remainder (after its MLP) is at least 300: a block
    // keeps 872 − 552 = 320 ≥ 300, so blocks are wrapped too.
    let policy = WrapPolicy::custom(move |m: &Module, numel| {
        log.lock().unwrap().push((m.name.clone(), numel));
        m.type_name == "MLP" || (m.type_name == "Block" && numel >= 300)
    });
    let p = plan(&cfg, &WrapOptions::new(policy)).unwrap();
    assert_eq!(
        unit_names(&p),
        [
            "",
            "transformer.h.0",
            "transformer.h.0.mlp",
            "transformer.h.1",
            "transformer.h.1.mlp"
        ]
    );
    assert_eq!(p.units[1].numel(), 320);
    assert_eq!(p.units[2].numel(), 552);
    assert_covers_model(&cfg, &p);

    let calls = calls.lock().unwrap();
    let pos = |n: &str| calls.iter().position(|(m, _)| m == n).unwrap();
    let numel = |n: &str| calls[pos(n)].1;
    // Children before parents, siblings in order, never the root.
    assert!(pos("transformer.h.0.mlp.c_fc") < pos("transformer.h.0.mlp"));
    assert!(pos("transformer.h.0.mlp") < pos("transformer.h.0"));
    assert!(pos("transformer.h.0") < pos("transformer.h.1"));
    assert!(pos("transformer") < pos("lm_head"));
    assert!(calls.iter().all(|(m, _)| !m.is_empty()));
    assert_eq!(numel("transformer.h.0"), 320);
    assert_eq!(numel("transformer.h"), 0);
    assert_eq!(numel("transformer"), 128 + 32 + 16);
    assert_eq!(numel("lm_head"), 128);
    assert_eq!(numel("transformer.drop"), 0);
    // 1 transformer + 5 in it + 2·(block, ln_1, attn + 4, ln_2, mlp + 4) + lm_head.
    assert_eq!(calls.len(), 1 + 5 + 2 * 13 + 1);
}

#[test]
fn module_type_policy_on_other_types() {
    let cfg = small();
    // Every LayerNorm: 2 per block and ln_f, in pre-order.
    let p = plan(
        &cfg,
        &WrapOptions::new(WrapPolicy::module_type(["LayerNorm"])),
    )
    .unwrap();
    assert_eq!(
        unit_names(&p),
        [
            "",
            "transformer.h.0.ln_1",
            "transformer.h.0.ln_2",
            "transformer.h.1.ln_1",
            "transformer.h.1.ln_2",
            "transformer.ln_f"
        ]
    );
    assert_covers_model(&cfg, &p);
    // Nested types: a block and its attention.
    let p = plan(
        &cfg,
        &WrapOptions::new(WrapPolicy::module_type(["Block", "CausalSelfAttention"])),
    )
    .unwrap();
    assert_eq!(p.units.len(), 5);
    assert_eq!(p.units[1].numel(), 872 - 288);
    assert_eq!(p.units[2].name, "transformer.h.0.attn");
    // Wrapping the container of the embedding and lm_head together keeps the tie together:
    // the root unit is left empty but is kept.
    let p = plan(&cfg, &WrapOptions::new(WrapPolicy::module_type(["GPT"]))).unwrap();
    assert_eq!(unit_names(&p), [""]);
    // Parameter-less wrapped modules are dropped.
    let p = plan(
        &cfg,
        &WrapOptions::new(WrapPolicy::module_type(["Dropout", "GELU"])),
    )
    .unwrap();
    assert_eq!(unit_names(&p), [""]);
    // `ModuleDict` wraps `transformer` and leaves `lm_head` in the root: split.
    let (_, param_unit, _, tied_to_unit) = tie_error(
        plan(
            &cfg,
            &WrapOptions::new(WrapPolicy::module_type(["ModuleDict"])),
        )
        .unwrap_err(),
    );
    assert_eq!(param_unit, "the root unit");
    assert_eq!(tied_to_unit, "unit `transformer`");
    // Every Linear includes `lm_head`, not `wte`: the alias lies in a unit nested in the root,
    // which holds the storage (the lowest common ancestor of its users); `lm_head` owns nothing
    // else and is dropped.
    let linear = plan(&cfg, &WrapOptions::new(WrapPolicy::module_type(["Linear"]))).unwrap();
    assert_eq!(linear.unit_of("transformer.wte.weight"), Some(0));
    assert!(linear.units.iter().all(|u| u.name != "lm_head"));
}

#[test]
fn wrapping_wte_alone_is_a_tie_error_but_lm_head_alone_is_not() {
    let cfg = small();
    // `lm_head` alone: its alias is nested in the root, which keeps the storage.
    let policy = WrapPolicy::custom(|m, _| m.name == "lm_head");
    let p = plan(&cfg, &WrapOptions::new(policy)).unwrap();
    assert_eq!(p.units.len(), 1);
    assert_eq!(p.unit_of("transformer.wte.weight"), Some(0));
    // `wte` alone: the storage would sit below its other user, `lm_head`, in the root.
    let policy = WrapPolicy::custom(|m, _| m.name == "transformer.wte");
    let err = plan(&cfg, &WrapOptions::new(policy)).unwrap_err();
    let msg = err.to_string();
    let (param, param_unit, tied_to, tied_to_unit) = tie_error(err);
    assert_eq!(param, "lm_head.weight");
    assert_eq!(tied_to, "transformer.wte.weight");
    assert_eq!(param_unit, "the root unit", "{msg}");
    assert_eq!(tied_to_unit, "unit `transformer.wte`", "{msg}");
}

#[test]
fn ignored_modules() {
    let cfg = small();
    // Block policy with block 1 ignored: its parameters stay replicated, in pre-order.
    let opts =
        WrapOptions::new(WrapPolicy::module_type(["Block"])).with_ignored_module("transformer.h.1");
    let p = plan(&cfg, &opts).unwrap();
    assert_eq!(unit_names(&p), ["", "transformer.h.0"]);
    assert_eq!(p.ignored, block_param_specs(&cfg, 1));
    assert_covers_model(&cfg, &p);

    // Ignored parameters do not count for the size policy: with block 0's MLP ignored, block 0
    // holds 872 − 552 = 320 < 500, block 1's MLP is wrapped as before.
    let opts = WrapOptions::new(WrapPolicy::size(500)).with_ignored_module("transformer.h.0.mlp");
    let p = plan(&cfg, &opts).unwrap();
    assert_eq!(unit_names(&p), ["", "transformer.h.1.mlp"]);
    assert_eq!(p.ignored.len(), 4);
    assert_covers_model(&cfg, &p);
    // ... and a threshold of 320 wraps block 0 (all it counts is 320) and, in block 1, the MLP
    // (552) and then the block itself (remainder 872 − 552 = 320).
    let opts = WrapOptions::new(WrapPolicy::size(320)).with_ignored_module("transformer.h.0.mlp");
    let p = plan(&cfg, &opts).unwrap();
    assert_eq!(
        unit_names(&p),
        [
            "",
            "transformer.h.0",
            "transformer.h.1",
            "transformer.h.1.mlp"
        ]
    );
    assert_eq!(p.units[1].numel(), 320);
    assert_eq!(p.units[2].numel(), 320);

    // Ignoring the embedding but not lm_head splits the tie; ignoring both is fine.
    let opts = WrapOptions::default().with_ignored_module("transformer.wte");
    let (_, param_unit, _, tied_to_unit) = tie_error(plan(&cfg, &opts).unwrap_err());
    assert_eq!(param_unit, "the root unit");
    assert_eq!(tied_to_unit, "ignored module `transformer.wte`");
    let opts = WrapOptions::new(WrapPolicy::module_type(["Block"]))
        .with_ignored_module("transformer.wte")
        .with_ignored_module("lm_head");
    let p = plan(&cfg, &opts).unwrap();
    assert_eq!(names(&p.ignored), ["transformer.wte.weight"]);
    assert_covers_model(&cfg, &p);

    // Ignoring the whole model: an empty root unit, everything replicated.
    let p = plan(
        &cfg,
        &WrapOptions::new(WrapPolicy::size(1)).with_ignored_module(""),
    )
    .unwrap();
    assert_eq!(unit_names(&p), [""]);
    assert!(p.units[0].params.is_empty());
    assert_eq!(p.ignored, param_specs(&cfg));

    // An unknown path is an error naming it.
    let err = plan(
        &cfg,
        &WrapOptions::default().with_ignored_module("transformer.h.7"),
    )
    .unwrap_err();
    assert!(matches!(&err, FsdpError::UnknownModule { path } if path == "transformer.h.7"));
    assert!(err.to_string().contains("transformer.h.7"));
}

#[test]
fn tie_to_an_unknown_parameter_is_an_error() {
    let tree = Module::new("", "Net")
        .with_child(Module::new("emb", "Embedding").with_param("weight", vec![4, 2]))
        .with_child(Module::new("head", "Linear").with_tied_param(
            "weight",
            vec![4, 2],
            "emb.wieght",
        ));
    let err = plan_units(&tree, &WrapOptions::default()).unwrap_err();
    assert!(
        matches!(&err, FsdpError::UnknownTiedParameter { param, tied_to }
            if param == "head.weight" && tied_to == "emb.wieght"),
        "{err:?}"
    );
}

#[test]
fn a_hand_built_tree_with_a_shared_parameter() {
    // Two heads tied to one embedding, inside a container that also holds a parameter of its
    // own: the container's subtree counts the shared storage once, 8 + 2 = 10 elements (not
    // 26), so a threshold of 9 wraps the container (no child reaches 9: emb 8, a 8, b 8) and
    // keeps the three names together.
    let tree = Module::new("", "Net")
        .with_child(
            Module::new("shared", "Seq")
                .with_param("scale", vec![2])
                .with_child(Module::new("shared.emb", "Embedding").with_param("weight", vec![4, 2]))
                .with_child(Module::new("shared.a", "Linear").with_tied_param(
                    "weight",
                    vec![4, 2],
                    "shared.emb.weight",
                ))
                .with_child(Module::new("shared.b", "Linear").with_tied_param(
                    "weight",
                    vec![4, 2],
                    "shared.emb.weight",
                )),
        )
        .with_child(Module::new("out", "Linear").with_param("weight", vec![3]));
    assert_eq!(tree.numel(), 13);
    assert_eq!(tree.find("shared.b").unwrap().numel(), 8);
    assert_eq!(
        tree.param_names(),
        ["shared.scale", "shared.emb.weight", "out.weight"]
    );
    let p = plan_units(&tree, &WrapOptions::new(WrapPolicy::size(9))).unwrap();
    assert_eq!(unit_names(&p), ["", "shared"]);
    assert_eq!(
        names(&p.units[1].params),
        ["shared.scale", "shared.emb.weight"]
    );
    assert_eq!(p.units[0].numel(), 3);
    // A threshold of 8 reaches the embedding and each head alone: split. The first alias in
    // pre-order is reported.
    let err = plan_units(&tree, &WrapOptions::new(WrapPolicy::size(8))).unwrap_err();
    assert!(
        matches!(&err, FsdpError::TiedParametersSplit { param, param_unit, tied_to, tied_to_unit }
            if param == "shared.a.weight" && param_unit == "unit `shared.a`"
                && tied_to == "shared.emb.weight" && tied_to_unit == "unit `shared.emb`"),
        "{err:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// The size rule on random thresholds: valid plans covering the model, every non-root unit
    /// holding at least `min` elements, and the tie error exactly when `wte` alone (128)
    /// reaches the threshold.
    #[test]
    fn size_policy_random_thresholds(min in 0usize..2200, n_layer in 1usize..4) {
        let cfg = GptConfig::new(n_layer, 2, 8, 4, 16).unwrap();
        match size(&cfg, min) {
            Ok(p) => {
                prop_assert!(min > 128);
                assert_covers_model(&cfg, &p);
                prop_assert!(p.units[1..].iter().all(|u| u.numel() >= min));
                prop_assert_eq!(p.unit_of("transformer.wte.weight"), Some(0));
                // The wte and lm_head storage stays with the root.
                prop_assert!(p.units[0].params.iter().any(|s| s.name == "transformer.wte.weight"));
            }
            Err(e) => {
                prop_assert!(min <= 128);
                tie_error(e);
            }
        }
    }

    /// Random custom policies (a random set of modules to wrap) with random ignored modules,
    /// checked against a direct model of the ownership rule.
    #[test]
    fn random_custom_policies(
        wrap_bits in proptest::collection::vec(any::<bool>(), 64),
        ignore_bits in proptest::collection::vec(0u8..24, 64),
    ) {
        let cfg = small();
        let tree = gpt_module_tree(&cfg);
        let paths: Vec<String> = tree.modules().iter().map(|m| m.name.clone()).collect();
        let wrapped: Vec<String> = paths[1..]
            .iter()
            .zip(&wrap_bits)
            .filter(|(_, &b)| b)
            .map(|(p, _)| p.clone())
            .collect();
        // About one module in 24 ignored.
        let ignored: Vec<String> = paths
            .iter()
            .zip(&ignore_bits)
            .filter(|(_, &b)| b == 0)
            .map(|(p, _)| p.clone())
            .collect();
        let set = wrapped.clone();
        let mut opts = WrapOptions::new(WrapPolicy::custom(move |m, _| set.contains(&m.name)));
        opts.ignored_modules = ignored.clone();

        // The storage's unit must be the alias's unit or enclose it (both ignored is fine too).
        let split = match (
            expected_owner("transformer.wte", &wrapped, &ignored),
            expected_owner("lm_head", &wrapped, &ignored),
        ) {
            (Ok(target), Ok(alias)) => {
                !(target.is_empty() || alias == target || alias.starts_with(&format!("{target}.")))
            }
            (Err(_), Err(_)) => false,
            _ => true,
        };
        match plan_units(&tree, &opts) {
            Err(e) => {
                prop_assert!(split);
                tie_error(e);
            }
            Ok(p) => {
                prop_assert!(!split);
                assert_covers_model(&cfg, &p);
                // Each parameter where the rule says.
                for (name, _) in tree.all_params() {
                    if name == "lm_head.weight" {
                        continue;
                    }
                    let module = &name[..name.rfind('.').unwrap()];
                    match expected_owner(module, &wrapped, &ignored) {
                        Err(_) => prop_assert!(p.ignored.iter().any(|s| s.name == name)),
                        Ok(unit) => {
                            let k = p.unit_of(&name).unwrap();
                            prop_assert_eq!(&p.units[k].name, &unit);
                        }
                    }
                }
                // Units: the root, then in pre-order the wrapped, non-ignored modules that own
                // at least one parameter by the rule.
                let owners: Vec<Result<String, String>> = tree
                    .named_parameters()
                    .iter()
                    .map(|s| expected_owner(&s.name[..s.name.rfind('.').unwrap()], &wrapped, &ignored))
                    .collect();
                let expected: Vec<&String> = paths
                    .iter()
                    .filter(|m| m.is_empty() || owners.contains(&Ok(m.to_string())))
                    .collect();
                let got: Vec<&String> = p.units.iter().map(|u| &u.name).collect();
                prop_assert_eq!(got, expected);
                prop_assert!(p.units[1..].iter().all(|u| !u.params.is_empty()));
            }
        }
    }
}
