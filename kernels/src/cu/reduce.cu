// The reductions of the ring: dst[i] = acc[i] (op) x[i], then, when finish_n > 0 (the last
// step of an average), divided by finish_n. `dst` may be `x` (in place).

#define REDUCE(NAME, T, EXPR) \
    extern "C" __global__ void reduce_##NAME##_##T(T* dst, const T* acc, const T* x, u64 n, \
                                                   u32 finish_n) { \
        GRID_STRIDE(i, n) { \
            auto a = load_c(acc, i); \
            auto b = load_c(x, i); \
            auto v = (EXPR); \
            if (finish_n > 0u) { \
                v = op_div_count(round_as(acc, v), finish_n); \
            } \
            store_c(dst, i, v); \
        } \
    }

#define REDUCE_ALL(T) \
    REDUCE(sum, T, op_add(a, b)) \
    REDUCE(min, T, op_min(a, b)) \
    REDUCE(max, T, op_max(a, b)) \
    REDUCE(prod, T, op_mul(a, b))

typedef float f32;
typedef double f64;
REDUCE_ALL(f32)
REDUCE_ALL(f64)
REDUCE_ALL(bf16)
REDUCE_ALL(f16)
