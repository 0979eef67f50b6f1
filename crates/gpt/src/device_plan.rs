//! The device memory of [`DeviceTrainer`](crate::device_train::DeviceTrainer), predicted:
//! [`plan_memory`] lists what the trainer holds for the whole run (the parameters, the model's
//! gradients, the accumulators when a step has several micro-batches, AdamW's two moments,
//! with bf16 products the two kept operand copies) and replays, by size, every buffer one micro-batch's step allocates and frees in the
//! order [`DeviceGpt::step`](fsdp_kernels::gpt::DeviceGpt::step) does (the activations saved
//! for backward — each block's input alone under activation checkpointing, with the block's
//! forward replayed again before its backward — the working buffers of each layer, the ids),
//! to find the moment of the peak and its bytes. It is what `fsdp plan --device cuda` prints.
//!
//! The bytes are those [`GptOps::memory`](fsdp_kernels::gpt::GptOps::memory) counts (every
//! buffer the operations hand out and keep, 4 bytes an f32 or id element, 2 a kept bf16
//! operand element): the host twins' measured peak equals the plan exactly
//! (`tests/device_plan.rs`), and so does the CUDA run's counted peak; the CUDA pool's
//! high-water mark adds the scratch of single operations and the pool's rounding.
//!
//! The peak is that of a run past its first micro-batch: the kept bf16 operand copies grow to
//! the largest product's operands during the first one and stay (a run of one step of one
//! micro-batch may peak lower). The end of the step (norm, clipping, AdamW) allocates nothing
//! the plan counts: AdamW clips each gradient as it reads it, and the step's scalars (its loss,
//! norm and decision, one f64 per gradient tensor besides) are held throughout.
//! Under CPU offload the accumulators, the moments and the optimizer step live on the host:
//! the device holds the parameters, the gradients, the step's scalars and buffers, and the
//! plan lists what moved to the host ([`DeviceMemoryPlan::offloaded`]) and the page-locked
//! staging of the copies ([`DeviceMemoryPlan::host_staging`]).

use fsdp::FsdpError;
use fsdp_kernels::gpt::{param_shapes, Attention, Logits, Products};
use fsdp_kernels::host::{step_scalars_len, AnyPrecision};

use crate::device_train::{DeviceTrainConfig, DeviceTrainError};

#[path = "device_plan_report.rs"]
mod report;

/// What a buffer of the step is for.
#[derive(Clone, Copy)]
enum Kind {
    /// Saved by forward for backward.
    Tape,
    /// Any other buffer of the step.
    Work,
    /// Token ids or targets.
    Ids,
}

/// Bytes of an f32 (and of a u32 id) element.
const F32: u128 = 4;
/// Bytes of an f64 element (the step's scalars).
const F64: u128 = 8;
/// Bytes of a bf16 element.
const BF16: u128 = 2;

