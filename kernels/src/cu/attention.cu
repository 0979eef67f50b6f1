// Fused causal self-attention (flash attention 2's algorithm) on tensor cores: q, k and v are
// the products' bf16 or f16 operands, [pairs, t, D] (one (sequence, head) pair after
// another), and no t x t matrix is ever stored. Twins: fsdp_kernels::host::attention, which
// give the formulas; these kernels agree with them within the rounding of f32 sums taken in
// another order (mma.sync's), not bitwise.
//
// Scores are taken in base 2: s2 = (q.k) * (scale * log2 e), so that the exponentials are
// exp2f. Forward keeps each row's lse2 = m + log2(sum_j 2^(s2_j - m)) for backward, which
// computes the probabilities again as 2^(s2 - lse2).
//
// Every kernel runs blocks of FA_WARPS warps over a tile of FA_TILE rows (16 rows a warp) of
// one pair; products are mma.sync.m16n8k16 with f32 accumulators, whose fragment layouts the
// PTX ISA fixes: in a warp, lane = 4 g + c (g = lane / 4, c = lane % 4) holds
//   A (16 x 16, row-major): a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..)
//   B (16 x 8, k x n):      b0 = (k = 2c..2c+1, n = g), b1 = (k = 2c+8..2c+9, n = g)
//   C (16 x 8, f32):        c0, c1 = (g, 2c..2c+1), c2, c3 = (g+8, 2c..2c+1)
// each 32-bit register holding two 16-bit values, the lower column (or k) in the low half. A
// C tile pair (n = 16 j .. 16 j + 15) is thus already the A fragment of the next product once
// rounded to 16 bits (flash attention's P and dS never leave the registers).
//
// Backward is deterministic: one kernel per key tile writes dk and dv, another per query tile
// writes dq (each computing P and dS again), with no atomic additions.

#define FA_TILE 64
#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * 32)
// Shared rows of 16-bit values, padded so that a warp's 32-bit fragment loads (rows g,
// columns 2c) fall in 32 different banks: D + 8 values a row (36 words for D = 64, 20 for
// D = 32), FA_TILE + 8 for the transposed tiles.
#define FA_LD(D) ((D) + 8)
#define FA_LDT (FA_TILE + 8)

__device__ __forceinline__ float fa_neg_inf() { return __uint_as_float(0xff800000u); }

// D = A.B + C for one warp (the fragments above). FA_MMA_EMULATED: the emulator of
// kernels/tests/emulate/ gives its own, from the same layouts, to run these kernels on a host.
#ifndef FA_MMA_EMULATED
template <typename H> __device__ __forceinline__ void fa_mma(float* c, const u32* a, u32 b0, u32 b1);
template <> __device__ __forceinline__ void fa_mma<bf16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void fa_mma<f16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Two f32 rounded to H (from_f32, nearest even) in one register, `lo` in the low half.
template <typename H> __device__ __forceinline__ u32 fa_pack(float lo, float hi) {
    return (u32)from_f32<H>(lo).bits | ((u32)from_f32<H>(hi).bits << 16);
}

__device__ __forceinline__ u32 fa_ld32(const u16* s, int i) { return *(const u32*)(s + i); }

struct __align__(16) fa_u16x8 { u32 a, b, c, d; };

// Rows r0 .. r0 + FA_TILE of src ([t, D] 16-bit values) into dst (FA_TILE rows of FA_LD(D)),
// zeros past row t. Every thread of the block takes part; the caller synchronises.
template <int D> __device__ __forceinline__ void fa_load(u16* dst, const u16* src, int r0, int t) {
    const int per_row = D / 8;
    for (int i = threadIdx.x; i < FA_TILE * per_row; i += FA_THREADS) {
        int r = i / per_row, c8 = i % per_row;
        fa_u16x8 v = {0u, 0u, 0u, 0u};
        if (r0 + r < t) v = *(const fa_u16x8*)(src + (u64)(r0 + r) * D + c8 * 8);
        *(fa_u16x8*)(dst + r * FA_LD(D) + c8 * 8) = v;
    }
}

