// torchdistx's AnyPrecisionAdamW at the end of a step decided on the device. Its twin
// (host/any_precision.rs, torchdistx as fsdp::optim computes it) fuses `add_(grad, alpha)`
// and `addcmul_` into multiply-adds, so this program uses __fmaf_rn where they are;
// --fmad=false still keeps the compiler from fusing anything else.
// As `step_decide` decided (twin: host/any_precision.rs):
// every line one PyTorch operation in f32, rounded to the dtype it writes. The parameters are
// f32 rounded to bf16 when `param_bf16`; the state is S (f32, or bf16 packed in f32 buffers).
struct AnyPrecisionArgs {
    u32 has_decay;
    float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, denom_correction, eps,
        neg_step_size;
};
struct AnyPrecisionChoice {
    AnyPrecisionArgs at[STEP_CHOICES];
};

__device__ __forceinline__ float round_param(u32 param_bf16, float x) {
    return param_bf16 ? to_f32(from_f32<bf16>(x)) : x;
}

// Elements first, first + step, ... of one tensor (a grid-stride loop of the caller's).
template <typename S>
__device__ __forceinline__ void anyprecision_decided_impl(float* p, const float* g, S* m, S* v,
                                                          S* comp, u64 n, const double* s,
                                                          AnyPrecisionChoice choice,
                                                          u32 param_bf16, u64 first,
                                                          u64 step) {
    if (s[STEP_APPLIED] != 1.0) return;
    u32 k = (u32)s[STEP_CHOICE];
    const AnyPrecisionArgs a = choice.at[k < STEP_CHOICES ? k : STEP_CHOICES - 1];
    bool clipped = s[STEP_CLIPPED] == 1.0;
    float c = __double2float_rn(s[STEP_CLIP_COEF]);
    float u = __double2float_rn(s[STEP_UNSCALE]);
    const S* tag = m;
    float eps = round_as(tag, a.eps);
    for (u64 i = first; i < n; i += step) {
        float gi = decided_grad(g[i], u, clipped, c);
        float pf = p[i];
        if (a.has_decay) pf = round_param(param_bf16, __fmul_rn(pf, a.decay));
        float mf = round_as(tag, __fmul_rn(load_c(m, i), a.beta1));
        mf = round_as(tag, __fmaf_rn(a.one_minus_beta1, gi, mf));
        float vf = round_as(tag, __fmul_rn(load_c(v, i), a.beta2));
        vf = round_as(tag, __fmaf_rn(__fmul_rn(a.one_minus_beta2, gi), gi, vf));
        store_c(m, i, mf);
        store_c(v, i, vf);
        float d = round_as(tag, __fsqrt_rn(vf));
        d = round_as(tag, __fdiv_rn(d, a.denom_correction));
        d = round_as(tag, __fadd_rn(d, eps));
        float upd = __fdiv_rn(__fmul_rn(a.neg_step_size, mf), d);
        if (comp != nullptr) {
            float cf = round_as(tag, __fadd_rn(load_c(comp, i), upd));
            float pn = round_param(param_bf16, __fadd_rn(pf, cf));
            float t = round_param(param_bf16, __fsub_rn(pf, pn));
            store_c(comp, i, __fadd_rn(cf, t));
            p[i] = pn;
        } else {
            p[i] = round_param(param_bf16, __fadd_rn(pf, upd));
        }
    }
}

#define ANYPRECISION(NAME, S) \
    extern "C" __global__ void NAME(float* p, const float* g, S* m, S* v, S* comp, u64 n, \
                                    const double* s, AnyPrecisionChoice choice, \
                                    u32 param_bf16) { \
        anyprecision_decided_impl<S>(p, g, m, v, comp, n, s, choice, param_bf16, \
                                     (u64)blockIdx.x * blockDim.x + threadIdx.x, \
                                     (u64)gridDim.x * blockDim.x); \
    }

ANYPRECISION(anyprecision_decided_f32, float)
ANYPRECISION(anyprecision_decided_bf16_state, bf16)

// The same on many tensors in one launch (multi_tensor_apply): blockIdx.y is the tensor, whose
// elements the blocks along x stride over; tensor k takes choice[decay[k]] (without or with
// weight decay); c[k] is 0 without Kahan summation. Each element's arithmetic is the
// one-tensor kernel's.
#define ANYPRECISION_TENSORS 48
struct AnyPrecisionList {
    u64 p[ANYPRECISION_TENSORS];
    u64 g[ANYPRECISION_TENSORS];
    u64 m[ANYPRECISION_TENSORS];
    u64 v[ANYPRECISION_TENSORS];
    u64 c[ANYPRECISION_TENSORS];
    u64 n[ANYPRECISION_TENSORS];
    u32 decay[ANYPRECISION_TENSORS];
};

#define ANYPRECISION_MANY(NAME, S) \
    extern "C" __global__ void NAME(AnyPrecisionList l, u32 count, const double* s, \
                                    AnyPrecisionChoice plain, AnyPrecisionChoice decayed, \
                                    u32 param_bf16) { \
        u32 t = blockIdx.y; \
        if (t >= count) return; \
        anyprecision_decided_impl<S>((float*)l.p[t], (const float*)l.g[t], (S*)l.m[t], \
                                     (S*)l.v[t], (S*)l.c[t], l.n[t], s, \
                                     l.decay[t] ? decayed : plain, param_bf16, \
                                     (u64)blockIdx.x * blockDim.x + threadIdx.x, \
                                     (u64)gridDim.x * blockDim.x); \
    }

ANYPRECISION_MANY(anyprecision_decided_many_f32, float)
ANYPRECISION_MANY(anyprecision_decided_many_bf16_state, bf16)
