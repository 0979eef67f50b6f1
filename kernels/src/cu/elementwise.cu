// Scale and add (axpby), division by a scalar, scaling by a scalar on the device, memset, many copies in one launch (gather_segments) and many buffers
// zeroed in one (zero_segments).

// y = alpha * x + beta * y, each product and the sum rounded separately (no fused multiply-add).
#define AXPBY(T, C) \
    extern "C" __global__ void axpby_##T(C alpha, const T* x, C beta, T* y, u64 n) { \
        GRID_STRIDE(i, n) { \
            store_c(y, i, op_add(op_mul(alpha, load_c(x, i)), op_mul(beta, load_c(y, i)))); \
        } \
    }

typedef float f32;
typedef double f64;
AXPBY(f32, float)
AXPBY(f64, double)
AXPBY(bf16, float)
AXPBY(f16, float)

// y = y / d, the quotient rounded (IEEE division, round to nearest even) then stored as T.
#define DIV_SCALAR(T, C, DIV) \
    extern "C" __global__ void div_scalar_##T(C d, T* y, u64 n) { \
        GRID_STRIDE(i, n) { store_c(y, i, DIV(load_c(y, i), d)); } \
    }

DIV_SCALAR(f32, float, __fdiv_rn)
DIV_SCALAR(f64, double, __ddiv_rn)
DIV_SCALAR(bf16, float, __fdiv_rn)
DIV_SCALAR(f16, float, __fdiv_rn)

// x = x * c[0] (the coefficient, computed on the device, rounded to f32; each product rounded
// once), nothing when it is 1: clipping by a coefficient the host never reads.
extern "C" __global__ void scale_by_f32(float* x, const double* c, u64 n) {
    float f = __double2float_rn(c[0]);
    if (f == 1.0f) return;
    GRID_STRIDE(i, n) { x[i] = __fmul_rn(x[i], f); }
}

// x *= 1 / scale[0], the quotient taken in f64 and rounded to f32 (a grad scaler's inv_scale;
// nothing when it is 1): the unscaling of gradients by a scale kept on the device (twin:
// host::unscale_by).
extern "C" __global__ void unscale_by_f32(float* x, const double* scale, u64 n) {
    float f = __double2float_rn(__ddiv_rn(1.0, scale[0]));
    if (f == 1.0f) return;
    GRID_STRIDE(i, n) { x[i] = __fmul_rn(x[i], f); }
}

// Fill with a bit pattern of 2, 4 or 8 bytes.
#define MEMSET(W, U) \
    extern "C" __global__ void memset_b##W(U* dst, U value, u64 n) { \
        GRID_STRIDE(i, n) { dst[i] = value; } \
    }

MEMSET(16, u16)
MEMSET(32, u32)
MEMSET(64, u64)

// Many copies into f32 memory in one launch (a gather of peers' shards): segment k copies n[k]
// elements from src[k] — f32, or bf16 widened exactly when widen[k] — to dst[k]. blockIdx.y is
// the segment; the blocks along x stride over its elements. The segments come by value (the
// kernel's parameters, as PyTorch's multi_tensor_apply passes its tensor lists).
#define GATHER_SEGMENTS 96 // launch::GATHER_SEGMENTS
struct GatherSegments {
    u64 src[GATHER_SEGMENTS];
    u64 dst[GATHER_SEGMENTS];
    u64 n[GATHER_SEGMENTS];
    u32 widen[GATHER_SEGMENTS];
};

extern "C" __global__ void gather_segments(GatherSegments g, u32 count) {
    u32 k = blockIdx.y;
    if (k >= count) return;
    u64 n = g.n[k];
    float* d = (float*)g.dst[k];
    u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 step = (u64)gridDim.x * blockDim.x;
    if (g.widen[k]) {
        const bf16* s = (const bf16*)g.src[k];
        for (u64 i = first; i < n; i += step) d[i] = to_f32(s[i]);
    } else {
        const float* s = (const float*)g.src[k];
        for (u64 i = first; i < n; i += step) d[i] = s[i];
    }
}

// Many f32 buffers set to +0 in one launch (the gradients at the start of a backward):
// blockIdx.y is the buffer, whose n[k] elements the blocks along x stride over.
#define ZERO_SEGMENTS 96
struct ZeroSegments {
    u64 dst[ZERO_SEGMENTS];
    u64 n[ZERO_SEGMENTS];
};

extern "C" __global__ void zero_segments(ZeroSegments z, u32 count) {
    u32 k = blockIdx.y;
    if (k >= count) return;
    float* d = (float*)z.dst[k];
    u64 n = z.n[k];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        d[i] = 0.0f;
    }
}