/// The predicted device memory of a [`DeviceTrainer`](crate::device_train::DeviceTrainer) run,
/// in bytes: what it holds throughout, and the peak of a step with its parts at that moment.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceMemoryPlan {
    /// Rows of a micro-batch.
    pub rows: usize,
    /// Tokens per row (the model's block size).
    pub tokens_per_row: usize,
    /// Elements of all parameters.
    pub param_elements: u64,
    /// The parameters (f32).
    pub parameters: u64,
    /// The model's gradients (f32, overwritten by each micro-batch).
    pub gradients: u64,
    /// The gradient accumulators (f32; 0 under CPU offload, and with one micro-batch a step,
    /// where the optimizer reads the model's gradients).
    pub accumulators: u64,
    /// The optimizer's first moments (f32 for AdamW; `AnyPrecisionAdamW`'s state dtype, bf16
    /// packed two to an f32 element; 0 under CPU offload).
    pub exp_avg: u64,
    /// Its second moments (as `exp_avg`).
    pub exp_avg_sq: u64,
    /// `AnyPrecisionAdamW`'s Kahan compensation (as `exp_avg`; 0 without one).
    pub compensation: u64,
    /// Under CPU offload, what lives in host memory instead: the master parameters, the
    /// accumulators and the optimizer's state (0 without offload).
    pub offloaded: u64,
    /// Under CPU offload, the page-locked host memory the copies go through: the gradients of
    /// one micro-batch (two sets with several micro-batches a step) and the parameters (f32;
    /// 0 without offload).
    pub host_staging: u64,
    /// The two kept bf16 copies of the products' operands (0 with f32 products).
    pub bf16_operands: u64,
    /// The step's scalars (f64: its loss, norm and decision, and each gradient tensor's sum
    /// of squares).
    pub step_scalars: u64,
    /// The activations one micro-batch's forward saves for backward (its tape, at the end of
    /// forward).
    pub tape: u64,
    /// Whether forward keeps only each block's input (activation checkpointing).
    pub activation_checkpointing: bool,
    /// How the attention holds its `t × t` matrices.
    pub attention: Attention,
    /// (Sequence, head) pairs whose `t × t` matrices the attention holds at once.
    pub attention_pairs: usize,
    /// How the head holds its logits.
    pub logits: Logits,
    /// Tokens whose logits the head holds at once.
    pub logit_tokens: usize,
    /// Where the step peaks.
    pub peak_moment: String,
    /// Saved activations held at the peak.
    pub peak_tape: u64,
    /// Working buffers held at the peak (outputs, gradients of activations, logits, losses).
    pub peak_working: u64,
    /// Token ids and targets held at the peak.
    pub peak_ids: u64,
    /// The peak: everything held throughout plus the step's buffers at its peak moment.
    pub peak: u64,
    /// The optimizer: `AnyPrecisionAdamW`'s dtypes, or `None` for AdamW.
    pub any_precision: Option<AnyPrecision>,
}

impl DeviceMemoryPlan {
    /// What the trainer holds for the whole run.
    pub fn persistent(&self) -> u64 {
        self.parameters
            + self.gradients
            + self.accumulators
            + self.exp_avg
            + self.exp_avg_sq
            + self.compensation
            + self.bf16_operands
            + self.step_scalars
    }
}

/// The step's buffers replayed by size: bytes live by kind and the peak.
#[derive(Default)]
struct Replay {
    live: [u128; 3],
    peak: u128,
    at_peak: [u128; 3],
    moment: String,
    phase: String,
    /// Saved activations at the end of forward.
    tape: u128,
}

impl Replay {
    fn alloc(&mut self, kind: Kind, elements: u128, what: &str) {
        self.alloc_bytes(kind, elements.saturating_mul(F32), what);
    }

    fn alloc_bytes(&mut self, kind: Kind, bytes: u128, what: &str) {
        let k = &mut self.live[kind as usize];
        *k = k.saturating_add(bytes);
        let total = self.live.iter().fold(0u128, |a, &b| a.saturating_add(b));
        if total > self.peak {
            self.peak = total;
            self.at_peak = self.live;
            self.moment = format!("{}, {what}", self.phase);
        }
    }

    fn free(&mut self, kind: Kind, elements: u128) {
        self.free_bytes(kind, elements.saturating_mul(F32));
    }

    fn free_bytes(&mut self, kind: Kind, bytes: u128) {
        let k = &mut self.live[kind as usize];
        *k = k.saturating_sub(bytes);
    }

    /// `GptOps::operand` of an f32 buffer of `elements` of kind `kind`: with bf16 products
    /// (`opb` = 2 bytes an element) its bf16 copy made, then the f32 buffer freed; with f32
    /// products the buffer itself (nothing happens).
    fn operand(&mut self, kind: Kind, elements: u128, opb: u128, what: &str) {
        if opb != F32 {
            self.alloc_bytes(kind, elements.saturating_mul(opb), what);
            self.free(kind, elements);
        }
    }
}

/// The product of `factors`, saturating (a size past u64 is refused at the end).
fn prod(factors: &[usize]) -> u128 {
    factors
        .iter()
        .fold(1u128, |a, &f| a.saturating_mul(f as u128))
}

