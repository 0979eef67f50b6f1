//! The fused attention's two operations
//! ([`GptOps::attention_fused_forward`](super::GptOps::attention_fused_forward) and
//! [`GptOps::attention_fused_backward`](super::GptOps::attention_fused_backward)) on the host
//! twins and on CUDA: each reads its operands as the 16-bit type the products round to, and
//! refuses f32 products.

use cudarc::driver::CudaSlice;
use half::{bf16, f16};

use super::cuda::{CudaBuf, CudaOps};
use super::cuda_products::{CudaOperand, HalfType};
use super::host_ops::{HostBuf, HostOperand, HostOps};
use crate::host::attention::{self, FusedAttention};
use crate::host::nn::HeadsLayout;
use crate::host::CastFloat;
use crate::{launch, KernelError};
use fsdp_device::DType;

/// Fused attention reads 16-bit operands: the error for f32 products.
fn f32_products(kernel: &'static str) -> KernelError {
    KernelError::InvalidArgument {
        kernel,
        reason: "fused attention reads bf16 or f16 operands (--param-dtype bf16 or f16); f32 \
                 products take the chunked or materialized attention"
            .into(),
    }
}

/// `attention_fused_forward` of [`HostOps`].
pub(super) fn host_forward(
    ops: &HostOps,
    a: &FusedAttention,
    [q, k, v]: [&HostOperand; 3],
    y: &mut HostBuf,
    lse: &mut HostBuf,
) -> Result<(), KernelError> {
    match ops.products.half() {
        Some(DType::BF16) => attention::flash_forward::<bf16>(a, q, k, v, y, lse),
        Some(DType::F16) => attention::flash_forward::<f16>(a, q, k, v, y, lse),
        _ => Err(f32_products("flash_forward")),
    }
}

/// `attention_fused_backward` of [`HostOps`]; the rows' sums are scratch, not
/// counted (as on CUDA, where they come from the driver's pool).
pub(super) fn host_backward(
    ops: &HostOps,
    a: &FusedAttention,
    layout: HeadsLayout,
    [q, k, v, y, dout]: [&HostOperand; 5],
    lse: &HostBuf,
    [dq, dk, dv]: [&mut HostBuf; 3],
) -> Result<(), KernelError> {
    let mut dsum = vec![0.0f32; a.rows()];
    fn run<H: CastFloat>(
        a: &FusedAttention,
        layout: HeadsLayout,
        [q, k, v, y, dout]: [&[f32]; 5],
        lse: &[f32],
        dsum: &mut [f32],
        [dq, dk, dv]: [&mut [f32]; 3],
    ) -> Result<(), KernelError> {
        if FusedAttention::of(&layout, a.scale) != *a {
            return Err(KernelError::InvalidArgument {
                kernel: "flash_backward",
                reason: format!("the output's layout {layout:?} is not of the heads of {a:?}"),
            });
        }
        attention::flash_backward_dot(&layout, dout, y, dsum)?;
        attention::flash_backward::<H>(a, q, k, v, dout, lse, dsum, dq, dk, dv)
    }
    let ins: [&[f32]; 5] = [q, k, v, y, dout];
    let outs: [&mut [f32]; 3] = [dq, dk, dv];
    match ops.products.half() {
        Some(DType::BF16) => run::<bf16>(a, layout, ins, lse, &mut dsum, outs),
        Some(DType::F16) => run::<f16>(a, layout, ins, lse, &mut dsum, outs),
        _ => Err(f32_products("flash_backward")),
    }
}

/// The operands as `H`, if every one is of that type.
fn as_half<H: HalfType, const N: usize>(ops: [&CudaOperand; N]) -> Option<[&CudaSlice<H>; N]> {
    let mut out = Vec::with_capacity(N);
    for o in ops {
        out.push(H::of(o)?);
    }
    out.try_into().ok()
}

/// `attention_fused_forward` of [`CudaOps`].
pub(super) fn cuda_forward(
    ops: &CudaOps,
    a: &FusedAttention,
    qkv: [&CudaOperand; 3],
    y: &mut CudaBuf,
    lse: &mut CudaBuf,
) -> Result<(), KernelError> {
    if let Some([q, k, v]) = as_half::<bf16, 3>(qkv) {
        return launch::flash_forward(&ops.cuda, a, q, k, v, y, lse);
    }
    if let Some([q, k, v]) = as_half::<f16, 3>(qkv) {
        return launch::flash_forward(&ops.cuda, a, q, k, v, y, lse);
    }
    Err(f32_products("flash_forward"))
}

/// `attention_fused_backward` of [`CudaOps`].
pub(super) fn cuda_backward(
    ops: &CudaOps,
    a: &FusedAttention,
    layout: HeadsLayout,
    ins: [&CudaOperand; 5],
    lse: &CudaBuf,
    [dq, dk, dv]: [&mut CudaBuf; 3],
) -> Result<(), KernelError> {
    let s = &ops.cuda;
    if let Some([q, k, v, y, o]) = as_half::<bf16, 5>(ins) {
        return launch::flash_backward(s, a, &layout, q, k, v, y, o, lse, dq, dk, dv);
    }
    if let Some([q, k, v, y, o]) = as_half::<f16, 5>(ins) {
        return launch::flash_backward(s, a, &layout, q, k, v, y, o, lse, dq, dk, dv);
    }
    Err(f32_products("flash_backward"))
}
