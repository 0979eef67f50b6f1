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

// f32 -> bf16 four elements a thread: one 16-byte load and one 8-byte store each (the scalar
// kernel's 2-byte stores and 4-byte loads reach about half the copy bandwidth), the same
// rounding as cast_f32_bf16. `src` must be 16-byte and `dst` 8-byte aligned; `groups` = n / 4,
// the launcher casts the last n % 4 elements with cast_f32_bf16.
struct __align__(16) f32x4 { float x, y, z, w; };
struct __align__(8) u32x2 { u32 lo, hi; };

extern "C" __global__ void cast_f32_bf16_x4(const f32x4* src, u32x2* dst, u64 groups) {
    GRID_STRIDE(i, groups) {
        f32x4 v = src[i];
        u32x2 o;
        o.lo = (u32)from_f32<bf16>(v.x).bits | ((u32)from_f32<bf16>(v.y).bits << 16);
        o.hi = (u32)from_f32<bf16>(v.z).bits | ((u32)from_f32<bf16>(v.w).bits << 16);
        dst[i] = o;
    }
}
