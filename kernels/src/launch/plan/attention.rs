//! The launches of the fused causal attention (`cu/attention.cu`): forward, and backward's
//! three kernels (the rows' sums, then keys, then queries).

use cudarc::driver::LaunchConfig;

use super::{blocks, KernelLaunch, Param};
use crate::host::attention::FusedAttention;
use crate::host::nn::HeadsLayout;
use crate::host::CastFloat;
use crate::{KernelError, Program};

/// The values of one head the CUDA kernels take: 32 or 64 (GPT-2's heads are 64 at every
/// size).
pub const FLASH_HEAD_DIMS: [usize; 2] = [32, 64];
/// Rows of one tile (a block's queries or keys, 16 a warp).
pub const FLASH_TILE: usize = 64;
/// Threads of every block of the attention's kernels (four warps).
const FLASH_THREADS: u32 = 128;

/// Checks what the kernels take, but the device: heads of [`FLASH_HEAD_DIMS`] values, bf16
/// or f16 operands, at most 65,535 pairs (the grid's second dimension) and `t` within an
/// `i32`.
///
/// # Errors
/// [`KernelError::InvalidArgument`] (for `kernel`) otherwise.
pub(crate) fn flash_check<H: CastFloat>(
    kernel: &'static str,
    a: &FusedAttention,
) -> Result<(), KernelError> {
    let bad = |reason: String| Err(KernelError::InvalidArgument { kernel, reason });
    if H::NAME != "bf16" && H::NAME != "f16" {
        return bad(format!(
            "fused attention reads bf16 or f16 operands (tensor cores), not {}",
            H::NAME
        ));
    }
    if !FLASH_HEAD_DIMS.contains(&a.d) {
        return bad(format!(
            "fused attention on CUDA takes heads of 32 or 64 values, not {}",
            a.d
        ));
    }
    if a.pairs > u16::MAX as usize || i32::try_from(a.t).is_err() {
        return bad(format!(
            "{} (sequence, head) pairs of {} tokens: at most 65535 pairs of at most 2^31 - 1",
            a.pairs, a.t
        ));
    }
    Ok(())
}

/// Checks that `layout` holds the heads of `a` (backward reads forward's output through it).
///
/// # Errors
/// [`KernelError::InvalidArgument`] otherwise.
pub(crate) fn flash_layout_check(
    kernel: &'static str,
    a: &FusedAttention,
    layout: &HeadsLayout,
) -> Result<(), KernelError> {
    if FusedAttention::of(layout, a.scale) != *a {
        return Err(KernelError::InvalidArgument {
            kernel,
            reason: format!("the output's layout {layout:?} is not of the heads of {a:?}"),
        });
    }
    Ok(())
}

/// Device addresses must be 16-byte aligned: the kernels load eight 16-bit values at once.
fn aligned(kernel: &'static str, what: &'static str, addr: u64) -> Result<(), KernelError> {
    if addr % 16 == 0 {
        return Ok(());
    }
    Err(KernelError::InvalidArgument {
        kernel,
        reason: format!("{what} at {addr:#x} is not 16-byte aligned"),
    })
}

/// One block per tile of [`FLASH_TILE`] rows (x) and pair (y).
fn tiles_config(a: &FusedAttention) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (a.t.div_ceil(FLASH_TILE) as u32, a.pairs as u32, 1),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `<kernel>_<H>_d<d>`.
fn name<H: CastFloat>(kernel: &str, a: &FusedAttention) -> String {
    format!("{kernel}_{}_d{}", H::NAME, a.d)
}

