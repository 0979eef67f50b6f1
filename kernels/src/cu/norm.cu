// The sum of squares of an f32 shard in f64 (for the global gradient norm), in a fixed order
// that does not depend on the GPU: block b sums elements [b*CHUNK, (b+1)*CHUNK), thread t of
// it the elements b*CHUNK + t + k*BLOCK (k = 0..ITEMS), then a shared-memory tree halves the
// 256 partial sums; a second single-block pass reduces the block sums the same way (thread t
// sums block sums t, t + BLOCK, ...). The host twin follows the same order, so the results
// are bitwise equal. Squares of f32 values are exact in f64.

#define NORM_BLOCK 256
#define NORM_ITEMS 16

__device__ __forceinline__ void tree_sum(double* sh, u32 t) {
    for (u32 s = NORM_BLOCK / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (t < s) sh[t] = __dadd_rn(sh[t], sh[t + s]);
    }
    __syncthreads();
}

// Block `b` of a tensor `x` of `n` elements: the sum of squares of its chunk, in the fixed
// order, into *out (thread 0 writes it).
__device__ __forceinline__ void block_squares(const float* x, u64 n, u64 b, double* out) {
    __shared__ double sh[NORM_BLOCK];
    u32 t = threadIdx.x;
    u64 base = b * (NORM_BLOCK * NORM_ITEMS);
    double acc = 0.0;
    for (u32 k = 0; k < NORM_ITEMS; k++) {
        u64 i = base + t + (u64)k * NORM_BLOCK;
        if (i < n) {
            double v = (double)x[i];
            acc = __dadd_rn(acc, __dmul_rn(v, v));
        }
    }
    sh[t] = acc;
    tree_sum(sh, t);
    if (t == 0) *out = sh[0];
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    sum_squares_f32(const float* x, u64 n, double* block_sums) {
    block_squares(x, n, blockIdx.x, &block_sums[blockIdx.x]);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    sum_f64_final(const double* block_sums, u64 count, double* out) {
    __shared__ double sh[NORM_BLOCK];
    u32 t = threadIdx.x;
    double acc = 0.0;
    for (u64 i = t; i < count; i += NORM_BLOCK) acc = __dadd_rn(acc, block_sums[i]);
    sh[t] = acc;
    tree_sum(sh, t);
    if (t == 0) out[0] = sh[0];
}

// The sums of squares of many f32 tensors in two launches (PyTorch's multi_tensor_apply: the
// list by value in the parameters), each in exactly the order of sum_squares_f32 then
// sum_f64_final: tensor k's blocks are the 1-D grid's blocks start[k] .. start[k + 1], block
// start[k] + b summing the tensor's chunk b into block_sums[start[k] + b]; then block k of the
// second launch reduces those block sums into out[k].
#define SQUARES_TENSORS 96
struct SquaresList {
    u64 x[SQUARES_TENSORS];
    u64 n[SQUARES_TENSORS];
    u32 start[SQUARES_TENSORS + 1];
};

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    sum_squares_many(SquaresList l, u32 count, double* block_sums) {
    u32 b = blockIdx.x;
    // The tensor whose blocks hold b: the last k with start[k] <= b (binary search).
    u32 lo = 0, hi = count;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (l.start[mid] <= b) lo = mid; else hi = mid;
    }
    block_squares((const float*)l.x[lo], l.n[lo], b - l.start[lo], &block_sums[b]);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    sum_f64_final_many(SquaresList l, const double* block_sums, double* out) {
    __shared__ double sh[NORM_BLOCK];
    u32 k = blockIdx.x, t = threadIdx.x;
    u32 first = l.start[k], count = l.start[k + 1] - first;
    double acc = 0.0;
    for (u32 i = t; i < count; i += NORM_BLOCK) acc = __dadd_rn(acc, block_sums[first + i]);
    sh[t] = acc;
    tree_sum(sh, t);
    if (t == 0) out[k] = sh[0];
}

// The loss of one micro-batch of `accum` into the step's scalars (see host/step.rs): one block
// sums the `n` per-token losses in f64 (thread t: elements t, t + BLOCK, ...; then the tree),
// thread 0 rounds their mean to f32, divides it by `accum` in f64, rounds again and adds it in
// f32 to scalars[0] (to 0 when `first`).
extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
    loss_accumulate(const float* losses, u64 n, u32 accum, u32 first, double* scalars) {
    __shared__ double sh[NORM_BLOCK];
    u32 t = threadIdx.x;
    double acc = 0.0;
    for (u64 i = t; i < n; i += NORM_BLOCK) acc = __dadd_rn(acc, (double)losses[i]);
    sh[t] = acc;
    tree_sum(sh, t);
    if (t == 0) {
        float mean = __double2float_rn(__ddiv_rn(sh[0], (double)n));
        float part = __double2float_rn(__ddiv_rn((double)mean, (double)accum));
        float before = first ? 0.0f : __double2float_rn(scalars[0]);
        scalars[0] = (double)__fadd_rn(before, part);
    }
}

// The global gradient norm and the clip coefficient from its squared parts, one thread (twin:
// host::clip_coefficient): out[0] = sqrt(sharded[0] + replicated[0]); out[1] = max_norm /
// (out[0] + 1e-6) rounded to f32 when the norm is finite and that is below 1, else 1 (no
// clipping; a max_norm of +inf never clips).
extern "C" __global__ void clip_coefficient(const double* sharded, const double* replicated,
                                            double max_norm, double* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = __dsqrt_rn(__dadd_rn(sharded[0], replicated[0]));
    double coef = __ddiv_rn(max_norm, __dadd_rn(total, 1e-6));
    out[0] = total;
    out[1] = (isfinite(total) && coef < 1.0) ? (double)__double2float_rn(coef) : 1.0;
}
