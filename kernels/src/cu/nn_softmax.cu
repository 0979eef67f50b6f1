// Part of the nn program (after nn.cu, before nn_embed_heads.cu; programs.rs joins them):
// the softmaxes, f32 and rounded to bf16 or f16 — the attention's causal softmax forward and
// backward, and the cross-entropy fused with its backward over the tied head's logits.

// Causal softmax forward, one warp per row of [rows, t] (NN_BLOCK / NN_WARP rows a block;
// row r is row i = r % t of its matrix): v_j = s_j * scale for j <= i, p_j = e^(v_j - max) /
// sum, and p_j = 0 above the diagonal. With `pb`, the same pass also writes the probabilities'
// bf16 or f16 rounding (the cast kernel's) there: the probabilities a backward needs in f32
// and a product reads.
template <typename H>
__device__ __forceinline__ void causal_softmax_forward_rows(const float* s, float* p, H* pb,
                                                            u32 t, float scale, u64 rows) {
    u64 row = (u64)blockIdx.x * (NN_BLOCK / NN_WARP) + threadIdx.x / NN_WARP;
    if (row >= rows) return; // the whole warp: no lane is left in a shuffle
    u32 l = threadIdx.x % NN_WARP;
    u32 i = (u32)(row % t);
    u64 off = row * t;
    float mx = -pos_inf();
    for (u32 j = l; j <= i; j += NN_WARP) mx = max_of(mx, fm(s[off + j], scale));
    mx = warp_max(mx);
    float acc = 0.0f;
    for (u32 j = l; j <= i; j += NN_WARP) {
        float e = nn_exp(fs(fm(s[off + j], scale), mx));
        p[off + j] = e;
        acc = fa(acc, e);
    }
    float sum = warp_sum(acc);
    for (u32 j = l; j < t; j += NN_WARP) {
        float v = (j <= i) ? fdv(p[off + j], sum) : 0.0f;
        p[off + j] = v;
        if (pb) pb[off + j] = from_f32<H>(v);
    }
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_forward_f32(const float* s, float* p, u32 t, float scale, u64 rows) {
    causal_softmax_forward_rows<bf16>(s, p, nullptr, t, scale, rows);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_forward_both_bf16(const float* s, float* p, bf16* pb, u32 t, float scale,
                                     u64 rows) {
    causal_softmax_forward_rows(s, p, pb, t, scale, rows);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_forward_both_f16(const float* s, float* p, f16* pb, u32 t, float scale,
                                    u64 rows) {
    causal_softmax_forward_rows(s, p, pb, t, scale, rows);
}

// Causal softmax forward written as its bf16 or f16 rounding (probabilities only products
// read): the f32 kernel's values rounded as the cast kernel rounds. The exponentials are
// computed again in the last pass instead of stored (no f32 row to keep them in), the same
// operations on the same inputs as causal_softmax_forward_f32's.
template <typename H>
__device__ __forceinline__ void causal_softmax_forward_half(const float* s, H* p, u32 t,
                                                            float scale, u64 rows) {
    u64 row = (u64)blockIdx.x * (NN_BLOCK / NN_WARP) + threadIdx.x / NN_WARP;
    if (row >= rows) return;
    u32 l = threadIdx.x % NN_WARP;
    u32 i = (u32)(row % t);
    u64 off = row * t;
    float mx = -pos_inf();
    for (u32 j = l; j <= i; j += NN_WARP) mx = max_of(mx, fm(s[off + j], scale));
    mx = warp_max(mx);
    float acc = 0.0f;
    for (u32 j = l; j <= i; j += NN_WARP) acc = fa(acc, nn_exp(fs(fm(s[off + j], scale), mx)));
    float sum = warp_sum(acc);
    for (u32 j = l; j < t; j += NN_WARP) {
        float e = (j <= i) ? fdv(nn_exp(fs(fm(s[off + j], scale), mx)), sum) : 0.0f;
        p[off + j] = from_f32<H>(e);
    }
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_forward_bf16(const float* s, bf16* p, u32 t, float scale, u64 rows) {
    causal_softmax_forward_half(s, p, t, scale, rows);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_forward_f16(const float* s, f16* p, u32 t, float scale, u64 rows) {
    causal_softmax_forward_half(s, p, t, scale, rows);
}

// Causal softmax backward, one warp per row: ds_j = scale * (p_j * (dp_j - sum_k p_k dp_k))
// for j <= i (k <= i), 0 above the diagonal. Written, not accumulated: f32, or its bf16
// rounding for a gradient only products read (the cast kernel's rounding).
template <typename D>
__device__ __forceinline__ void causal_softmax_backward_impl(const float* p, const float* dp,
                                                             D* ds, u32 t, float scale,
                                                             u64 rows) {
    u64 row = (u64)blockIdx.x * (NN_BLOCK / NN_WARP) + threadIdx.x / NN_WARP;
    if (row >= rows) return;
    u32 l = threadIdx.x % NN_WARP;
    u32 i = (u32)(row % t);
    u64 off = row * t;
    float acc = 0.0f;
    for (u32 j = l; j <= i; j += NN_WARP) acc = fa(acc, fm(p[off + j], dp[off + j]));
    float dot = warp_sum(acc);
    for (u32 j = l; j < t; j += NN_WARP) {
        store_c(ds, off + j, (j <= i) ? fm(scale, fm(p[off + j], fs(dp[off + j], dot))) : 0.0f);
    }
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_backward_f32(const float* p, const float* dp, float* ds, u32 t, float scale,
                                u64 rows) {
    causal_softmax_backward_impl(p, dp, ds, t, scale, rows);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_backward_bf16(const float* p, const float* dp, bf16* ds, u32 t, float scale,
                                 u64 rows) {
    causal_softmax_backward_impl(p, dp, ds, t, scale, rows);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    causal_softmax_backward_f16(const float* p, const float* dp, f16* ds, u32 t, float scale,
                                u64 rows) {
    causal_softmax_backward_impl(p, dp, ds, t, scale, rows);
}

// Cross-entropy with its backward, one block per row of logits [n, v]: loss[r] =
// ln(sum) + (max - logit[target]) with sum = sum_j e^(logit_j - max), and
// dlogits_j = dloss * (e^(logit_j - max) / sum - [j == target]). The mean over rows is the
// caller's (dloss = 1/N), times the step's loss scale s[STEP_SCALE] (rounded to f32) when a
// grad scaler passes its scalars `s` (else null). A target >= v gives a NaN loss and a NaN
// row of dlogits. dlogits
// may be logits itself (each element is read and then written by one thread, after every
// read of the row's reductions). dlogits is f32, or its bf16 rounding (the cast kernel's) for
// a gradient only products read.
template <typename D>
__device__ __forceinline__ void cross_entropy_fused_impl(const float* logits, const u32* targets,
                                                         float* losses, D* dlogits, u32 v,
                                                         float dloss, const double* s) {
    __shared__ float sh[NN_BLOCK];
    if (s != nullptr) dloss = fm(dloss, __double2float_rn(s[STEP_SCALE]));
    u64 off = (u64)blockIdx.x * v;
    u32 tg = targets[blockIdx.x];
    float mx = -pos_inf();
    for (u32 j = threadIdx.x; j < v; j += NN_BLOCK) mx = max_of(mx, logits[off + j]);
    mx = block_max(mx, sh);
    // The target's logit, read before block_sum's barriers: dlogits may be the logits' own
    // memory (cross_entropy_fused_in_place), written from the loop below on.
    bool ok = tg < v;
    float lt = (threadIdx.x == 0 && ok) ? logits[off + tg] : 0.0f;
    float acc = 0.0f;
    for (u32 j = threadIdx.x; j < v; j += NN_BLOCK) acc = fa(acc, nn_exp(fs(logits[off + j], mx)));
    float sum = block_sum(acc, sh);
    for (u32 j = threadIdx.x; j < v; j += NN_BLOCK) {
        float q = fdv(nn_exp(fs(logits[off + j], mx)), sum);
        float d = fm(dloss, fs(q, (j == tg) ? 1.0f : 0.0f));
        store_c(dlogits, off + j, ok ? d : nan_f32());
    }
    if (threadIdx.x == 0) {
        losses[blockIdx.x] = ok ? fa(nn_log(sum), fs(mx, lt)) : nan_f32();
    }
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    cross_entropy_fused_f32(const float* logits, const u32* targets, float* losses,
                            float* dlogits, u32 v, float dloss,
                            const double* s) {
    cross_entropy_fused_impl(logits, targets, losses, dlogits, v, dloss, s);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    cross_entropy_fused_bf16(const float* logits, const u32* targets, float* losses,
                             bf16* dlogits, u32 v, float dloss,
                             const double* s) {
    cross_entropy_fused_impl(logits, targets, losses, dlogits, v, dloss, s);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    cross_entropy_fused_f16(const float* logits, const u32* targets, float* losses,
                            f16* dlogits, u32 v, float dloss, const double* s) {
    cross_entropy_fused_impl(logits, targets, losses, dlogits, v, dloss, s);
}