/// [`launch::flash_forward`](crate::launch::flash_forward): reads `q`, `k` and `v`
/// (`[pairs, t, d]` of `H`); writes `y` (`[pairs, t, d]` f32) and `lse` (`pairs·t` f32).
/// Nothing for an empty `a`.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for what the kernels do not take (see [`FLASH_HEAD_DIMS`];
/// f32 operands) and for `q`, `k`, `v` or `y` not 16-byte aligned. The compute capability is
/// the launcher's check.
pub fn flash_forward<H: CastFloat>(
    a: &FusedAttention,
    q: u64,
    k: u64,
    v: u64,
    y: u64,
    lse: u64,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let kernel = "flash_forward";
    if a.is_empty() {
        return Ok(Vec::new());
    }
    flash_check::<H>(kernel, a)?;
    for (what, p) in [("q", q), ("k", k), ("v", v), ("y", y)] {
        aligned(kernel, what, p)?;
    }
    // `flash_forward_<H>_d<d>(const u16* q, const u16* k, const u16* v, float* y, float* lse,
    // int t, float scale2)`: each block reads and writes only its pair's rows below t.
    Ok(vec![KernelLaunch::new(
        Program::Attention,
        name::<H>(kernel, a),
        tiles_config(a),
        vec![
            Param::Ptr(q),
            Param::Ptr(k),
            Param::Ptr(v),
            Param::Ptr(y),
            Param::Ptr(lse),
            Param::I32(a.t as i32),
            Param::F32(a.scale2()),
        ],
    )])
}

/// The f32 scratch [`flash_backward`] needs: the rows' sums, `pairs·t` (0 for none).
pub fn flash_backward_scratch(a: &FusedAttention) -> usize {
    a.rows()
}

