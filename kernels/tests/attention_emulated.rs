//! The fused attention's CUDA kernels (`src/cu/attention.cu`) run on the host, against their
//! twins (`fsdp_kernels::host::attention`), so that their tiling, masks, shared-memory
//! transposes, online softmax and fragment indexing are checked without a GPU.
//!
//! `common::emulator` compiles the program's very source as C++ (`cuda_shim.h`: a block's
//! threads as host threads, `__syncthreads` and the warps' shuffles through barriers) with
//! `mma.sync` computed from the PTX ISA's fragment layouts, written there once and
//! independently of the kernels' indexing (`tests/emulate/mma_emulated.h`), and runs the four
//! kernels as their launchers launch them (`launch::plan::flash_forward` then
//! `flash_backward`, its row sums in a scratch buffer as the launcher allocates it): the same
//! kernels, grids and parameters. The emulated products sum in order in f32, so the bounds are
//! those of `tests/gpu_attention.rs` (four 16-bit units of each output's largest value, `lse`
//! within 1e-5). Every buffer is guarded: a kernel writing past one fails. What this cannot
//! check is the layouts themselves and the hardware's own behaviour: `gpu_attention` does, on a
//! GPU.
//!
//! It needs a C++20 compiler (`CXX`, else `c++`, `g++` or `clang++`); without one it prints
//! `skipped: …` and passes (CI has one).

mod common;

use common::emulator::{addr, bytes_of, values_of, Emulator};
use common::flash::{check_lse, rel, twin};
use fsdp_kernels::host::attention::FusedAttention;
use fsdp_kernels::host::CastFloat;
use fsdp_kernels::launch::plan;
use fsdp_kernels::Program;
use half::{bf16, f16};

/// `v` rounded to `H`, as bytes.
fn half_bytes<H: CastFloat>(v: &[f32]) -> Vec<u8> {
    let bits: Vec<u16> = v.iter().map(|&x| H::store(x).bits() as u16).collect();
    bytes_of(&bits)
}

/// `n` f32 NaN, as bytes: outputs and scratch start as garbage that every read would show.
fn nans(n: usize) -> Vec<u8> {
    bytes_of(&vec![f32::NAN; n])
}

/// One case on the emulator and the twins: the errors of `[y, dq, dk, dv]`.
fn compare<H: CastFloat>(emu: &Emulator, a: FusedAttention, sharp: f32) -> [f64; 4] {
    let w = twin::<H>(&a, sharp);
    let (n, rows) = (a.len(), a.rows());
    // q, k, v, y, lse, forward's output as token rows, dout, dsum (scratch), dq, dk, dv.
    let mut bufs = vec![
        half_bytes::<H>(&w.q),
        half_bytes::<H>(&w.k),
        half_bytes::<H>(&w.v),
        nans(n),
        nans(rows),
        half_bytes::<H>(&w.rows),
        half_bytes::<H>(&w.dout),
        nans(plan::flash_backward_scratch(&a)),
        nans(n),
        nans(n),
        nans(n),
    ];
    let mut launches =
        plan::flash_forward::<H>(&a, addr(0), addr(1), addr(2), addr(3), addr(4)).unwrap();
    launches.extend(
        plan::flash_backward::<H>(
            &a,
            &w.layout,
            addr(0),
            addr(1),
            addr(2),
            addr(5),
            addr(6),
            addr(4),
            addr(7),
            addr(8),
            addr(9),
            addr(10),
        )
        .unwrap(),
    );
    emu.run_plan(&mut bufs, &launches);
    let got = |i: usize| values_of::<f32>(&bufs[i]);
    check_lse(&a, &got(4), &w.lse);
    [
        rel(&got(3), &w.y),
        rel(&got(8), &w.grads[0]),
        rel(&got(9), &w.grads[1]),
        rel(&got(10), &w.grads[2]),
    ]
}

fn each<H: CastFloat>(test: &str, unit: f64) {
    let Some(emu) = Emulator::build(Program::Attention, test) else {
        return;
    };
    let case = |pairs, t, d: usize| FusedAttention {
        pairs,
        t,
        d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    // One token; a part of a tile; one whole tile and one row more; several tiles with a part
    // (causal tiles of every kind); sharp scores that move the running maximum; heads of 32.
    for (a, sharp) in [
        (case(1, 1, 64), 1.0),
        (case(2, 37, 64), 1.0),
        (case(1, 64, 64), 1.0),
        (case(1, 65, 32), 1.0),
        (case(1, 150, 64), 1.0),
        (case(1, 130, 64), 8.0),
        (case(2, 70, 32), 8.0),
    ] {
        let e = compare::<H>(emu, a, sharp);
        println!(
            "{test}: pairs {} t {} d {} sharp {sharp}: y {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}",
            a.pairs, a.t, a.d, e[0], e[1], e[2], e[3]
        );
        for (what, e) in ["y", "dq", "dk", "dv"].iter().zip(e) {
            assert!(e <= 4.0 * unit, "{a:?}, sharp {sharp}: {what} {e:e}");
        }
    }
}

#[test]
fn emulated_flash_bf16_equals_its_twin() {
    each::<bf16>("emulated_flash_bf16", 2f64.powi(-9));
}

#[test]
fn emulated_flash_f16_equals_its_twin() {
    each::<f16>("emulated_flash_f16", 2f64.powi(-12));
}