// The same rows transposed: dst[d][r] (D rows of FA_LDT), zeros past row t.
template <int D> __device__ __forceinline__ void fa_load_t(u16* dst, const u16* src, int r0, int t) {
    const int per_row = D / 8;
    for (int i = threadIdx.x; i < FA_TILE * per_row; i += FA_THREADS) {
        int r = i / per_row, c8 = i % per_row;
        fa_u16x8 v = {0u, 0u, 0u, 0u};
        if (r0 + r < t) v = *(const fa_u16x8*)(src + (u64)(r0 + r) * D + c8 * 8);
        u32 w[4] = {v.a, v.b, v.c, v.d};
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            dst[(c8 * 8 + 2 * j) * FA_LDT + r] = (u16)(w[j] & 0xffffu);
            dst[(c8 * 8 + 2 * j + 1) * FA_LDT + r] = (u16)(w[j] >> 16);
        }
    }
}

// The A fragments of a warp's 16 rows (from row w0 of a FA_LD(D) tile) over all D columns.
template <int D>
__device__ __forceinline__ void fa_a_frags(u32 (*a)[4], const u16* s, int w0, int g, int c) {
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        a[kk][0] = fa_ld32(s, (w0 + g) * FA_LD(D) + kk * 16 + 2 * c);
        a[kk][1] = fa_ld32(s, (w0 + g + 8) * FA_LD(D) + kk * 16 + 2 * c);
        a[kk][2] = fa_ld32(s, (w0 + g) * FA_LD(D) + kk * 16 + 8 + 2 * c);
        a[kk][3] = fa_ld32(s, (w0 + g + 8) * FA_LD(D) + kk * 16 + 8 + 2 * c);
    }
}

// acc (16 x FA_TILE: 8 C tiles) = A (16 x D, fragments a) . rows(s)^T, s a FA_LD(D) tile
// whose FA_TILE rows are the columns of the result: q.k^T, k.q^T, dO.v^T, v.dO^T.
template <typename H, int D>
__device__ __forceinline__ void fa_times_rows_t(float (*acc)[4], const u32 (*a)[4], const u16* s,
                                                int g, int c) {
    #pragma unroll
    for (int n = 0; n < FA_TILE / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        #pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n) {
            u32 b0 = fa_ld32(s, (n * 8 + g) * FA_LD(D) + kk * 16 + 2 * c);
            u32 b1 = fa_ld32(s, (n * 8 + g) * FA_LD(D) + kk * 16 + 8 + 2 * c);
            fa_mma<H>(acc[n], a[kk], b0, b1);
        }
}

// out (16 x D: D / 8 C tiles) += P (16 x FA_TILE, the C tiles p rounded to H) . X, X a
// FA_TILE x D tile given transposed (st: D rows of FA_LDT): P.v, P^T.dO, dS.k, dS^T.q.
template <typename H, int D>
__device__ __forceinline__ void fa_acc_times(float (*out)[4], float (*p)[4], const u16* st, int g,
                                             int c) {
    #pragma unroll
    for (int kk = 0; kk < FA_TILE / 16; ++kk) {
        u32 a[4] = {fa_pack<H>(p[2 * kk][0], p[2 * kk][1]), fa_pack<H>(p[2 * kk][2], p[2 * kk][3]),
                    fa_pack<H>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                    fa_pack<H>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            u32 b0 = fa_ld32(st, (n * 8 + g) * FA_LDT + kk * 16 + 2 * c);
            u32 b1 = fa_ld32(st, (n * 8 + g) * FA_LDT + kk * 16 + 8 + 2 * c);
            fa_mma<H>(out[n], a, b0, b1);
        }
    }
}

// Writes a warp's 16 x D accumulators (times `mul[0]` for row g, `mul[1]` for row g + 8)
// into rows from `row0` of out ([t, D] f32), the rows before t.
template <int D>
__device__ __forceinline__ void fa_store(float* out, float (*acc)[4], int row0, int t,
                                         const float* mul, int g, int c) {
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r = row0 + g + (e >> 1) * 8;
            if (r < t) out[(u64)r * D + n * 8 + 2 * c + (e & 1)] = __fmul_rn(acc[n][e], mul[e >> 1]);
        }
}

