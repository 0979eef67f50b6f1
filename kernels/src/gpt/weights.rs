//! The GPT's shape and its parameters by nanoGPT's names.

use crate::KernelError;

/// The shape of a GPT-2 model, as nanoGPT's `GPTConfig` (bias on, dropout 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GptDims {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Embedding width; a multiple of `n_head`.
    pub n_embd: usize,
    /// The longest sequence (rows of `wpe`).
    pub block_size: usize,
    /// Vocabulary size (rows of `wte`).
    pub vocab_size: usize,
}

pub(crate) fn invalid(reason: String) -> KernelError {
    KernelError::InvalidArgument {
        kernel: "gpt",
        reason,
    }
}

impl GptDims {
    /// Checks that every size is positive, that `n_embd` divides into `n_head` heads and that
    /// ids fit in `u32`.
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] naming the first problem.
    pub fn validate(&self) -> Result<(), KernelError> {
        for (name, v) in [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(invalid(format!("{name} must be at least 1")));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(invalid(format!(
                "n_embd {} is not divisible by n_head {}",
                self.n_embd, self.n_head
            )));
        }
        if u32::try_from(self.vocab_size).is_err() {
            return Err(invalid(format!(
                "vocab_size {} does not fit in u32",
                self.vocab_size
            )));
        }
        Ok(())
    }

    /// Elements per head, `n_embd / n_head`.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }
}

/// A weight and a bias (a `Linear` or `LayerNorm` module).
#[derive(Clone, Debug)]
pub struct Pair<B> {
    /// `weight`.
    pub weight: B,
    /// `bias`.
    pub bias: B,
}

/// One transformer block's modules.
#[derive(Clone, Debug)]
pub struct Block<B> {
    /// `ln_1`.
    pub ln_1: Pair<B>,
    /// `attn.c_attn` (`[3E, E]`, `[3E]`).
    pub c_attn: Pair<B>,
    /// `attn.c_proj` (`[E, E]`, `[E]`).
    pub attn_proj: Pair<B>,
    /// `ln_2`.
    pub ln_2: Pair<B>,
    /// `mlp.c_fc` (`[4E, E]`, `[4E]`).
    pub c_fc: Pair<B>,
    /// `mlp.c_proj` (`[E, 4E]`, `[E]`).
    pub mlp_proj: Pair<B>,
}

/// Every parameter (or gradient) of the model, one `B` each.
#[derive(Clone, Debug)]
pub struct Weights<B> {
    /// `transformer.wte.weight` `[V, E]`, also the tied `lm_head.weight`.
    pub wte: B,
    /// `transformer.wpe.weight` `[block_size, E]`.
    pub wpe: B,
    /// `transformer.h.{i}`.
    pub blocks: Vec<Block<B>>,
    /// `transformer.ln_f`.
    pub ln_f: Pair<B>,
}

const BLOCK_SUFFIXES: [&str; 12] = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
];

/// Which of a block's tensors (in [`Block::bufs`] order) only matrix products read: the
/// weights of its four linear layers (`attn.c_attn`, `attn.c_proj`, `mlp.c_fc`,
/// `mlp.c_proj`). Their biases are added and the layer norms' parameters read by the norms, in
/// f32. With bf16 products ([`GptOps::bf16_products`](super::GptOps::bf16_products)) such a
/// weight is read only as its bf16 rounding.
pub fn block_product_weights() -> [bool; 12] {
    BLOCK_SUFFIXES.map(|s| s.ends_with(".weight") && !s.starts_with("ln_"))
}

/// Every parameter's name and shape in nanoGPT's `named_parameters()` order (`lm_head.weight`
/// omitted: it is `transformer.wte.weight`).
pub fn param_shapes(d: &GptDims) -> Vec<(String, Vec<usize>)> {
    let e = d.n_embd;
    let mut v = vec![
        ("transformer.wte.weight".to_string(), vec![d.vocab_size, e]),
        ("transformer.wpe.weight".to_string(), vec![d.block_size, e]),
    ];
    let block: [Vec<usize>; 12] = [
        vec![e],
        vec![e],
        vec![3 * e, e],
        vec![3 * e],
        vec![e, e],
        vec![e],
        vec![e],
        vec![e],
        vec![4 * e, e],
        vec![4 * e],
        vec![e, 4 * e],
        vec![e],
    ];
    for layer in 0..d.n_layer {
        for (s, shape) in BLOCK_SUFFIXES.iter().zip(&block) {
            v.push((format!("transformer.h.{layer}.{s}"), shape.clone()));
        }
    }
    v.push(("transformer.ln_f.weight".to_string(), vec![e]));
    v.push(("transformer.ln_f.bias".to_string(), vec![e]));
    v
}