/// [`launch::flash_backward`](crate::launch::flash_backward): reads `q`, `k`, `v` and `dout`
/// (`[pairs, t, d]` of `H`), forward's output `y` (token rows of `H`, placed as `layout`
/// says) and `lse` (`pairs·t` f32); writes `dq`, `dk` and `dv` (`[pairs, t, d]` f32), through
/// `dsum` ([`flash_backward_scratch`] f32: `flash_backward_dot` writes each before the two
/// kernels after it read them). Nothing for an empty `a`.
///
/// # Errors
/// [`KernelError::InvalidArgument`] for a `layout` of other heads than `a`'s, as
/// [`flash_forward`] for what the kernels do not take, and for `q`, `k`, `v`, `dout`, `dq`,
/// `dk` or `dv` not 16-byte aligned.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<H: CastFloat>(
    a: &FusedAttention,
    layout: &HeadsLayout,
    q: u64,
    k: u64,
    v: u64,
    y: u64,
    dout: u64,
    lse: u64,
    dsum: u64,
    dq: u64,
    dk: u64,
    dv: u64,
) -> Result<Vec<KernelLaunch>, KernelError> {
    let kernel = "flash_backward";
    flash_layout_check(kernel, a, layout)?;
    if a.is_empty() {
        return Ok(Vec::new());
    }
    flash_check::<H>("flash_backward_dot", a)?;
    for (what, p) in [
        ("q", q),
        ("k", k),
        ("v", v),
        ("dout", dout),
        ("dq", dq),
        ("dk", dk),
        ("dv", dv),
    ] {
        aligned(kernel, what, p)?;
    }
    let (t, scale, scale2) = (
        Param::I32(a.t as i32),
        Param::F32(a.scale),
        Param::F32(a.scale2()),
    );
    let warps = FLASH_THREADS as usize / 32;
    let operands = [q, k, v, dout, lse, dsum].map(Param::Ptr);
    let mut dkv = operands.to_vec();
    dkv.extend([
        Param::Ptr(dk),
        Param::Ptr(dv),
        t.clone(),
        scale.clone(),
        scale2.clone(),
    ]);
    let mut dq_params = operands.to_vec();
    dq_params.extend([Param::Ptr(dq), t.clone(), scale, scale2]);
    Ok(vec![
        // `flash_backward_dot_<H>_d<d>(const u16* dout, const u16* y, float* dsum, u64 rows,
        // int t, int heads, int row, int offset)`: one warp per row below `rows` = pairs·t,
        // reading the row's head of `y` in token rows of `row` (from column `offset`).
        KernelLaunch::new(
            Program::Attention,
            name::<H>("flash_backward_dot", a),
            blocks(a.rows().div_ceil(warps) as u32, FLASH_THREADS),
            vec![
                Param::Ptr(dout),
                Param::Ptr(y),
                Param::Ptr(dsum),
                Param::U64(a.rows() as u64),
                t,
                Param::I32(layout.h as i32),
                Param::I32(layout.row as i32),
                Param::I32(layout.offset as i32),
            ],
        ),
        // `flash_backward_dkv_<H>_d<d>(const u16* q, k, v, dout, const float* lse, dsum,
        // float* dk, float* dv, int t, float scale, float scale2)`: one block per key tile and
        // pair writes only its own keys' rows.
        KernelLaunch::new(
            Program::Attention,
            name::<H>("flash_backward_dkv", a),
            tiles_config(a),
            dkv,
        ),
        // `flash_backward_dq_<H>_d<d>(const u16* q, k, v, dout, const float* lse, dsum,
        // float* dq, int t, float scale, float scale2)`: one block per query tile and pair
        // writes only its rows of dq.
        KernelLaunch::new(
            Program::Attention,
            name::<H>("flash_backward_dq", a),
            tiles_config(a),
            dq_params,
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    const A: FusedAttention = FusedAttention {
        pairs: 3,
        t: 130,
        d: 64,
        scale: 0.125,
    };

    fn layout(a: &FusedAttention) -> HeadsLayout {
        HeadsLayout {
            b: 1,
            t: a.t,
            h: a.pairs,
            d: a.d,
            row: a.pairs * a.d,
            offset: 0,
        }
    }

    fn backward<H: CastFloat>(
        a: &FusedAttention,
        l: &HeadsLayout,
        dk: u64,
    ) -> Result<Vec<KernelLaunch>, KernelError> {
        let p = |i: u64| i << 20;
        flash_backward::<H>(
            a,
            l,
            p(1),
            p(2),
            p(3),
            p(4),
            p(5),
            p(6),
            p(7),
            p(8),
            dk,
            p(10),
        )
    }

    #[test]
    fn flash_plans_are_the_kernels_grids_and_refuse_what_they_do_not_take() {
        let f = flash_forward::<bf16>(&A, 16, 32, 48, 64, 80).unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kernel, "flash_forward_bf16_d64");
        assert_eq!(f[0].config.grid_dim, (3, 3, 1));
        assert_eq!(f[0].params[5], Param::I32(130));
        let b = backward::<f16>(&A, &layout(&A), 9 << 20).unwrap();
        let names: Vec<&str> = b.iter().map(|l| l.kernel.as_str()).collect();
        assert_eq!(
            names,
            [
                "flash_backward_dot_f16_d64",
                "flash_backward_dkv_f16_d64",
                "flash_backward_dq_f16_d64"
            ]
        );
        // One warp a row: 390 rows in blocks of four warps.
        assert_eq!(b[0].config.grid_dim, (98, 1, 1));
        assert_eq!(b[1].config.grid_dim, (3, 3, 1));
        assert_eq!(flash_backward_scratch(&A), 390);

        let empty = FusedAttention { t: 0, ..A };
        assert!(flash_forward::<bf16>(&empty, 1, 1, 1, 1, 1)
            .unwrap()
            .is_empty());
        assert!(backward::<bf16>(&empty, &layout(&empty), 0)
            .unwrap()
            .is_empty());
        let invalid = |r: Result<Vec<KernelLaunch>, KernelError>| {
            matches!(r, Err(KernelError::InvalidArgument { .. }))
        };
        assert!(invalid(flash_forward::<f32>(&A, 0, 0, 0, 0, 0)));
        assert!(invalid(flash_forward::<bf16>(
            &FusedAttention { d: 48, ..A },
            0,
            0,
            0,
            0,
            0
        )));
        assert!(invalid(flash_forward::<bf16>(&A, 0, 8, 0, 0, 0)));
        assert!(invalid(backward::<bf16>(&A, &layout(&A), (9 << 20) + 4)));
        let other = HeadsLayout { h: 1, ..layout(&A) };
        assert!(invalid(backward::<bf16>(&A, &other, 9 << 20)));
    }
}