fn to_u64(v: u128, what: &str) -> Result<u64, DeviceTrainError> {
    u64::try_from(v).map_err(|_| {
        DeviceTrainError::Fsdp(FsdpError::InvalidShape {
            reason: format!("the device memory plan's {what} does not fit in 64 bits"),
        })
    })
}

/// The (sequence, head) pairs of the attention's first (largest) chunk and the tokens of the
/// head's: every pair or token when not chunked.
#[derive(Clone, Copy)]
struct Chunks {
    pairs: usize,
    tokens: usize,
}

impl Chunks {
    fn of(c: &DeviceTrainConfig, rows: usize) -> Chunks {
        let (t, h, v) = (c.cfg.block_size, c.cfg.n_head, c.cfg.vocab_size);
        Chunks {
            pairs: c.attention.chunk_pairs(t, rows.saturating_mul(h)),
            tokens: c.logits.chunk_tokens(v, rows.saturating_mul(t)),
        }
    }
}

/// One micro-batch's step of `DeviceGpt::step` (`model.rs`), buffer by buffer; the
/// activations that only products read are kept as operands of `opb` bytes an element.
fn replay_step(r: &mut Replay, c: &DeviceTrainConfig, rows: usize, opb: u128, ch: Chunks) {
    let (t, e, v) = (c.cfg.block_size, c.cfg.n_embd, c.cfg.vocab_size);
    let n = prod(&[rows, t]);
    let ne = prod(&[rows, t, e]);
    // The head's logits: one chunk's (the first, the largest), every token's when whole.
    let nv = prod(&[ch.tokens, v]);
    // The attention's matrices: every (sequence, head) pair's when materialized (kept), one
    // chunk's (the first, the largest) when chunked.
    let fused = c.attention == Attention::Fused;
    let a = Attn {
        kept: c.attention.keeps_probabilities(),
        t2: if fused { 0 } else { prod(&[ch.pairs, t, t]) },
        lse: if fused { prod(&[ch.pairs, t]) } else { 0 },
    };
    use Kind::{Ids, Tape, Work};
    // Saved per block, in bytes: its input, x2 and c_fc's output (f32), ln_1's and ln_2's mean
    // and rstd, P when kept, the rows' log-sum-exp when fused; h1, q, k, v, y, h2 and gelu's
    // output (10 n × e) as operands.
    // Each block's forward adds that (its output is the next one's input) and frees its
    // working buffers.
    let saved = (6 * ne + 4 * n + if a.kept { a.t2 } else { a.lse })
        .saturating_mul(F32)
        .saturating_add((10 * ne).saturating_mul(opb));
    let layers = c.cfg.n_layer;
    // The blocks are alike and the saved activations only grow in forward (only shrink in
    // backward): the last block's forward and the first block backward (the last block's)
    // hold the most, so the others are replayed at once.
    let before_last = (layers.saturating_sub(1)) as u128;
    r.phase = "embeddings".into();
    r.alloc(Ids, n, "input ids");
    r.alloc(Tape, ne, "x");
    // With activation checkpointing a block's forward keeps only its input (its output is
    // the next block's): the blocks before the last hold one n × e buffer each.
    let ckpt = c.activation_checkpointing;
    r.phase = "forward".into();
    r.alloc_bytes(
        Tape,
        if ckpt { ne * F32 } else { saved }.saturating_mul(before_last),
        "blocks before the last",
    );
    if let Some(layer) = layers.checked_sub(1) {
        r.phase = format!("forward of block {layer}");
        block_forward(r, ne, n, a, opb, Tape);
        if ckpt {
            // Its activations but the input dropped (the output stays: ln_f's input).
            r.free_bytes(Tape, saved - ne * F32);
        }
    }
    r.phase = "head".into();
    r.alloc(Tape, 2 * n, "ln_f's mean and rstd");
    r.alloc_bytes(Tape, ne.saturating_mul(opb), "ln_f's output");
    r.tape = r.live[Tape as usize];
    r.alloc(Ids, n, "targets");
    r.alloc(Work, n, "losses");
    r.alloc(Work, ne, "ln_f's output gradient");
    // A chunk's logits, then their gradient as an operand: with bf16 products written in bf16
    // beside them (the logits then freed), else over them; freed before the next chunk's.
    r.alloc(Work, nv, "a chunk's logits");
    r.operand(Work, nv, opb, "a chunk's logits' gradient in bf16");
    r.free_bytes(Work, nv.saturating_mul(opb));
    r.alloc(Work, ne, "x's gradient");
    if let Some(layer) = layers.checked_sub(1) {
        if ckpt {
            // The block's forward again from its input; its output dropped at once.
            r.phase = format!("recomputed forward of block {layer}");
            block_forward(r, ne, n, a, opb, Work);
            r.free(Work, ne);
        }
        r.phase = format!("backward of block {layer}");
        r.alloc(Work, 4 * ne, "mlp c_proj input gradient");
        r.alloc(Work, 4 * ne, "gelu input gradient");
        r.free(Work, 4 * ne);
        r.alloc(Work, ne, "ln_2 output gradient");
        r.free(Work, 4 * ne);
        r.free(Work, ne);
        r.alloc(Work, ne, "attention c_proj input gradient");
        r.alloc_bytes(Work, ne.saturating_mul(opb), "heads' output gradient");
        r.free(Work, ne);
        attention_backward(r, ne, a, opb);
        r.alloc(Work, 3 * ne, "qkv's gradient");
        r.free(Work, 3 * ne);
        r.alloc(Work, ne, "ln_1 output gradient");
        r.free(Work, 3 * ne);
        r.free(Work, ne);
        r.free_bytes(Tape, saved);
    }
    // The blocks before the last run their backward holding less; the step returns and drops
    // everything else.
    r.live = [0; 3];
}