// Quarter-warp (the 4 lanes of a row) reductions.
__device__ __forceinline__ float fa_row_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float fa_row_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Forward: y = softmax(q.k^T * scale, causal) . v, and lse2 of each row. One block per query
// tile (the longest rows first) and pair (blockIdx.y).
template <typename H, int D>
__device__ __forceinline__ void flash_forward(const u16* q, const u16* k, const u16* v, float* y,
                                              float* lse, int t, float scale2) {
    __shared__ __align__(16) u16 ks[FA_TILE * FA_LD(D)];
    __shared__ __align__(16) u16 vt[D * FA_LDT];
    const int tiles = (t + FA_TILE - 1) / FA_TILE;
    const int qt = tiles - 1 - (int)blockIdx.x;
    const u64 base = (u64)blockIdx.y * (u64)t * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int q0 = qt * FA_TILE, w0 = warp * 16;
    const int rows[2] = {q0 + w0 + g, q0 + w0 + g + 8};
    u32 qa[D / 16][4];
    fa_load<D>(ks, q + base, q0, t); // the query tile, through the keys' buffer
    __syncthreads();
    fa_a_frags<D>(qa, ks, w0, g, c);
    float o[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
    float m[2] = {fa_neg_inf(), fa_neg_inf()}, l[2] = {0.0f, 0.0f};
    for (int kt = 0; kt <= qt; ++kt) {
        __syncthreads();
        fa_load<D>(ks, k + base, kt * FA_TILE, t);
        fa_load_t<D>(vt, v + base, kt * FA_TILE, t);
        __syncthreads();
        float s[FA_TILE / 8][4];
        fa_times_rows_t<H, D>(s, qa, ks, g, c);
        float mx[2] = {fa_neg_inf(), fa_neg_inf()};
        #pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = kt * FA_TILE + n * 8 + 2 * c + (e & 1), r = rows[e >> 1];
                float x = (col <= r && col < t) ? __fmul_rn(s[n][e], scale2) : fa_neg_inf();
                s[n][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float base2[2];
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mn = fmaxf(m[i], fa_row_max(mx[i]));
            base2[i] = (mn == fa_neg_inf()) ? 0.0f : mn;
            float alpha = exp2f(__fsub_rn(m[i], base2[i]));
            l[i] = __fmul_rn(l[i], alpha);
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][2 * i] = __fmul_rn(o[n][2 * i], alpha);
                o[n][2 * i + 1] = __fmul_rn(o[n][2 * i + 1], alpha);
            }
            m[i] = mn;
        }
        #pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = exp2f(__fsub_rn(s[n][e], base2[e >> 1]));
                s[n][e] = p;
                l[e >> 1] = __fadd_rn(l[e >> 1], p);
            }
        fa_acc_times<H, D>(o, s, vt, g, c);
    }
    float inv[2];
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] = fa_row_sum(l[i]);
        inv[i] = __fdiv_rn(1.0f, l[i]);
    }
    fa_store<D>(y + base, o, q0 + w0, t, inv, g, c);
    if (c == 0)
        #pragma unroll
        for (int i = 0; i < 2; ++i)
            if (rows[i] < t) lse[(u64)blockIdx.y * t + rows[i]] = __fadd_rn(m[i], log2f(l[i]));
}

// Backward, first: dsum[pair, i] = sum_d dO[pair, i, d] * y[pair, i, d], with y forward's
// output as the projection's operand, token rows of `row` values (head h from column
// offset + h * D) of `heads` heads. One warp per row.
template <typename H, int D>
__device__ __forceinline__ void flash_backward_dot(const u16* dout, const u16* y, float* dsum,
                                                   u64 rows, int t, int heads, int row,
                                                   int offset) {
    u64 r = (u64)blockIdx.x * FA_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= rows) return;
    u64 pair = r / (u64)t, i = r % (u64)t;
    u64 b = pair / (u64)heads, h = pair % (u64)heads;
    const u16* yr = y + (b * (u64)t + i) * (u64)row + (u64)offset + h * D;
    const u16* dr = dout + r * D;
    float acc = 0.0f;
    for (int d = lane; d < D; d += 32) {
        H a, bb;
        a.bits = dr[d];
        bb.bits = yr[d];
        acc = __fadd_rn(acc, __fmul_rn(to_f32(a), to_f32(bb)));
    }
    for (int s = 16; s > 0; s /= 2) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, s));
    if (lane == 0) dsum[r] = acc;
}

