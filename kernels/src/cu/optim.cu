// Fused optimizer steps on flat f32 shards, torch's formulas in the order of
// fsdp::optim::{adamw_step, sgd_step}; the scalars are computed on the host (in f64, then
// rounded to f32, as PyTorch does for f32 tensors).

// AdamW. `lerp_small`: torch.lerp's branch for a weight below 0.5. The moments are stored as
// S (f32, or bf16 for the low-memory state) and computed in f32.
template <typename S>
__device__ __forceinline__ void adamw_impl(float* p, const float* g, S* m, S* v, u64 n,
                                           float decay, float w1, float one_minus_w1,
                                           u32 lerp_small, float beta2, float one_minus_beta2,
                                           float neg_step_size, float bc2_sqrt, float eps) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float pi = __fmul_rn(p[i], decay);
        float mi = load_c(m, i);
        float vi = load_c(v, i);
        float diff = __fsub_rn(gi, mi);
        mi = lerp_small ? __fadd_rn(mi, __fmul_rn(w1, diff))
                        : __fsub_rn(gi, __fmul_rn(diff, one_minus_w1));
        vi = __fadd_rn(__fmul_rn(vi, beta2), __fmul_rn(one_minus_beta2, __fmul_rn(gi, gi)));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        p[i] = __fadd_rn(pi, __fmul_rn(neg_step_size, __fdiv_rn(mi, denom)));
        store_c(m, i, mi);
        store_c(v, i, vi);
    }
}

#define ADAMW(NAME, S) \
    extern "C" __global__ void NAME(float* p, const float* g, S* m, S* v, u64 n, float decay, \
                                    float w1, float one_minus_w1, u32 lerp_small, float beta2, \
                                    float one_minus_beta2, float neg_step_size, float bc2_sqrt, \
                                    float eps) { \
        adamw_impl<S>(p, g, m, v, n, decay, w1, one_minus_w1, lerp_small, beta2, \
                      one_minus_beta2, neg_step_size, bc2_sqrt, eps); \
    }

ADAMW(adamw_f32, float)
ADAMW(adamw_bf16_state, bf16)

// SGD flags.
#define SGD_MOMENTUM 1u
#define SGD_FIRST_STEP 2u
#define SGD_NESTEROV 4u
#define SGD_WEIGHT_DECAY 8u

extern "C" __global__ void sgd_f32(float* p, const float* g, float* buf, u64 n, float neg_lr,
                                   float wd, float momentum, float damp, u32 flags) {
    GRID_STRIDE(i, n) {
        float pi = p[i];
        float d = (flags & SGD_WEIGHT_DECAY) ? __fadd_rn(g[i], __fmul_rn(wd, pi)) : g[i];
        if (flags & SGD_MOMENTUM) {
            float b = (flags & SGD_FIRST_STEP)
                          ? d
                          : __fadd_rn(__fmul_rn(buf[i], momentum), __fmul_rn(damp, d));
            buf[i] = b;
            d = (flags & SGD_NESTEROV) ? __fadd_rn(d, __fmul_rn(momentum, b)) : b;
        }
        p[i] = __fadd_rn(pi, __fmul_rn(neg_lr, d));
    }
}