/// The attention's `t × t` matrices: whether forward keeps the probabilities, and the
/// elements of one set (every pair's when kept, else the largest chunk's; none when fused);
/// and the elements of the rows' log-sum-exp that the fused form keeps instead (none
/// otherwise).
#[derive(Clone, Copy)]
struct Attn {
    kept: bool,
    t2: u128,
    lse: u128,
}

impl Attn {
    fn fused(&self) -> bool {
        self.lse > 0
    }
}

impl Attn {
    /// The bytes of the probabilities' bf16 rounding that the softmax writes beside them for a
    /// product under bf16 products (`opb` 2); none under f32 products.
    fn rounded(&self, opb: u128) -> u128 {
        if opb == F32 {
            0
        } else {
            self.t2.saturating_mul(opb)
        }
    }
}

/// One block's forward (`DeviceGpt::block_forward`), its output of kind `out` (the tape in
/// forward; a working buffer when recomputed under checkpointing, dropped by the caller).
fn block_forward(r: &mut Replay, ne: u128, n: u128, a: Attn, opb: u128, out: Kind) {
    use Kind::{Tape, Work};
    // Every output that only products read is written as an operand (`opb` bytes an element).
    let op = ne.saturating_mul(opb);
    r.alloc(Tape, 2 * n, "ln_1's mean and rstd");
    r.alloc_bytes(Tape, op, "ln_1's output");
    r.alloc(Work, 3 * ne, "qkv");
    for part in ["q", "k", "v"] {
        r.alloc_bytes(Tape, op, part);
    }
    r.free(Work, 3 * ne);
    if a.kept {
        // The probabilities kept in f32 for backward (their product casts them into its kept
        // copy).
        r.alloc(Work, a.t2, "scores");
        r.alloc(Tape, a.t2, "probabilities");
        r.free(Work, a.t2);
        r.alloc(Work, ne, "heads' outputs");
    } else if a.fused() {
        // One kernel: the heads' outputs and the rows' log-sum-exp (kept for backward).
        r.alloc(Work, ne, "heads' outputs");
        r.alloc(Tape, a.lse, "the rows' log-sum-exp");
    } else {
        // The first chunk's scores and probabilities (the largest; the probabilities written
        // as the product's operand), the scores freed before the product, the probabilities
        // after it.
        r.alloc(Work, ne, "heads' outputs");
        r.alloc(Work, a.t2, "a chunk's scores");
        r.alloc_bytes(Work, a.t2.saturating_mul(opb), "a chunk's probabilities");
        r.free(Work, a.t2);
        r.free_bytes(Work, a.t2.saturating_mul(opb));
    }
    r.alloc_bytes(Tape, op, "y");
    r.free(Work, ne);
    r.alloc(Tape, ne, "x + attention");
    r.alloc(Tape, 2 * n, "ln_2's mean and rstd");
    r.alloc_bytes(Tape, op, "ln_2's output");
    r.alloc(Tape, 4 * ne, "c_fc");
    r.alloc_bytes(Tape, 4 * op, "gelu's output");
    r.alloc(out, ne, "block output");
}

