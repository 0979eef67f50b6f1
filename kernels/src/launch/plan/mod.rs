//! What each launcher enqueues, as data: the kernels, their grids and their parameters in
//! order ([`KernelLaunch`]), computed from device addresses and lengths by pure functions.
//!
//! Every launcher of [`launch`](crate::launch) checks its slices, takes their addresses,
//! calls its namesake here and enqueues what it returns, nothing else. So the parameter
//! lists, their offsets into buffers, the grids and the order of a launcher's kernels exist
//! once, and the kernels' host emulation (`tests/emulated_*`) runs them as the GPU would: it
//! gives each buffer an address, calls these functions and runs their launches, each
//! parameter checked against its kernel's C signature.
//!
//! A null pointer is `Param::Ptr(0)`. The functions check what does not depend on memory
//! (grid limits, a cast of a type to itself); lengths of slices are the launchers' checks.
//!
//! ```
//! use fsdp_kernels::launch::plan::{self, Param};
//!
//! // y = 2·x + y over 1000 f32 at two device addresses: one launch of `axpby_f32`.
//! let launches = plan::axpby::<f32>(2.0, 0x7f00_0000_0000, 1.0, 0x7f00_0001_0000, 1000);
//! assert_eq!(launches.len(), 1);
//! assert_eq!(launches[0].kernel, "axpby_f32");
//! assert_eq!(launches[0].config.grid_dim, (4, 1, 1));
//! assert_eq!(launches[0].params[1], Param::Ptr(0x7f00_0000_0000));
//! ```

use cudarc::driver::LaunchConfig;

use crate::Program;

// One file per group of launchers: `launch/mod.rs`'s element-wise kernels and reductions,
// its optimizers and norm; the segment launches (`foreach.rs`'s grid, `gather.rs`); the
// layers (`nn.rs`), softmaxes and loss (`nn.rs`, `nn_loss.rs`); embeddings and heads
// (`nn_embed.rs`, `nn_heads.rs`); the fused attention; the step's decisions (`step.rs`) and
// the many-tensor launches (`foreach.rs`).
mod attention;
mod elementwise;
mod embed_heads;
mod foreach;
mod nn;
mod nn_softmax;
mod optim;
mod segments;
mod step;

pub use attention::{
    flash_backward, flash_backward_scratch, flash_forward, FLASH_HEAD_DIMS, FLASH_TILE,
};
pub use elementwise::{axpby, cast, div_scalar, memset, reduce, scale_by};
pub use embed_heads::{
    bias_add, embedding_backward_positions, embedding_backward_tokens,
    embedding_backward_tokens_host_ids, embedding_forward, heads_merge, heads_split,
};
pub use foreach::{
    adamw_decided_many, anyprecision_decided_many, fill_zero_many, sum_of_squares_many,
    sum_of_squares_many_blocks, DecidedTensor, ADAMW_TENSORS, ANYPRECISION_TENSORS,
    SQUARES_TENSORS, ZERO_SEGMENTS,
};
pub use nn::{
    bias_grad, bias_grad_scratch, gelu_backward, gelu_forward, layernorm_backward_input,
    layernorm_backward_params, layernorm_backward_params_scratch, layernorm_forward,
    per_column_tile, per_row, per_warp_row,
};
pub use nn_softmax::{
    causal_softmax_backward, causal_softmax_forward, causal_softmax_forward_both,
    cross_entropy_fused, cross_entropy_fused_in_place,
};
pub use optim::{adamw, clip_coefficient, sgd, sum_of_squares, sum_of_squares_blocks};
pub use segments::{foreach_grid, gather_copies, gather_grid, GatherCopy, GATHER_SEGMENTS};
// What the launchers check or name before taking addresses (the same words as the plans).
pub(crate) use attention::{flash_check, flash_layout_check};
pub(crate) use embed_heads::{heads_merge_kernel, heads_split_kernel};
pub(crate) use nn::{gelu_forward_kernel, layernorm_forward_kernel, writing};
pub(crate) use nn_softmax::{
    causal_softmax_backward_kernel, causal_softmax_forward_both_kernel,
    causal_softmax_forward_kernel, cross_entropy_fused_kernel,
};
pub use step::{
    adamw_decided, anyprecision_decided, engine_decide, loss_accumulate, sgd_decided, step_decide,
    unscale_by,
};

/// Threads per block of the element-wise kernels.
pub(crate) const BLOCK: u32 = 256;
/// At most this many blocks; the kernels loop over the rest (grid-stride).
pub(crate) const MAX_BLOCKS: usize = 1 << 20;