impl<B> Block<B> {
    /// Builds every tensor of a block of width `n_embd` with `make(suffix, elements)` (the
    /// suffix of [`param_shapes`]' names after `transformer.h.{i}.`), in that order.
    ///
    /// # Errors
    /// The first error of `make`.
    pub fn try_build(
        n_embd: usize,
        mut make: impl FnMut(&str, usize) -> Result<B, KernelError>,
    ) -> Result<Block<B>, KernelError> {
        let e = n_embd;
        let lens = [
            e,
            e,
            3 * e * e,
            3 * e,
            e * e,
            e,
            e,
            e,
            4 * e * e,
            4 * e,
            4 * e * e,
            e,
        ];
        let mut all = Vec::with_capacity(lens.len());
        for (s, len) in BLOCK_SUFFIXES.iter().zip(lens) {
            all.push(make(s, len)?);
        }
        let mut all = all.into_iter();
        let mut pair = || -> Result<Pair<B>, KernelError> {
            match (all.next(), all.next()) {
                (Some(weight), Some(bias)) => Ok(Pair { weight, bias }),
                _ => Err(invalid("a block has twelve tensors".into())),
            }
        };
        Ok(Block {
            ln_1: pair()?,
            c_attn: pair()?,
            attn_proj: pair()?,
            ln_2: pair()?,
            c_fc: pair()?,
            mlp_proj: pair()?,
        })
    }

    /// Its tensors in [`param_shapes`] order.
    pub fn bufs(&self) -> [&B; 12] {
        let p = [
            &self.ln_1,
            &self.c_attn,
            &self.attn_proj,
            &self.ln_2,
            &self.c_fc,
            &self.mlp_proj,
        ];
        std::array::from_fn(|i| {
            if i % 2 == 0 {
                &p[i / 2].weight
            } else {
                &p[i / 2].bias
            }
        })
    }

    /// Its tensors, mutably, in [`param_shapes`] order.
    pub fn bufs_mut(&mut self) -> Vec<&mut B> {
        let mut v = Vec::with_capacity(12);
        for p in [
            &mut self.ln_1,
            &mut self.c_attn,
            &mut self.attn_proj,
            &mut self.ln_2,
            &mut self.c_fc,
            &mut self.mlp_proj,
        ] {
            v.push(&mut p.weight);
            v.push(&mut p.bias);
        }
        v
    }
}

impl<B> Weights<B> {
    /// Builds every parameter with `make(name, elements)`, in [`param_shapes`] order.
    ///
    /// # Errors
    /// The first error of `make`.
    pub fn try_build(
        d: &GptDims,
        mut make: impl FnMut(&str, usize) -> Result<B, KernelError>,
    ) -> Result<Weights<B>, KernelError> {
        let mut all = param_shapes(d)
            .into_iter()
            .map(|(name, shape)| make(&name, shape.iter().product()))
            .collect::<Result<Vec<B>, KernelError>>()?
            .into_iter();
        let mut next = || all.next().expect("param_shapes lists every parameter");
        let (wte, wpe) = (next(), next());
        let mut pair = || Pair {
            weight: next(),
            bias: next(),
        };
        let blocks = (0..d.n_layer)
            .map(|_| Block {
                ln_1: pair(),
                c_attn: pair(),
                attn_proj: pair(),
                ln_2: pair(),
                c_fc: pair(),
                mlp_proj: pair(),
            })
            .collect();
        let ln_f = pair();
        Ok(Weights {
            wte,
            wpe,
            blocks,
            ln_f,
        })
    }

