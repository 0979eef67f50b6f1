//! The reference GPT's module tree and its FSDP unit plan.

use fsdp::units::{UnitPlan, UnitSpec};
use fsdp::wrap::Module;

use crate::model::{block_param_specs, embed_param_specs, head_param_specs, GptConfig};

/// The reference GPT's module tree, exactly as nanoGPT's `model.py` nests it (bias on, dropout
/// modules included although they hold no parameter):
///
/// ```text
/// ""                      GPT
/// ├─ transformer          ModuleDict
/// │  ├─ wte               Embedding          weight [V, E]
/// │  ├─ wpe               Embedding          weight [T, E]
/// │  ├─ drop              Dropout
/// │  ├─ h                 ModuleList
/// │  │  └─ {i}            Block
/// │  │     ├─ ln_1        LayerNorm          weight, bias [E]
/// │  │     ├─ attn        CausalSelfAttention
/// │  │     │  ├─ c_attn   Linear             weight [3E, E], bias [3E]
/// │  │     │  ├─ c_proj   Linear             weight [E, E], bias [E]
/// │  │     │  ├─ attn_dropout   Dropout
/// │  │     │  └─ resid_dropout  Dropout
/// │  │     ├─ ln_2        LayerNorm          weight, bias [E]
/// │  │     └─ mlp         MLP
/// │  │        ├─ c_fc     Linear             weight [4E, E], bias [4E]
/// │  │        ├─ gelu     GELU
/// │  │        ├─ c_proj   Linear             weight [E, 4E], bias [E]
/// │  │        └─ dropout  Dropout
/// │  └─ ln_f              LayerNorm          weight, bias [E]
/// └─ lm_head              Linear             weight [V, E], tied to transformer.wte.weight
/// ```
///
/// Its parameters in pre-order, the tied alias left out ([`Module::named_parameters`]), are
/// [`crate::model::param_specs`].
pub fn gpt_module_tree(cfg: &GptConfig) -> Module {
    let e = cfg.n_embd;
    let linear = |name: String, out_f: usize, in_f: usize| {
        Module::new(name, "Linear")
            .with_param("weight", vec![out_f, in_f])
            .with_param("bias", vec![out_f])
    };
    let layer_norm = |name: String| {
        Module::new(name, "LayerNorm")
            .with_param("weight", vec![e])
            .with_param("bias", vec![e])
    };
    let dropout = |name: String| Module::new(name, "Dropout");

    let transformer = Module::new("transformer", "ModuleDict");
    let wte = Module::new(transformer.child_path("wte"), "Embedding")
        .with_param("weight", vec![cfg.vocab_size, e]);
    let wte_weight = wte.param_full_name("weight");
    let wpe = Module::new(transformer.child_path("wpe"), "Embedding")
        .with_param("weight", vec![cfg.block_size, e]);
    let drop = dropout(transformer.child_path("drop"));

    let mut h = Module::new(transformer.child_path("h"), "ModuleList");
    for layer in 0..cfg.n_layer {
        let block = Module::new(h.child_path(&layer.to_string()), "Block");
        let attn = Module::new(block.child_path("attn"), "CausalSelfAttention");
        let attn = Module {
            children: vec![
                linear(attn.child_path("c_attn"), 3 * e, e),
                linear(attn.child_path("c_proj"), e, e),
                dropout(attn.child_path("attn_dropout")),
                dropout(attn.child_path("resid_dropout")),
            ],
            ..attn
        };
        let mlp = Module::new(block.child_path("mlp"), "MLP");
        let mlp = Module {
            children: vec![
                linear(mlp.child_path("c_fc"), 4 * e, e),
                Module::new(mlp.child_path("gelu"), "GELU"),
                linear(mlp.child_path("c_proj"), e, 4 * e),
                dropout(mlp.child_path("dropout")),
            ],
            ..mlp
        };
        let block = Module {
            children: vec![
                layer_norm(block.child_path("ln_1")),
                attn,
                layer_norm(block.child_path("ln_2")),
                mlp,
            ],
            ..block
        };
        h.children.push(block);
    }
    let ln_f = layer_norm(transformer.child_path("ln_f"));
    let transformer = transformer
        .with_child(wte)
        .with_child(wpe)
        .with_child(drop)
        .with_child(h)
        .with_child(ln_f);

    let root = Module::new("", "GPT");
    let lm_head = Module::new(root.child_path("lm_head"), "Linear").with_tied_param(
        "weight",
        vec![cfg.vocab_size, e],
        wte_weight,
    );
    root.with_child(transformer).with_child(lm_head)
}

/// The plan of the module-type policy "every transformer block" for the reference GPT: the root
/// unit owns `wte` (tied with `lm_head`), `wpe` and `ln_f`; unit `transformer.h.{i}` owns block
/// `i`.
pub fn gpt_block_plan(cfg: &GptConfig) -> UnitPlan {
    let mut root = embed_param_specs(cfg);
    root.extend(head_param_specs(cfg));
    let mut units = vec![UnitSpec {
        name: String::new(),
        params: root,
    }];
    for layer in 0..cfg.n_layer {
        units.push(UnitSpec {
            name: format!("transformer.h.{layer}"),
            params: block_param_specs(cfg, layer),
        });
    }
    UnitPlan {
        units,
        ignored: Vec::new(),
    }
}
