// Part of the nn program (after nn_softmax.cu; programs.rs joins them): the layers that index
// rather than compute — the embeddings forward and backward, the bias gradient and bias add,
// and the attention heads' split out of and merge into token rows.

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
// reduction (see the top of nn.cu); column_chunks_add_f32 (nn.cu) adds them to db. Block
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