// Backward, keys: dk and dv of one key tile (blockIdx.x, the longest columns first) of a pair
// (blockIdx.y), over the query tiles at and after it. A warp owns 16 keys and computes their
// transposed scores k.q^T, so that P^T and dS^T are its A fragments.
template <typename H, int D>
__device__ __forceinline__ void flash_backward_dkv(const u16* q, const u16* k, const u16* v,
                                                   const u16* dout, const float* lse,
                                                   const float* dsum, float* dk, float* dv, int t,
                                                   float scale, float scale2) {
    __shared__ __align__(16) u16 qs[FA_TILE * FA_LD(D)];
    __shared__ __align__(16) u16 qt_s[D * FA_LDT];
    __shared__ __align__(16) u16 ds_[FA_TILE * FA_LD(D)];
    __shared__ __align__(16) u16 dt_s[D * FA_LDT];
    __shared__ float ls[FA_TILE], dd[FA_TILE];
    const int tiles = (t + FA_TILE - 1) / FA_TILE;
    const int kt = (int)blockIdx.x;
    const u64 base = (u64)blockIdx.y * (u64)t * D;
    const float* lse_p = lse + (u64)blockIdx.y * t;
    const float* dsum_p = dsum + (u64)blockIdx.y * t;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int k0 = kt * FA_TILE, w0 = warp * 16;
    const int keys[2] = {k0 + w0 + g, k0 + w0 + g + 8};
    u32 ka[D / 16][4], va[D / 16][4];
    fa_load<D>(qs, k + base, k0, t);
    fa_load<D>(ds_, v + base, k0, t);
    __syncthreads();
    fa_a_frags<D>(ka, qs, w0, g, c);
    fa_a_frags<D>(va, ds_, w0, g, c);
    float gk[D / 8][4], gv[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) gk[n][e] = gv[n][e] = 0.0f;
    for (int it = kt; it < tiles; ++it) {
        const int q0 = it * FA_TILE;
        __syncthreads();
        fa_load<D>(qs, q + base, q0, t);
        fa_load_t<D>(qt_s, q + base, q0, t);
        fa_load<D>(ds_, dout + base, q0, t);
        fa_load_t<D>(dt_s, dout + base, q0, t);
        for (int i = threadIdx.x; i < FA_TILE; i += FA_THREADS) {
            ls[i] = (q0 + i < t) ? lse_p[q0 + i] : 0.0f;
            dd[i] = (q0 + i < t) ? dsum_p[q0 + i] : 0.0f;
        }
        __syncthreads();
        float p[FA_TILE / 8][4], dp[FA_TILE / 8][4];
        fa_times_rows_t<H, D>(p, ka, qs, g, c);
        #pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                int j = n * 8 + 2 * c + (e & 1), col = q0 + j, key = keys[e >> 1];
                p[n][e] = (col >= key && col < t)
                              ? exp2f(__fsub_rn(__fmul_rn(p[n][e], scale2), ls[j]))
                              : 0.0f;
            }
        fa_acc_times<H, D>(gv, p, dt_s, g, c);
        fa_times_rows_t<H, D>(dp, va, ds_, g, c);
        #pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                int j = n * 8 + 2 * c + (e & 1);
                dp[n][e] = __fmul_rn(__fmul_rn(p[n][e], __fsub_rn(dp[n][e], dd[j])), scale);
            }
        fa_acc_times<H, D>(gk, dp, qt_s, g, c);
    }
    const float one[2] = {1.0f, 1.0f};
    fa_store<D>(dk + base, gk, k0 + w0, t, one, g, c);
    fa_store<D>(dv + base, gv, k0 + w0, t, one, g, c);
}

