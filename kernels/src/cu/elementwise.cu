// Scale and add (axpby) and memset.

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

// Fill with a bit pattern of 2, 4 or 8 bytes.
#define MEMSET(W, U) \
    extern "C" __global__ void memset_b##W(U* dst, U value, u64 n) { \
        GRID_STRIDE(i, n) { dst[i] = value; } \
    }

MEMSET(16, u16)
MEMSET(32, u32)
MEMSET(64, u64)