/// The grid of the element-wise kernels over `n` elements: blocks of 256 threads, at most 2^20
/// of them (the kernels stride over the rest).
pub fn config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `grid` blocks of `threads` threads, one-dimensional.
pub(crate) fn blocks(grid: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A struct's array of `slots` fields for a batch: `f` of each of `batch`, then zeros (the
/// unused slots of the many-tensor lists and the gather's segments).
pub(crate) fn column<T, V: Copy + Default>(
    slots: usize,
    batch: &[T],
    f: impl Fn(&T) -> V,
) -> Vec<V> {
    let mut a = vec![V::default(); slots];
    for (slot, t) in a.iter_mut().zip(batch) {
        *slot = f(t);
    }
    a
}

/// One kernel launch: what `cuLaunchKernel` is given.
#[derive(Clone, Debug)]
pub struct KernelLaunch {
    /// The program holding the kernel.
    pub program: Program,
    /// The kernel's name (its `extern "C"` symbol).
    pub kernel: String,
    /// Grid, block and dynamic shared memory.
    pub config: LaunchConfig,
    /// The parameters, in the kernel's order.
    pub params: Vec<Param>,
}

impl KernelLaunch {
    /// `kernel` of `program` on `config` with `params`.
    pub fn new(
        program: Program,
        kernel: impl Into<String>,
        config: LaunchConfig,
        params: Vec<Param>,
    ) -> KernelLaunch {
        KernelLaunch {
            program,
            kernel: kernel.into(),
            config,
            params,
        }
    }
}

/// One kernel parameter, by value.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Param {
    /// A device address (0: a null pointer).
    Ptr(u64),
    /// A 64-bit unsigned integer.
    U64(u64),
    /// A 32-bit unsigned integer.
    U32(u32),
    /// A 16-bit unsigned integer.
    U16(u16),
    /// A 32-bit signed integer.
    I32(i32),
    /// A float.
    F32(f32),
    /// A double.
    F64(f64),
    /// A struct passed by value.
    Struct(CStruct),
}

/// The largest struct a parameter may be (CUDA's classic limit on a launch's parameters).
pub const STRUCT_BYTES: usize = 4096;

/// A struct parameter's storage: [`STRUCT_BYTES`], 8-byte aligned (its fields' largest).
#[repr(C, align(8))]
#[derive(Clone, PartialEq)]
pub(crate) struct StructStorage([u8; STRUCT_BYTES]);

// SAFETY: plain bytes, every one initialised (zero where no field was written);
// `cuLaunchKernel` copies the kernel's parameter size from its start.
unsafe impl cudarc::driver::DeviceRepr for StructStorage {}

/// A C struct's bytes, written field by field in C's layout (each field at its natural
/// alignment, the size rounded up to the largest), with the offsets of its pointer fields.
#[derive(Clone, PartialEq)]
pub struct CStruct {
    storage: Box<StructStorage>,
    len: usize,
    align: usize,
    pointers: Vec<usize>,
}

impl std::fmt::Debug for CStruct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CStruct")
            .field("len", &self.len)
            .field("align", &self.align)
            .field("pointers", &self.pointers.len())
            .finish()
    }
}

impl Default for CStruct {
    fn default() -> Self {
        CStruct::new()
    }
}

impl CStruct {
    /// An empty struct.
    pub fn new() -> CStruct {
        CStruct {
            storage: Box::new(StructStorage([0; STRUCT_BYTES])),
            len: 0,
            align: 1,
            pointers: Vec::new(),
        }
    }

    fn put(&mut self, bytes: &[u8], align: usize) -> usize {
        let at = self.len.next_multiple_of(align);
        assert!(
            at + bytes.len() <= STRUCT_BYTES,
            "a kernel's struct parameter past {STRUCT_BYTES} bytes"
        );
        self.storage.0[at..at + bytes.len()].copy_from_slice(bytes);
        self.len = at + bytes.len();
        self.align = self.align.max(align);
        at
    }

    /// Appends `params` as fields, each as the kernel parameter of its type is laid out (an
    /// address as a pointer field): a struct whose fields are a kernel's parameters in the same
    /// order (`AdamWArgs` and `adamw_f32`'s scalars).
    ///
    /// # Panics
    /// For a struct among `params` (none is nested).
    pub fn fields(&mut self, params: &[Param]) -> &mut CStruct {
        for p in params {
            match p {
                Param::Ptr(v) => {
                    self.pointers(&[*v]);
                }
                Param::U64(v) => {
                    self.u64s(&[*v]);
                }
                Param::U32(v) => {
                    self.u32s(&[*v]);
                }
                Param::F32(v) => {
                    self.f32s(&[*v]);
                }
                Param::U16(v) => {
                    self.put(&v.to_le_bytes(), 2);
                }
                Param::I32(v) => {
                    self.put(&v.to_le_bytes(), 4);
                }
                Param::F64(v) => {
                    self.put(&v.to_le_bytes(), 8);
                }
                Param::Struct(_) => panic!("a struct field of a struct parameter"),
            }
        }
        self
    }

    /// Appends device addresses (`T*` fields; 0 for unused slots).
    pub fn pointers(&mut self, v: &[u64]) -> &mut CStruct {
        for p in v {
            let at = self.put(&p.to_le_bytes(), 8);
            self.pointers.push(at);
        }
        self
    }