// Backward, queries: dq of one query tile (the longest rows first) of a pair, over the key
// tiles at and before it.
template <typename H, int D>
__device__ __forceinline__ void flash_backward_dq(const u16* q, const u16* k, const u16* v,
                                                  const u16* dout, const float* lse,
                                                  const float* dsum, float* dq, int t, float scale,
                                                  float scale2) {
    __shared__ __align__(16) u16 ks[FA_TILE * FA_LD(D)];
    __shared__ __align__(16) u16 vs[FA_TILE * FA_LD(D)];
    __shared__ __align__(16) u16 kt_s[D * FA_LDT];
    const int tiles = (t + FA_TILE - 1) / FA_TILE;
    const int qt = tiles - 1 - (int)blockIdx.x;
    const u64 base = (u64)blockIdx.y * (u64)t * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int q0 = qt * FA_TILE, w0 = warp * 16;
    const int rows[2] = {q0 + w0 + g, q0 + w0 + g + 8};
    u32 qa[D / 16][4], da[D / 16][4];
    fa_load<D>(ks, q + base, q0, t);
    fa_load<D>(vs, dout + base, q0, t);
    __syncthreads();
    fa_a_frags<D>(qa, ks, w0, g, c);
    fa_a_frags<D>(da, vs, w0, g, c);
    float lr[2], dr[2];
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        bool in = rows[i] < t;
        lr[i] = in ? lse[(u64)blockIdx.y * t + rows[i]] : 0.0f;
        dr[i] = in ? dsum[(u64)blockIdx.y * t + rows[i]] : 0.0f;
    }
    float gq[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) gq[n][e] = 0.0f;
    for (int kt = 0; kt <= qt; ++kt) {
        const int k0 = kt * FA_TILE;
        __syncthreads();
        fa_load<D>(ks, k + base, k0, t);
        fa_load<D>(vs, v + base, k0, t);
        fa_load_t<D>(kt_s, k + base, k0, t);
        __syncthreads();
        float p[FA_TILE / 8][4], dp[FA_TILE / 8][4];
        fa_times_rows_t<H, D>(p, qa, ks, g, c);
        fa_times_rows_t<H, D>(dp, da, vs, g, c);
        #pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = k0 + n * 8 + 2 * c + (e & 1), i = e >> 1;
                float pe = (col <= rows[i] && col < t)
                               ? exp2f(__fsub_rn(__fmul_rn(p[n][e], scale2), lr[i]))
                               : 0.0f;
                dp[n][e] = __fmul_rn(__fmul_rn(pe, __fsub_rn(dp[n][e], dr[i])), scale);
            }
        fa_acc_times<H, D>(gq, dp, kt_s, g, c);
    }
    const float one[2] = {1.0f, 1.0f};
    fa_store<D>(dq + base, gq, q0 + w0, t, one, g, c);
}

#define FLASH(H, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_forward_##H##_d##D(           \
        const u16* q, const u16* k, const u16* v, float* y, float* lse, int t, float scale2) {  \
        flash_forward<H, D>(q, k, v, y, lse, t, scale2);                                         \
    }                                                                                            \
    extern "C" __global__ void flash_backward_dot_##H##_d##D(const u16* dout, const u16* y,      \
                                                             float* dsum, u64 rows, int t,      \
                                                             int heads, int row, int offset) {  \
        flash_backward_dot<H, D>(dout, y, dsum, rows, t, heads, row, offset);                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_backward_dkv_##H##_d##D(      \
        const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,            \
        const float* dsum, float* dk, float* dv, int t, float scale, float scale2) {            \
        flash_backward_dkv<H, D>(q, k, v, dout, lse, dsum, dk, dv, t, scale, scale2);            \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_backward_dq_##H##_d##D(       \
        const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,            \
        const float* dsum, float* dq, int t, float scale, float scale2) {                       \
        flash_backward_dq<H, D>(q, k, v, dout, lse, dsum, dq, t, scale, scale2);                 \
    }

// Heads of 32 and 64 values (GPT-2's heads are 64 at every size).
FLASH(bf16, 32)
FLASH(f16, 32)
FLASH(bf16, 64)
FLASH(f16, 64)
