// The GPT's layers besides matrix products, f32: layer norm, exact GELU, causal softmax,
// cross-entropy fused with its backward, embeddings and the bias gradient. Every result is
// bitwise equal to the host twin (fsdp_kernels::host::nn): e^x, ln x and erfc are the
// functions below (IEEE additions, products and divisions only, no library call), every
// operation is spelled with its rounding, and every reduction has a fixed order:
// - a row reduction runs in one block of NN_BLOCK threads: thread t folds elements
//   t, t + NN_BLOCK, ... in order, then a shared-memory tree halves the NN_BLOCK partials;
//   the causal softmax's rows run in one warp each (NN_BLOCK / NN_WARP rows a block), the
//   same with NN_WARP lanes and a butterfly of shuffles, whose lane 0 combines as the tree;
// - a column reduction (the layer norm's and the biases' parameter gradients) runs in blocks
//   of 32 columns × NN_COL_GROUPS row groups, one block per tile of 32 columns and chunk of
//   NN_COL_CHUNK rows (blockIdx.y): thread (j, g) folds the chunk's rows g, g + NN_COL_GROUPS,
//   ... of column j in order from zero, the group partials are folded in order from zero into
//   the chunk's sum (written to a scratch row of the chunk), then column_chunks_add_f32 adds
//   the chunk sums in order to the gradient's current value (accumulation).
// The layers whose output only matrix products read (layer norm, GELU, the heads'
// permutations, the softmax forward and backward, the cross-entropy's gradient) also have a
// `_bf16` and an `_f16` kernel that store the f32 result rounded to bf16 or f16 as the cast
// kernel does (from_f32): the bits of the f32 kernel followed by a cast.

#define NN_BLOCK 256
#define NN_WARP 32
#define NN_COL_GROUPS 32
#define NN_COL_CHUNK 256