    /// Appends `u64` fields.
    pub fn u64s(&mut self, v: &[u64]) -> &mut CStruct {
        for x in v {
            self.put(&x.to_le_bytes(), 8);
        }
        self
    }

    /// Appends `u32` fields.
    pub fn u32s(&mut self, v: &[u32]) -> &mut CStruct {
        for x in v {
            self.put(&x.to_le_bytes(), 4);
        }
        self
    }

    /// Appends `float` fields.
    pub fn f32s(&mut self, v: &[f32]) -> &mut CStruct {
        for x in v {
            self.put(&x.to_le_bytes(), 4);
        }
        self
    }

    /// The struct's size: its fields' end rounded up to its alignment, as C's `sizeof`.
    pub fn size(&self) -> usize {
        self.len.next_multiple_of(self.align)
    }

    /// Its alignment, as C's `alignof`.
    pub fn align(&self) -> usize {
        self.align
    }

    /// Its bytes ([`size`](Self::size) of them; padding is zero).
    pub fn bytes(&self) -> Vec<u8> {
        self.storage.0[..self.size()].to_vec()
    }

    /// Rewrites each non-null pointer field `p` to `f(p)` (memory moved: a test's buffers
    /// placed on a device).
    pub fn relocate(&mut self, f: impl Fn(u64) -> u64) {
        for &at in &self.pointers {
            let old = u64::from_le_bytes(self.storage.0[at..at + 8].try_into().expect("8 bytes"));
            if old != 0 {
                self.storage.0[at..at + 8].copy_from_slice(&f(old).to_le_bytes());
            }
        }
    }

    /// The byte offsets of its pointer fields.
    pub fn pointer_offsets(&self) -> &[usize] {
        &self.pointers
    }

    /// The storage handed to `cuLaunchKernel` (which copies the kernel's parameter size from
    /// it).
    pub(crate) fn storage(&self) -> &StructStorage {
        &self.storage
    }
}

/// `(name, sizeof, alignof)` of the first struct parameter of `launch`, for
/// [`assert_c_layouts`](crate::launch::assert_c_layouts).
#[cfg(test)]
pub(crate) fn struct_layout<'a>(name: &'a str, launch: &KernelLaunch) -> (&'a str, usize, usize) {
    let s = launch
        .params
        .iter()
        .find_map(|p| match p {
            Param::Struct(s) => Some(s),
            _ => None,
        })
        .expect("a struct parameter");
    (name, s.size(), s.align())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_struct_is_laid_out_as_c_lays_it_out() {
        let mut s = CStruct::new();
        s.pointers(&[0x1122_3344_5566_7788, 0]).u32s(&[1, 2, 3]);
        // Two 8-byte pointers, three u32 (12 bytes), tail padding to 8: sizeof is 32.
        assert_eq!((s.size(), s.align()), (32, 8));
        assert_eq!(s.pointer_offsets(), &[0, 8]);
        let b = s.bytes();
        assert_eq!(b.len(), 32);
        assert_eq!(&b[..8], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&b[16..28], &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]);
        assert_eq!(&b[28..], &[0; 4]);
        let mut r = s.clone();
        r.relocate(|p| p + 16);
        assert_eq!(&r.bytes()[..8], &0x1122_3344_5566_7798u64.to_le_bytes());
        assert_eq!(&r.bytes()[8..], &b[8..], "a null pointer stays null");
        let mut t = CStruct::new();
        t.u32s(&[7]).u64s(&[9]).f32s(&[1.5]);
        // A u32, padding to 8, a u64, a float, padding: 24.
        assert_eq!((t.size(), t.align()), (24, 8));
        assert_eq!(&t.bytes()[8..16], &9u64.to_le_bytes());
        assert_eq!(&t.bytes()[16..20], &1.5f32.to_le_bytes());
        let mut f = CStruct::new();
        f.f32s(&[1.0, 2.0, 3.0]);
        assert_eq!((f.size(), f.align()), (12, 4));
        // Parameters as fields: as the typed writers lay them out.
        let mut g = CStruct::new();
        g.fields(&[
            Param::U16(3),
            Param::Ptr(0x10),
            Param::I32(-1),
            Param::F64(2.5),
            Param::U32(7),
            Param::F32(1.5),
            Param::U64(9),
        ]);
        let mut h = CStruct::new();
        h.put(&3u16.to_le_bytes(), 2);
        h.pointers(&[0x10]);
        h.put(&(-1i32).to_le_bytes(), 4);
        h.put(&2.5f64.to_le_bytes(), 8);
        h.u32s(&[7]).f32s(&[1.5]).u64s(&[9]);
        assert_eq!((g.bytes(), g.size(), g.align()), (h.bytes(), 48, 8));
        assert_eq!(g.pointer_offsets(), &[8]);
    }

    #[test]
    #[should_panic(expected = "past 4096 bytes")]
    fn a_struct_past_the_parameter_limit_is_refused() {
        CStruct::new().u64s(&[0; 513]);
    }
}