    /// Every parameter with its name, in [`param_shapes`] order.
    pub fn named(&self) -> Vec<(String, &B)> {
        let mut v = vec![
            ("transformer.wte.weight".to_string(), &self.wte),
            ("transformer.wpe.weight".to_string(), &self.wpe),
        ];
        for (layer, b) in self.blocks.iter().enumerate() {
            let pairs = [
                &b.ln_1,
                &b.c_attn,
                &b.attn_proj,
                &b.ln_2,
                &b.c_fc,
                &b.mlp_proj,
            ];
            let bufs = pairs.iter().flat_map(|p| [&p.weight, &p.bias]);
            for (s, buf) in BLOCK_SUFFIXES.iter().zip(bufs) {
                v.push((format!("transformer.h.{layer}.{s}"), buf));
            }
        }
        v.push(("transformer.ln_f.weight".to_string(), &self.ln_f.weight));
        v.push(("transformer.ln_f.bias".to_string(), &self.ln_f.bias));
        v
    }

    /// Every parameter, in [`param_shapes`] order.
    pub fn all(&self) -> Vec<&B> {
        let mut v = vec![&self.wte, &self.wpe];
        for b in &self.blocks {
            v.extend(b.bufs());
        }
        v.push(&self.ln_f.weight);
        v.push(&self.ln_f.bias);
        v
    }

    /// Every parameter, mutably, in [`param_shapes`] order.
    pub fn all_mut(&mut self) -> Vec<&mut B> {
        let mut v = vec![&mut self.wte, &mut self.wpe];
        for b in &mut self.blocks {
            for p in [
                &mut b.ln_1,
                &mut b.c_attn,
                &mut b.attn_proj,
                &mut b.ln_2,
                &mut b.c_fc,
                &mut b.mlp_proj,
            ] {
                v.push(&mut p.weight);
                v.push(&mut p.bias);
            }
        }
        v.push(&mut self.ln_f.weight);
        v.push(&mut self.ln_f.bias);
        v
    }

    /// The root's tensors alone (`wte`, `wpe`, `ln_f`; no blocks), each built with
    /// `make(name, elements)` in [`param_shapes`] order.
    ///
    /// # Errors
    /// The first error of `make`.
    pub fn try_build_root(
        d: &GptDims,
        mut make: impl FnMut(&str, usize) -> Result<B, KernelError>,
    ) -> Result<Weights<B>, KernelError> {
        let e = d.n_embd;
        Ok(Weights {
            wte: make("transformer.wte.weight", d.vocab_size * e)?,
            wpe: make("transformer.wpe.weight", d.block_size * e)?,
            blocks: Vec::new(),
            ln_f: Pair {
                weight: make("transformer.ln_f.weight", e)?,
                bias: make("transformer.ln_f.bias", e)?,
            },
        })
    }

    /// The root's tensors (`wte`, `wpe`, `ln_f.weight`, `ln_f.bias`), in [`param_shapes`]
    /// order.
    pub fn root_bufs(&self) -> [&B; 4] {
        [&self.wte, &self.wpe, &self.ln_f.weight, &self.ln_f.bias]
    }

    /// The root's tensors, mutably.
    pub fn root_bufs_mut(&mut self) -> [&mut B; 4] {
        [
            &mut self.wte,
            &mut self.wpe,
            &mut self.ln_f.weight,
            &mut self.ln_f.bias,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The root's and a block's builders give `param_shapes`' names and sizes, in its order.
    #[test]
    fn unit_builders_follow_param_shapes() {
        let d = GptDims {
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            block_size: 5,
            vocab_size: 11,
        };
        let want: Vec<(String, usize)> = param_shapes(&d)
            .into_iter()
            .map(|(n, s)| (n, s.iter().product()))
            .collect();
        let mut got = Vec::new();
        let root = Weights::try_build_root(&d, |n, len| Ok((n.to_string(), len))).unwrap();
        let blocks: Vec<Block<(String, usize)>> = (0..d.n_layer)
            .map(|l| {
                Block::try_build(d.n_embd, |s, len| {
                    Ok((format!("transformer.h.{l}.{s}"), len))
                })
                .unwrap()
            })
            .collect();
        let [wte, wpe, lw, lb] = root.root_bufs();
        got.extend([wte.clone(), wpe.clone()]);
        for b in &blocks {
            got.extend(b.bufs().into_iter().cloned());
        }
        got.extend([lw.clone(), lb.clone()]);
        assert_eq!(got, want);
    }
}
