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
// The program is this file followed by nn_softmax.cu and nn_embed_heads.cu (programs.rs joins
// them in that order): here the definitions they share (constants, the rounded arithmetic, the
// scalar functions and the block and warp reductions), the layer norm and GELU.

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
