//! [`DeviceGpt`]: the GPT's parameters and gradients on a device, and its training step there.

use std::collections::HashMap;

use super::attention::Attention;
use super::head::Logits;
use super::ops::GptOps;
use super::pass::GptPass;
use super::units::Resident;
use super::weights::{invalid, GptDims, Weights};
use crate::KernelError;

/// The GPT's parameters and gradients on a device, and its training step there: a
/// [`GptPass`] over the parameters and gradients it holds.
pub struct DeviceGpt<O: GptOps> {
    pub(super) pass: GptPass<O>,
    params: Weights<O::Buf>,
    grads: Weights<O::Buf>,
}

impl<O: GptOps> DeviceGpt<O> {
    /// The model `dims` on `ops`' device with `params` (nanoGPT's names and shapes, see
    /// [`param_shapes`](super::param_shapes)) uploaded and zero gradients.
    ///
    /// # Errors
    /// Invalid `dims`, a parameter missing or of the wrong length; allocation and copy
    /// failures.
    pub fn new(
        ops: O,
        dims: GptDims,
        params: &HashMap<String, Vec<f32>>,
    ) -> Result<DeviceGpt<O>, KernelError> {
        let pass = GptPass::new(ops, dims)?;
        let ops = &pass.ops;
        let p = Weights::try_build(&dims, |name, len| match params.get(name) {
            None => Err(invalid(format!("parameter `{name}` is missing"))),
            Some(v) if v.len() != len => Err(invalid(format!(
                "parameter `{name}` has {} elements, expected {len}",
                v.len()
            ))),
            Some(v) => ops.upload(v),
        })?;
        let grads = Weights::try_build(&dims, |_, len| ops.zeros(len))?;
        Ok(DeviceGpt {
            pass,
            params: p,
            grads,
        })
    }

    /// Activation checkpointing of every block (PyTorch's `checkpoint_wrapper` around each
    /// block; `fsdp train --activation-checkpointing`): forward keeps only each block's input,
    /// and backward runs the block's forward again just before its backward. The gradients
    /// are the same bit for bit (the same operations on the same inputs give the same
    /// activations), for one more forward of each block; the activations of one block are held
    /// at a time instead of all of them.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.pass.set_activation_checkpointing(on);
    }

    /// Whether [`step`](Self::step) checkpoints activations
    /// ([`set_activation_checkpointing`](Self::set_activation_checkpointing)).
    pub fn activation_checkpointing(&self) -> bool {
        self.pass.activation_checkpointing()
    }

    /// How the blocks' attention holds its `t × t` matrices
    /// ([`GptPass::set_attention`]): the same bits on the twins either way.
    pub fn set_attention(&mut self, attention: Attention) {
        self.pass.set_attention(attention);
    }

    /// How the head holds its logits ([`GptPass::set_logits`]).
    pub fn set_logits(&mut self, logits: Logits) {
        self.pass.set_logits(logits);
    }

    /// The pass it runs (its operations, shape, checkpointing and tracing).
    pub fn pass(&self) -> &GptPass<O> {
        &self.pass
    }

    /// The operations.
    pub fn ops(&self) -> &O {
        &self.pass.ops
    }

    /// The model's shape.
    pub fn dims(&self) -> GptDims {
        self.pass.dims
    }

    /// The parameters (device buffers).
    pub fn params(&self) -> &Weights<O::Buf> {
        &self.params
    }

    /// The gradients of the last [`step`](Self::step) (device buffers).
    pub fn grads(&self) -> &Weights<O::Buf> {
        &self.grads
    }

    /// The operations, the parameters (mutable: an optimizer updates them in place) and the
    /// gradients of the last [`step`](Self::step) (mutable: clipping may scale them in place;
    /// the next step overwrites them), at once.
    pub fn parts_mut(&mut self) -> (&O, &mut Weights<O::Buf>, &mut Weights<O::Buf>) {
        (&self.pass.ops, &mut self.params, &mut self.grads)
    }

    /// Every parameter on the host, by name, in [`param_shapes`](super::param_shapes) order.
    ///
    /// # Errors
    /// Copy failures.
    pub fn download_params(&self) -> Result<Vec<(String, Vec<f32>)>, KernelError> {
        self.params
            .named()
            .into_iter()
            .map(|(name, b)| Ok((name, self.pass.ops.download(b)?)))
            .collect()
    }

    /// Every gradient on the host, by name, in [`param_shapes`](super::param_shapes) order.
    ///
    /// # Errors
    /// Copy failures.
    pub fn download_grads(&self) -> Result<Vec<(String, Vec<f32>)>, KernelError> {
        self.grads
            .named()
            .into_iter()
            .map(|(name, b)| Ok((name, self.pass.ops.download(b)?)))
            .collect()
    }

    /// One training step's forward and backward on `rows` sequences of `t` tokens (`inputs`
    /// and `targets` row after row): returns the mean cross-entropy over the `rows·t` tokens
    /// (summed on the host in f64: this waits for the device) and leaves every parameter's
    /// gradient (of that mean) in [`grads`](Self::grads), overwriting the previous step's.
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward); a copy failure.
    pub fn step(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
    ) -> Result<f32, KernelError> {
        let n = rows * t;
        let losses = self.forward_backward(inputs, targets, rows, t)?;
        let losses = self.pass.ops.download(&losses)?;
        let total: f64 = losses.iter().map(|&l| f64::from(l)).sum();
        Ok((total / n as f64) as f32)
    }

    /// [`step`](Self::step) without waiting: enqueues the forward and backward and returns
    /// the `rows·t` per-token losses on the device (whose mean is the step's loss:
    /// [`GptOps::loss_accumulate`] sums them there).
    ///
    /// # Errors
    /// [`KernelError::InvalidArgument`] for `t` of 0 or past `block_size`, lengths other than
    /// `rows·t`, or an id or target not below `vocab_size` (checked before any work);
    /// operation failures.
    pub fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
    ) -> Result<O::Buf, KernelError> {
        self.forward_backward_scaled(inputs, targets, rows, t, None)
    }

    /// [`forward_backward`](Self::forward_backward) of the loss scaled by a grad scaler's
    /// scale, read on the device from the step's `scale` scalars when given
    /// ([`GptPass::forward_backward_scaled`](super::GptPass::forward_backward_scaled)).
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward); a scalar buffer too short.
    pub fn forward_backward_scaled(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        rows: usize,
        t: usize,
        scale: Option<&O::Scalars>,
    ) -> Result<O::Buf, KernelError> {
        self.pass.check_batch(inputs, targets, rows, t)?;
        self.pass.ops.fill_zero_many(&mut self.grads.all_mut())?;
        let mut units = Resident {
            params: &self.params,
            grads: &mut self.grads,
        };
        self.pass
            .forward_backward_scaled(&mut units, inputs, targets, rows, t, scale)
    }
}