__device__ __forceinline__ float fa(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fs(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float fm(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fdv(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float pos_inf() { return __uint_as_float(0x7f800000u); }
__device__ __forceinline__ float nan_f32() { return __uint_as_float(0x7fc00000u); }
// 2^k for k in [-126, 127].
__device__ __forceinline__ float pow2i(int k) { return __uint_as_float((u32)(k + 127) << 23); }
__device__ __forceinline__ float max_of(float a, float b) { return (b > a) ? b : a; }

#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define LOG2E 1.44269504088896341f
#define ROUND_MAGIC 12582912.0f

// e^x: k = round(x / ln 2), r = x - k ln 2 (two-part ln 2), a degree-7 Taylor polynomial
// on |r| <= 0.35 (relative error below 4e-7), times 2^k in two exact steps.
__device__ float nn_exp(float x) {
    if (x != x) return x;
    if (x > 88.72283f) return pos_inf();
    if (x < -103.97208f) return 0.0f;
    float kf = fs(fa(fm(x, LOG2E), ROUND_MAGIC), ROUND_MAGIC);
    float r = fs(fs(x, fm(kf, LN2_HI)), fm(kf, LN2_LO));
    float p = 1.98412698e-4f; // 1/7!
    p = fa(fm(p, r), 1.38888889e-3f);
    p = fa(fm(p, r), 8.33333333e-3f);
    p = fa(fm(p, r), 4.16666667e-2f);
    p = fa(fm(p, r), 1.66666667e-1f);
    p = fa(fm(p, r), 0.5f);
    p = fa(fm(p, r), 1.0f);
    p = fa(fm(p, r), 1.0f);
    int k = (int)kf;
    int k1 = k / 2;
    return fm(fm(p, pow2i(k1)), pow2i(k - k1));
}

// ln x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s), s = (m-1)/(m+1), by its
// series to s^9 (|s| <= 0.172: error below 1e-9).
__device__ float nn_log(float x) {
    if (x != x) return x;
    if (x < 0.0f) return nan_f32();
    if (x == 0.0f) return -pos_inf();
    if (x == pos_inf()) return x;
    int e = 0;
    if (x < 1.17549435e-38f) { // subnormal: scale into the normal range (exact)
        x = fm(x, 8388608.0f);
        e = -23;
    }
    u32 u = __float_as_uint(x);
    e += (int)((u >> 23) & 0xffu) - 127;
    float m = __uint_as_float((u & 0x7fffffu) | 0x3f800000u);
    if (m > 1.41421356f) {
        m = fm(m, 0.5f);
        e += 1;
    }
    float s = fdv(fs(m, 1.0f), fa(m, 1.0f));
    float s2 = fm(s, s);
    float p = 0.222222222f; // 2/9
    p = fa(fm(p, s2), 0.285714286f);
    p = fa(fm(p, s2), 0.4f);
    p = fa(fm(p, s2), 0.666666667f);
    p = fa(fm(p, s2), 2.0f);
    float ef = (float)e;
    return fa(fm(ef, LN2_HI), fa(fm(ef, LN2_LO), fm(p, s)));
}

// erfc(z) for z >= 0: the Chebyshev fit t e^(-z^2 + P(t)), t = 1/(1 + z/2) (Numerical
// Recipes' erfcc; relative error below 1.2e-7 before f32 rounding).
__device__ float nn_erfc(float z) {
    float t = fdv(1.0f, fa(1.0f, fm(0.5f, z)));
    float p = 0.17087277f;
    p = fa(fm(p, t), -0.82215223f);
    p = fa(fm(p, t), 1.48851587f);
    p = fa(fm(p, t), -1.13520398f);
    p = fa(fm(p, t), 0.27886807f);
    p = fa(fm(p, t), -0.18628806f);
    p = fa(fm(p, t), 0.09678418f);
    p = fa(fm(p, t), 0.37409196f);
    p = fa(fm(p, t), 1.00002368f);
    p = fa(fm(p, t), -1.26551223f);
    return fm(t, nn_exp(fa(-fm(z, z), p)));
}

// The standard normal CDF, Phi(x) = erfc(-x / sqrt 2) / 2.
__device__ float nn_cdf(float x) {
    float h = fm(0.5f, nn_erfc(fm(fabsf(x), 0.707106781f)));
    return (x < 0.0f) ? h : fs(1.0f, h);
}

// The standard normal density, e^(-x^2/2) / sqrt(2 pi).
__device__ float nn_pdf(float x) { return fm(nn_exp(fm(-0.5f, fm(x, x))), 0.398942280f); }

// The block's sum (or maximum) of one value per thread, by the fixed tree; every thread gets it.
__device__ float block_sum(float v, float* sh) {
    u32 t = threadIdx.x;
    sh[t] = v;
    for (u32 s = NN_BLOCK / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (t < s) sh[t] = fa(sh[t], sh[t + s]);
    }
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* sh) {
    u32 t = threadIdx.x;
    sh[t] = v;
    for (u32 s = NN_BLOCK / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (t < s) sh[t] = max_of(sh[t], sh[t + s]);
    }
    __syncthreads();
    float r = sh[0];
    __syncthreads();
    return r;
}

// The warp's butterfly: after the steps k = 16, 8, 4, 2, 1, lane 0 holds what the tree over
// the lanes' partials gives (lane t < k combines with lane t + k), and every lane returns it.
__device__ __forceinline__ float warp_sum(float v) {
    for (u32 k = NN_WARP / 2; k > 0; k >>= 1) v = fa(v, __shfl_xor_sync(0xffffffffu, v, k));
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ float warp_max(float v) {
    for (u32 k = NN_WARP / 2; k > 0; k >>= 1) v = max_of(v, __shfl_xor_sync(0xffffffffu, v, k));
    return __shfl_sync(0xffffffffu, v, 0);
}

// Layer norm forward, one block per row of x [n, c]: mean = sum / c, var = sum((x-mean)^2) / c
// (biased), rstd = 1 / sqrt(var + eps), y = ((x - mean) * rstd) * w + b.
// y is f32, or its bf16 rounding (the cast kernel's) for an output only products read.
template <typename D>
__device__ __forceinline__ void layernorm_forward_impl(const float* x, const float* w,
                                                       const float* b, D* y, float* mean,
                                                       float* rstd, u32 c, float eps) {
    __shared__ float sh[NN_BLOCK];
    const float* xr = x + (u64)blockIdx.x * c;
    D* yr = y + (u64)blockIdx.x * c;
    float acc = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += NN_BLOCK) acc = fa(acc, xr[i]);
    float m = fdv(block_sum(acc, sh), (float)c);
    acc = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += NN_BLOCK) {
        float d = fs(xr[i], m);
        acc = fa(acc, fm(d, d));
    }
    float var = fdv(block_sum(acc, sh), (float)c);
    float rs = fdv(1.0f, __fsqrt_rn(fa(var, eps)));
    for (u32 i = threadIdx.x; i < c; i += NN_BLOCK) {
        store_c(yr, i, fa(fm(fm(fs(xr[i], m), rs), w[i]), b[i]));
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = m;
        rstd[blockIdx.x] = rs;
    }
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    layernorm_forward_f32(const float* x, const float* w, const float* b, float* y,
                          float* mean, float* rstd, u32 c, float eps) {
    layernorm_forward_impl(x, w, b, y, mean, rstd, c, eps);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    layernorm_forward_bf16(const float* x, const float* w, const float* b, bf16* y,
                           float* mean, float* rstd, u32 c, float eps) {
    layernorm_forward_impl(x, w, b, y, mean, rstd, c, eps);
}

extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    layernorm_forward_f16(const float* x, const float* w, const float* b, f16* y, float* mean,
                          float* rstd, u32 c, float eps) {
    layernorm_forward_impl(x, w, b, y, mean, rstd, c, eps);
}

// Layer norm backward, input part, one block per row: with g = dy * w and xh = (x-mean)*rstd,
// dx += rstd * ((g - sum(g)/c) - xh * (sum(g * xh)/c)).
extern "C" __global__ void __launch_bounds__(NN_BLOCK)
    layernorm_backward_input_f32(const float* dy, const float* x, const float* w,
                                 const float* mean, const float* rstd, float* dx, u32 c) {
    __shared__ float sh[NN_BLOCK];
    u64 off = (u64)blockIdx.x * c;
    float m = mean[blockIdx.x], rs = rstd[blockIdx.x];
    float sg = 0.0f, sgx = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += NN_BLOCK) {
        float g = fm(dy[off + i], w[i]);
        sg = fa(sg, g);
        sgx = fa(sgx, fm(g, fm(fs(x[off + i], m), rs)));
    }
    float mg = fdv(block_sum(sg, sh), (float)c);
    float mgx = fdv(block_sum(sgx, sh), (float)c);
    for (u32 i = threadIdx.x; i < c; i += NN_BLOCK) {
        float g = fm(dy[off + i], w[i]);
        float xh = fm(fs(x[off + i], m), rs);
        dx[off + i] = fa(dx[off + i], fm(rs, fs(fs(g, mg), fm(xh, mgx))));
    }
}

// Layer norm backward, parameter part: the chunk sums of (dy * (x - mean)) * rstd into
// pw[chunk, j] and of dy into pb[chunk, j], a column reduction (see the top of this file);
// column_chunks_add_f32 adds them to dw and db. Block (32, NN_COL_GROUPS), grid (tiles of 32
// columns; chunks), both grid-stride.
extern "C" __global__ void __launch_bounds__(32 * NN_COL_GROUPS)
    layernorm_backward_params_f32(const float* dy, const float* x, const float* mean,
                                  const float* rstd, float* pw, float* pb, u32 n, u32 c) {
    __shared__ float shw[NN_COL_GROUPS][33];
    __shared__ float shb[NN_COL_GROUPS][33];
    u32 l = threadIdx.x, g = threadIdx.y;
    for (u32 chunk = blockIdx.y; (u64)chunk * NN_COL_CHUNK < n; chunk += gridDim.y) {
        u32 r0 = chunk * NN_COL_CHUNK;
        u32 r1 = ((u64)n < (u64)r0 + NN_COL_CHUNK) ? n : r0 + NN_COL_CHUNK;
        for (u32 tile = blockIdx.x; (u64)tile * 32 < c; tile += gridDim.x) {
            u32 j = tile * 32 + l;
            float aw = 0.0f, ab = 0.0f;
            if (j < c) {
#pragma unroll 8
                for (u32 r = r0 + g; r < r1; r += NN_COL_GROUPS) {
                    u64 k = (u64)r * c + j;
                    float d = dy[k];
                    aw = fa(aw, fm(fm(d, fs(x[k], mean[r])), rstd[r]));
                    ab = fa(ab, d);
                }
            }
            shw[g][l] = aw;
            shb[g][l] = ab;
            __syncthreads();
            if (g == 0 && j < c) {
                float tw = 0.0f, tb = 0.0f;
                for (u32 q = 0; q < NN_COL_GROUPS; q++) {
                    tw = fa(tw, shw[q][l]);
                    tb = fa(tb, shb[q][l]);
                }
                u64 o = (u64)chunk * c + j;
                pw[o] = tw;
                pb[o] = tb;
            }
            __syncthreads();
        }
    }
}

// The last step of a column reduction: acc[j] += part[0, j], part[1, j], ... in chunk order.
extern "C" __global__ void column_chunks_add_f32(const float* part, float* acc, u32 chunks,
                                                  u32 c) {
    GRID_STRIDE(j, c) {
        float t = acc[j];
        for (u32 q = 0; q < chunks; q++) t = fa(t, part[(u64)q * c + j]);
        acc[j] = t;
    }
}

// Exact GELU: y = x * Phi(x); y f32, or its bf16 rounding.
extern "C" __global__ void gelu_forward_f32(const float* x, float* y, u64 n) {
    GRID_STRIDE(i, n) { y[i] = fm(x[i], nn_cdf(x[i])); }
}

extern "C" __global__ void gelu_forward_bf16(const float* x, bf16* y, u64 n) {
    GRID_STRIDE(i, n) { y[i] = from_f32<bf16>(fm(x[i], nn_cdf(x[i]))); }
}

extern "C" __global__ void gelu_forward_f16(const float* x, f16* y, u64 n) {
    GRID_STRIDE(i, n) { y[i] = from_f32<f16>(fm(x[i], nn_cdf(x[i]))); }
}

// GELU backward (written, not accumulated): dx = dy * (Phi(x) + x * phi(x)).
extern "C" __global__ void gelu_backward_f32(const float* x, const float* dy, float* dx, u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        dx[i] = fm(dy[i], fa(nn_cdf(v), fm(v, nn_pdf(v))));
    }
}

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

// Embedding forward: x[r, j] = wte[ids[r], j] + wpe[r % t, j]; an id >= vocab gives NaN.
extern "C" __global__ void embedding_forward_f32(const u32* ids, const float* wte,
                                                 const float* wpe, float* x, u64 n, u32 c,
                                                 u32 t, u32 vocab) {
    GRID_STRIDE(k, n * c) {
        u64 r = k / c;
        u32 j = (u32)(k % c);
        u32 id = ids[r];
        float pos = wpe[(r % t) * c + j];
        x[k] = (id < vocab) ? fa(wte[(u64)id * c + j], pos) : nan_f32();
    }
}

// Token embedding backward, one thread per (vocabulary row, column), tokens in order:
// dwte[v, j] += dx[r, j] for each r with ids[r] == v, one token at a time (O(vocab * n) id
// reads: deterministic without atomics or a sort; ids >= vocab add nowhere).
extern "C" __global__ void embedding_backward_tokens_f32(const u32* ids, const float* dx,
                                                         float* dwte, u32 n, u32 c, u32 vocab) {
    GRID_STRIDE(k, (u64)vocab * c) {
        u32 v = (u32)(k / c);
        u32 j = (u32)(k % c);
        float acc = dwte[k];
        for (u32 r = 0; r < n; r++) {
            if (ids[r] == v) acc = fa(acc, dx[(u64)r * c + j]);
        }
        dwte[k] = acc;
    }
}

// Token embedding backward from the tokens grouped by id on the host (CSR: the k-th distinct
// id is ids[k], its tokens in order are tokens[offsets[k] .. offsets[k + 1]]), one thread per
// (distinct id, column): the same additions in the same order as the kernel above, in
// O(n * c) work.
extern "C" __global__ void embedding_backward_tokens_grouped_f32(
    const u32* ids, const u32* offsets, const u32* tokens, const float* dx, float* dwte,
    u32 distinct, u32 c) {
    GRID_STRIDE(k, (u64)distinct * c) {
        u32 u = (u32)(k / c);
        u32 j = (u32)(k % c);
        u64 at = (u64)ids[u] * c + j;
        float acc = dwte[at];
        for (u32 q = offsets[u]; q < offsets[u + 1]; q++) {
            acc = fa(acc, dx[(u64)tokens[q] * c + j]);
        }
        dwte[at] = acc;
    }
}

// Position embedding backward, one thread per (position, column), rows in order:
// dwpe[p, j] += dx[r, j] for r = p, p + t, p + 2t, ... < n.
extern "C" __global__ void embedding_backward_positions_f32(const float* dx, float* dwpe,
                                                            u32 n, u32 c, u32 t) {
    GRID_STRIDE(k, (u64)t * c) {
        u32 p = (u32)(k / c);
        u32 j = (u32)(k % c);
        float acc = dwpe[k];
        for (u32 r = p; r < n; r += t) acc = fa(acc, dx[(u64)r * c + j]);
        dwpe[k] = acc;
    }
}

// Bias gradient: the chunk sums of dy[r, j] over the rows into part[chunk, j], a column
// reduction (see the top of this file); column_chunks_add_f32 adds them to db. Block
// (32, NN_COL_GROUPS), grid (tiles of 32 columns; chunks), both grid-stride.
extern "C" __global__ void __launch_bounds__(32 * NN_COL_GROUPS)
    bias_grad_f32(const float* dy, float* part, u32 n, u32 c) {
    __shared__ float sh[NN_COL_GROUPS][33];
    u32 l = threadIdx.x, g = threadIdx.y;
    for (u32 chunk = blockIdx.y; (u64)chunk * NN_COL_CHUNK < n; chunk += gridDim.y) {
        u32 r0 = chunk * NN_COL_CHUNK;
        u32 r1 = ((u64)n < (u64)r0 + NN_COL_CHUNK) ? n : r0 + NN_COL_CHUNK;
        for (u32 tile = blockIdx.x; (u64)tile * 32 < c; tile += gridDim.x) {
            u32 j = tile * 32 + l;
            float acc = 0.0f;
            if (j < c) {
#pragma unroll 8
                for (u32 r = r0 + g; r < r1; r += NN_COL_GROUPS) acc = fa(acc, dy[(u64)r * c + j]);
            }
            sh[g][l] = acc;
            __syncthreads();
            if (g == 0 && j < c) {
                float t = 0.0f;
                for (u32 q = 0; q < NN_COL_GROUPS; q++) t = fa(t, sh[q][l]);
                part[(u64)chunk * c + j] = t;
            }
            __syncthreads();
        }
    }
}

// Bias add over rows: y[r, j] = y[r, j] + b[j] for y [n, c] (a Linear layer's bias after its
// product).
extern "C" __global__ void bias_add_f32(float* y, const float* b, u64 n, u32 c) {
    GRID_STRIDE(k, n) { y[k] = fa(y[k], b[(u32)(k % c)]); }
}

// Attention heads out of token rows: dst [b, h, t, d] from src rows [b·t, row], head hh of
// token (bi, ti) being src[(bi·t + ti)·row + offset + hh·d .. + d] (q, k or v of
// qkv [b, t, 3, h, d] with row = 3·h·d and offset 0, h·d or 2·h·d; [b, t, h, d] with
// row = h·d, offset 0). A copy: exact (into bf16: rounded as the cast kernel rounds).
// Where element k of the dense heads [b, h, t, d] lies in token rows [b·t, row] whose first
// head starts at column `offset` (host twin: HeadsLayout::at).
__device__ __forceinline__ u64 heads_row_at(u64 k, u32 t, u32 h, u32 d, u32 row, u32 offset) {
    u32 di = (u32)(k % d);
    u64 r = k / d;
    u32 ti = (u32)(r % t);
    r /= t;
    u32 hh = (u32)(r % h);
    u64 bi = r / h;
    return (bi * t + ti) * row + offset + (u64)hh * d + di;
}

template <typename D>
__device__ __forceinline__ void heads_split_impl(const float* src, D* dst, u32 b, u32 t, u32 h,
                                                 u32 d, u32 row, u32 offset) {
    GRID_STRIDE(k, (u64)b * h * t * d) {
        store_c(dst, k, src[heads_row_at(k, t, h, d, row, offset)]);
    }
}

extern "C" __global__ void heads_split_f32(const float* src, float* dst, u32 b, u32 t, u32 h,
                                           u32 d, u32 row, u32 offset) {
    heads_split_impl(src, dst, b, t, h, d, row, offset);
}

extern "C" __global__ void heads_split_bf16(const float* src, bf16* dst, u32 b, u32 t, u32 h,
                                            u32 d, u32 row, u32 offset) {
    heads_split_impl(src, dst, b, t, h, d, row, offset);
}

extern "C" __global__ void heads_split_f16(const float* src, f16* dst, u32 b, u32 t, u32 h,
                                           u32 d, u32 row, u32 offset) {
    heads_split_impl(src, dst, b, t, h, d, row, offset);
}

// The inverse of heads_split_f32: dst rows [b·t, row] get src [b, h, t, d] at the same places
// (the other columns of dst are untouched). A copy: exact (into bf16: rounded).
template <typename D>
__device__ __forceinline__ void heads_merge_impl(const float* src, D* dst, u32 b, u32 t, u32 h,
                                                 u32 d, u32 row, u32 offset) {
    GRID_STRIDE(k, (u64)b * h * t * d) {
        store_c(dst, heads_row_at(k, t, h, d, row, offset), src[k]);
    }
}

extern "C" __global__ void heads_merge_f32(const float* src, float* dst, u32 b, u32 t, u32 h,
                                           u32 d, u32 row, u32 offset) {
    heads_merge_impl(src, dst, b, t, h, d, row, offset);
}

extern "C" __global__ void heads_merge_bf16(const float* src, bf16* dst, u32 b, u32 t, u32 h,
                                            u32 d, u32 row, u32 offset) {
    heads_merge_impl(src, dst, b, t, h, d, row, offset);
}

extern "C" __global__ void heads_merge_f16(const float* src, f16* dst, u32 b, u32 t, u32 h,
                                           u32 d, u32 row, u32 offset) {
    heads_merge_impl(src, dst, b, t, h, d, row, offset);
}
