// Shared by every program of fsdp-kernels: element types, conversions and the grid-stride loop.
// Compiled by NVRTC with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true, and every
// operation whose result is compared bitwise with the host twin spells its rounding (`_rn`).
// The wheel's NVRTC has no cuda_fp16.h / cuda_bf16.h: 16-bit floats are stored as raw bits
// and converted by the functions below (round to nearest even, as the host twin).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

// The NaN the host produces for min/max of a NaN (Rust's f32::NAN).
__device__ __forceinline__ float canonical_nan_f32() { return __uint_as_float(0x7fc00000u); }
__device__ __forceinline__ double canonical_nan_f64() {
    return __longlong_as_double(0x7ff8000000000000ll);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(((u32)v.bits) << 16); }
__device__ __forceinline__ float to_f32(f16 v) {
    u32 sign = ((u32)(v.bits & 0x8000u)) << 16;
    u32 exp = (v.bits >> 10) & 0x1fu;
    u32 man = v.bits & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0u) {
        // man * 2^-24: exact in f32 (a normal number, or zero).
        float mag = __fmul_rn((float)man, 5.9604644775390625e-8f);
        return __uint_as_float(sign | __float_as_uint(mag));
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round `q` (the kept bits) by the dropped `rem` of `shift` bits: nearest, ties to even.
__device__ __forceinline__ u32 round_kept(u32 q, u32 rem, u32 shift) {
    u32 half = 1u << (shift - 1u);
    return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) {
    u32 x = __float_as_uint(v);
    bf16 r;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (u16)((x >> 16) | 0x0040u); // NaN: keep the payload's top, make it quiet
    } else {
        r.bits = (u16)round_kept(x >> 16, x & 0xffffu, 16u); // a carry rounds up to infinity
    }
    return r;
}
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) {
    u32 x = __float_as_uint(v);
    u32 sign = (x >> 16) & 0x8000u;
    u32 a = x & 0x7fffffffu;
    f16 r;
    if (a > 0x7f800000u) {
        r.bits = (u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); // quiet NaN with the payload's top
    } else if (a >= 0x47800000u) {
        r.bits = (u16)(sign | 0x7c00u); // >= 2^16 (and infinity): infinity
    } else if (a >= 0x38800000u) {
        // Normal range: rebias the exponent; rounding may carry into it (up to infinity).
        u32 kept = ((a >> 23) - 112u) << 10 | ((a & 0x7fffffu) >> 13);
        r.bits = (u16)(sign | round_kept(kept, a & 0x1fffu, 13u));
    } else if (a > 0x33000000u) {
        // Subnormal result: the significand with its hidden bit, shifted to units of 2^-24.
        u32 m = (a & 0x7fffffu) | 0x800000u;
        u32 shift = 126u - (a >> 23);
        r.bits = (u16)(sign | round_kept(m >> shift, m & ((1u << shift) - 1u), shift));
    } else {
        r.bits = (u16)sign; // at most 2^-25 (a tie with zero rounds to even): zero
    }
    return r;
}

// The ring's arithmetic (fsdp_device::Element): 16-bit types compute in f32 and round after
// every operation.
__device__ __forceinline__ float op_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double op_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float op_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double op_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float op_div_count(float a, u32 n) { return __fdiv_rn(a, (float)n); }
__device__ __forceinline__ double op_div_count(double a, u32 n) {
    return __ddiv_rn(a, (double)n);
}
__device__ __forceinline__ float op_min(float a, float b) {
    return (a != a || b != b) ? canonical_nan_f32() : ((b < a) ? b : a);
}
__device__ __forceinline__ double op_min(double a, double b) {
    return (a != a || b != b) ? canonical_nan_f64() : ((b < a) ? b : a);
}
__device__ __forceinline__ float op_max(float a, float b) {
    return (a != a || b != b) ? canonical_nan_f32() : ((b > a) ? b : a);
}
__device__ __forceinline__ double op_max(double a, double b) {
    return (a != a || b != b) ? canonical_nan_f64() : ((b > a) ? b : a);
}

// Load as the compute type (f32 for the 16-bit types, the type itself otherwise), store back.
__device__ __forceinline__ float load_c(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ double load_c(const double* p, u64 i) { return p[i]; }
__device__ __forceinline__ float load_c(const bf16* p, u64 i) { return to_f32(p[i]); }
__device__ __forceinline__ float load_c(const f16* p, u64 i) { return to_f32(p[i]); }
__device__ __forceinline__ void store_c(float* p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store_c(double* p, u64 i, double v) { p[i] = v; }
__device__ __forceinline__ void store_c(bf16* p, u64 i, float v) { p[i] = from_f32<bf16>(v); }
__device__ __forceinline__ void store_c(f16* p, u64 i, float v) { p[i] = from_f32<f16>(v); }

// A compute-type value rounded to the element type of `tag` and widened back (the identity
// for f32 and f64).
__device__ __forceinline__ float round_as(const float*, float v) { return v; }
__device__ __forceinline__ double round_as(const double*, double v) { return v; }
__device__ __forceinline__ float round_as(const bf16*, float v) {
    return to_f32(from_f32<bf16>(v));
}
__device__ __forceinline__ float round_as(const f16*, float v) { return to_f32(from_f32<f16>(v)); }

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (u64)gridDim.x * blockDim.x)

// The end of a training step decided on the device (twins and the slots' meaning in
// host/step.rs): the host enqueues every step and reads its outcome later.
#define STEP_LOSS 0
#define STEP_GRAD_NORM 1
#define STEP_CLIPPED 2
#define STEP_CLIP_COEF 3
#define STEP_APPLIED 4
#define STEP_CHOICE 5
#define STEP_COUNT 6
#define STEP_NONFINITE 7
#define STEP_HALTED 8
#define STEP_FAULT 9
#define STEP_SCALE 10
#define STEP_UNSCALE 11
#define STEP_FOUND_INF 12
#define STEP_GROWTH_TRACKER 13
#define STEP_SCALER_SKIPPED 14
#define STEP_SQUARES 15
#define STEP_CHOICES 2

// The gradient AdamW reads as the decision says (twin: host/step.rs `decided_grad`): times
// STEP_UNSCALE when a grad scaler set it, then c·g + 0 (as axpby rounds it) when clipped.
__device__ __forceinline__ float decided_grad(float g, float unscale, bool clipped, float c) {
    if (unscale != 0.0f) g = __fmul_rn(g, unscale);
    return clipped ? __fadd_rn(__fmul_rn(c, g), 0.0f) : g;
}
