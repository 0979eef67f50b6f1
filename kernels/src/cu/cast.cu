// Casts between f32, bf16 and f16 (round to nearest even).

template <typename S, typename D>
__device__ __forceinline__ void cast_impl(const S* src, D* dst, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = from_f32<D>(to_f32(src[i])); }
}

#define CAST(S, D) \
    extern "C" __global__ void cast_##S##_##D(const S* src, D* dst, u64 n) { \
        cast_impl<S, D>(src, dst, n); \
    }

typedef float f32;
CAST(f32, bf16)
CAST(f32, f16)
CAST(bf16, f32)
CAST(f16, f32)
CAST(bf16, f16)
CAST(f16, bf16)