/// The attention's backward (`GptPass::attention_backward`) from the heads' output gradient
/// (an operand, freed here) to q's, k's and v's gradients (left live). The scores' gradient is
/// the operand of `dq`'s and `dk`'s products (`opb` bytes an element).
fn attention_backward(r: &mut Replay, ne: u128, a: Attn, opb: u128) {
    use Kind::Work;
    let (ds, dyh) = (a.t2.saturating_mul(opb), ne.saturating_mul(opb));
    if a.kept {
        r.alloc(Work, a.t2, "probabilities' gradient");
        r.alloc(Work, ne, "v's gradient");
        r.free_bytes(Work, dyh);
        r.alloc_bytes(Work, ds, "scores' gradient");
        r.free(Work, a.t2);
        r.alloc(Work, 2 * ne, "q's and k's gradients");
        r.free_bytes(Work, ds);
    } else if a.fused() {
        // Three kernels; their rows' sums are scratch (the driver's pool, not counted).
        r.alloc(Work, 3 * ne, "q's, k's and v's gradients");
        r.free_bytes(Work, dyh);
    } else {
        r.alloc(Work, 3 * ne, "q's, k's and v's gradients");
        // The first chunk: its scores and probabilities again (the scores freed), the
        // probabilities' gradient, the scores' gradient (the probabilities' gradient and the
        // probabilities freed before dq's and dk's products); all freed before the next chunk.
        r.alloc(Work, a.t2, "a chunk's scores again");
        r.alloc(Work, a.t2, "a chunk's probabilities again");
        r.alloc_bytes(Work, a.rounded(opb), "their bf16 rounding");
        r.free(Work, a.t2);
        r.alloc(Work, a.t2, "a chunk's probabilities' gradient");
        r.free_bytes(Work, a.rounded(opb));
        r.alloc_bytes(Work, ds, "a chunk's scores' gradient");
        r.free(Work, 2 * a.t2);
        r.free_bytes(Work, ds);
        r.free_bytes(Work, dyh);
    }
}

/// The elements of the largest first and second operands of the step's products (the sizes
/// the kept bf16 copies grow to).
fn largest_operands(c: &DeviceTrainConfig, rows: usize, ch: Chunks) -> (u128, u128) {
    let (t, e, v) = (c.cfg.block_size, c.cfg.n_embd, c.cfg.vocab_size);
    let ne = prod(&[rows, t, e]);
    // The linear layers' output gradients (GELU's input gradient the largest) and the kept
    // probabilities, which `v`'s gradient's product reads as a buffer. Every result that only
    // products read (the activations, the heads' output gradient, the scores' and the
    // logits' gradients, the probabilities as their products read them when computed) is
    // written as an operand and never passes through the copies.
    let kept = if c.attention.keeps_probabilities() {
        prod(&[ch.pairs, t, t])
    } else {
        0
    };
    let first = [4 * ne, kept];
    // The second operands that pass through the copies: the weights.
    let second = [4 * prod(&[e, e]), prod(&[v, e])];
    let max = |xs: &[u128]| xs.iter().copied().max().unwrap_or(0);
    (max(&first), max(&second))
}

/// The device memory of a [`DeviceTrainer`](crate::device_train::DeviceTrainer) of `config`
/// whose operations multiply as `products` says (see the [module](self) documentation).
///
/// # Errors
/// The settings the trainer refuses; a size that does not fit in 64 bits.
pub fn plan_memory(
    config: &DeviceTrainConfig,
    products: Products,
) -> Result<DeviceMemoryPlan, DeviceTrainError> {
    config.validate()?;
    config.dims().validate()?;
    let rows = config.batch_size / config.grad_accum;
    let c = &config.cfg;
    // Every size the replay multiplies by small constants fits in 64 bits, so its sums fit
    // in 128.
    for (what, v) in [
        ("tokens × width", prod(&[rows, c.block_size, c.n_embd])),
        (
            "tokens × vocabulary",
            prod(&[rows, c.block_size, c.vocab_size]),
        ),
        (
            "attention scores",
            prod(&[rows, c.n_head, c.block_size, c.block_size]),
        ),
        ("vocabulary × width", prod(&[c.vocab_size, c.n_embd])),
        ("width²", prod(&[c.n_embd, c.n_embd])),
    ] {
        to_u64(v.saturating_mul(64), what)?;
    }
    let elements: u128 = param_shapes(&config.dims())
        .iter()
        .map(|(_, s)| prod(s))
        .fold(0, u128::saturating_add);
    let each = elements.saturating_mul(F32);
    let chunks = Chunks::of(config, rows);
    let bf16 = if products.half().is_some() {
        let (a, b) = largest_operands(config, rows, chunks);
        a.saturating_add(b).saturating_mul(BF16)
    } else {
        0
    };
    let mut r = Replay::default();
    let opb = if products.half().is_some() { BF16 } else { F32 };
    replay_step(&mut r, config, rows, opb, chunks);
    // Parameters and gradients; the optimizer's state too unless offloaded, and the
    // accumulators unless offloaded or one micro-batch makes the step (the model's gradients
    // serve).
    let (moment, comp) = crate::device_optim::state_bytes(config, 1);
    let state = u128::from(moment) * 2 + u128::from(comp);
    let accumulators = if config.offload || config.grad_accum == 1 {
        0
    } else {
        each
    };
    let (optim, optim_comp, on_device, offloaded) = if config.offload {
        (0, 0, 0, each.saturating_mul(2).saturating_add(state))
    } else {
        (u128::from(moment), u128::from(comp), state, 0)
    };
    let tensors = param_shapes(&config.dims()).len();
    let scalars = (step_scalars_len(tensors) as u128).saturating_mul(F64);
    let persistent = each
        .saturating_mul(2)
        .saturating_add(on_device)
        .saturating_add(accumulators)
        .saturating_add(bf16)
        .saturating_add(scalars);
    let peak = persistent.saturating_add(r.peak);
    Ok(DeviceMemoryPlan {
        rows,
        tokens_per_row: config.cfg.block_size,
        param_elements: to_u64(elements, "parameter count")?,
        parameters: to_u64(each, "parameters")?,
        gradients: to_u64(each, "gradients")?,
        accumulators: to_u64(accumulators, "accumulators")?,
        exp_avg: to_u64(optim, "moments")?,
        exp_avg_sq: to_u64(optim, "moments")?,
        compensation: to_u64(optim_comp, "compensation")?,
        any_precision: config.any_precision,
        offloaded: to_u64(offloaded, "offloaded state")?,
        host_staging: if config.offload {
            let sets = config.grad_accum.clamp(1, 2) as u128 + 1;
            to_u64(each.saturating_mul(sets), "host staging")?
        } else {
            0
        },
        bf16_operands: to_u64(bf16, "bf16 operands")?,
        step_scalars: to_u64(scalars, "step scalars")?,
        tape: to_u64(r.tape, "activations")?,
        activation_checkpointing: config.activation_checkpointing,
        attention: config.attention,
        attention_pairs: chunks.pairs,
        logits: config.logits,
        logit_tokens: chunks.tokens,
        peak_moment: r.moment,
        peak_tape: to_u64(r.at_peak[Kind::Tape as usize], "activations")?,
        peak_working: to_u64(r.at_peak[Kind::Work as usize], "working buffers")?,
        peak_ids: to_u64(r.at_peak[Kind::Ids as usize], "ids")?,
        peak: to_u64(peak, "peak")?,
    })
}
