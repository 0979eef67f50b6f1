// Fused optimizer steps on flat f32 shards, torch's formulas in the order of
// fsdp::optim::{adamw_step, sgd_step}; the scalars are computed on the host (in f64, then
// rounded to f32, as PyTorch does for f32 tensors).

// AdamW. `lerp_small`: torch.lerp's branch for a weight below 0.5. The moments are stored as
// S (f32, or bf16 for the low-memory state) and computed in f32.
// One element of AdamW with gradient `gi`.
template <typename S>
__device__ __forceinline__ void adamw_one(float* p, float gi, S* m, S* v, u64 i, float decay,
                                          float w1, float one_minus_w1, u32 lerp_small,
                                          float beta2, float one_minus_beta2,
                                          float neg_step_size, float bc2_sqrt, float eps) {
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

template <typename S>
__device__ __forceinline__ void adamw_impl(float* p, const float* g, S* m, S* v, u64 n,
                                           float decay, float w1, float one_minus_w1,
                                           u32 lerp_small, float beta2, float one_minus_beta2,
                                           float neg_step_size, float bc2_sqrt, float eps) {
    GRID_STRIDE(i, n) {
        adamw_one<S>(p, g[i], m, v, i, decay, w1, one_minus_w1, lerp_small, beta2,
                     one_minus_beta2, neg_step_size, bc2_sqrt, eps);
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

// One element of SGD with gradient `gi`.
__device__ __forceinline__ void sgd_one(float* p, float gi, float* buf, u64 i, float neg_lr,
                                        float wd, float momentum, float damp, u32 flags) {
    float pi = p[i];
    float d = (flags & SGD_WEIGHT_DECAY) ? __fadd_rn(gi, __fmul_rn(wd, pi)) : gi;
    if (flags & SGD_MOMENTUM) {
        float b = (flags & SGD_FIRST_STEP)
                      ? d
                      : __fadd_rn(__fmul_rn(buf[i], momentum), __fmul_rn(damp, d));
        buf[i] = b;
        d = (flags & SGD_NESTEROV) ? __fadd_rn(d, __fmul_rn(momentum, b)) : b;
    }
    p[i] = __fadd_rn(pi, __fmul_rn(neg_lr, d));
}

extern "C" __global__ void sgd_f32(float* p, const float* g, float* buf, u64 n, float neg_lr,
                                   float wd, float momentum, float damp, u32 flags) {
    GRID_STRIDE(i, n) { sgd_one(p, g[i], buf, i, neg_lr, wd, momentum, damp, flags); }
}

// The end of a training step decided on the device: the scalars' slots (STEP_*) are in
// common.cuh.

// A decision's choice and count (twin: host/step.rs `count_step`): the scalar set is the
// steps counted minus `base_steps` (a count outside the choices is a fault); the step applies
// when `wanted` and no fault, and is then counted. Returns whether it applies.
__device__ __forceinline__ bool count_step(double* s, double base_steps, bool wanted) {
    double choice = s[STEP_COUNT] - base_steps;
    bool in_range = choice >= 0.0 && choice < (double)STEP_CHOICES;
    s[STEP_FAULT] = in_range ? 0.0 : 1.0;
    s[STEP_CHOICE] = in_range ? choice : 0.0;
    bool applied = wanted && in_range;
    s[STEP_APPLIED] = applied ? 1.0 : 0.0;
    if (applied) s[STEP_COUNT] = s[STEP_COUNT] + 1.0;
    return applied;
}

// The grad scaler's update after a decision (twin: host/step.rs `scaler_update`): on an
// overflow the skip is counted, the scale backed off and the tracker reset; an applied step
// counts towards the growth interval, at whose end the scale grows (if finite) and the
// tracker restarts. Each product in f64, rounded to f32.
__device__ __forceinline__ void scaler_update(double* s, bool found_inf, bool applied,
                                              double growth_factor, double backoff_factor,
                                              double growth_interval) {
    if (found_inf) {
        s[STEP_SCALER_SKIPPED] = s[STEP_SCALER_SKIPPED] + 1.0;
        s[STEP_SCALE] = (double)__double2float_rn(__dmul_rn(s[STEP_SCALE], backoff_factor));
        s[STEP_GROWTH_TRACKER] = 0.0;
    } else if (applied) {
        double successful = s[STEP_GROWTH_TRACKER] + 1.0;
        if (successful >= growth_interval) {
            float grown = __double2float_rn(__dmul_rn(s[STEP_SCALE], growth_factor));
            if (isfinite(grown)) s[STEP_SCALE] = (double)grown;
            s[STEP_GROWTH_TRACKER] = 0.0;
        } else {
            s[STEP_GROWTH_TRACKER] = successful;
        }
    }
}

// One thread: the norm from the tensors' sums of squares (in order), clipping, finiteness,
// the non-finite budget (`skip_nonfinite` < 0: none), the choice of AdamW scalars and the
// optimizer step count. `max_norm` < 0: no clipping. With a grad scaler (`growth_interval` >
// 0) the squares are of scaled gradients: the norm is unscaled, a non-finite one is the
// scaler's overflow, and the scale, tracker and skips are updated (twin: host/step.rs).
extern "C" __global__ void step_decide(double* s, u64 tensors, double max_norm,
                                       double skip_nonfinite, double base_steps,
                                       double growth_factor, double backoff_factor,
                                       double growth_interval) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    bool scaler = growth_interval > 0.0;
    double sq = 0.0;
    for (u64 i = 0; i < tensors; i++) sq = __dadd_rn(sq, s[STEP_SQUARES + i]);
    double norm = __dsqrt_rn(sq);
    double unscale = 0.0;
    if (scaler) {
        unscale = (double)__double2float_rn(__ddiv_rn(1.0, s[STEP_SCALE]));
        norm = __dmul_rn(norm, unscale);
    }
    s[STEP_UNSCALE] = unscale;
    s[STEP_GRAD_NORM] = norm;
    double clipped = 0.0, coef = 1.0;
    if (max_norm >= 0.0) {
        double c = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
        if (isfinite(norm) && c < 1.0) {
            clipped = 1.0;
            coef = (double)__double2float_rn(c);
        }
    }
    s[STEP_CLIPPED] = clipped;
    s[STEP_CLIP_COEF] = coef;
    bool found_inf = scaler && !isfinite(norm);
    bool finite = isfinite(__double2float_rn(s[STEP_LOSS])) && (found_inf || isfinite(norm));
    if (!finite) {
        s[STEP_NONFINITE] = s[STEP_NONFINITE] + 1.0;
        if (skip_nonfinite >= 0.0 && s[STEP_NONFINITE] > skip_nonfinite) s[STEP_HALTED] = 1.0;
    }
    bool applied = count_step(s, base_steps, finite && !found_inf && s[STEP_HALTED] == 0.0);
    s[STEP_FOUND_INF] = found_inf ? 1.0 : 0.0;
    if (scaler) {
        scaler_update(s, found_inf, applied, growth_factor, backoff_factor, growth_interval);
    }
}

// The end of the engine's step on the device, one thread (twin: host::engine_decide): the
// norm of the step's gradients (unscaled, under a grad scaler) is √(sharded[0] + replicated[0])
// (the sharded part all-reduced over the shard group), written to STEP_GRAD_NORM. With a grad
// scaler (`growth_interval` > 0) a non-finite sum is its overflow. With the non-finite rule
// (`guard`) the step's loss (`loss[0]`, summed over the world) is written to STEP_LOSS, and a
// step whose loss or norm is not finite (the norm not checked on an overflow) is counted and
// not applied; beyond `skip_nonfinite` (< 0: no limit) such steps the engine halts, and no
// later step applies. The step applies when it is taken (`take`: an optimizer step, not a
// skip), is finite, did not overflow, the engine is not halted and its count is among the
// choices; the scaler backs off on an overflow and counts the skip, and counts an applied step
// towards its growth interval. The gradients are unscaled and clipped in memory (STEP_UNSCALE
// and STEP_CLIPPED are 0), so the decided optimizers take them as they are.
extern "C" __global__ void engine_decide(double* s, const double* sharded,
                                         const double* replicated, const double* loss,
                                         double base_steps, u32 take, u32 guard,
                                         double skip_nonfinite, double growth_factor,
                                         double backoff_factor, double growth_interval) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    bool scaler = growth_interval > 0.0;
    double sum = __dadd_rn(sharded[0], replicated[0]);
    double norm = __dsqrt_rn(sum);
    s[STEP_GRAD_NORM] = norm;
    bool found_inf = scaler && !isfinite(sum);
    bool finite = true;
    if (guard != 0) {
        s[STEP_LOSS] = loss[0];
        finite = isfinite(__double2float_rn(loss[0])) && (found_inf || isfinite(norm));
        if (!finite) {
            s[STEP_NONFINITE] = s[STEP_NONFINITE] + 1.0;
            if (skip_nonfinite >= 0.0 && s[STEP_NONFINITE] > skip_nonfinite) {
                s[STEP_HALTED] = 1.0;
            }
        }
    }
    bool wanted = take != 0 && finite && !found_inf && s[STEP_HALTED] == 0.0;
    bool applied = count_step(s, base_steps, wanted);
    s[STEP_FOUND_INF] = found_inf ? 1.0 : 0.0;
    s[STEP_UNSCALE] = 0.0;
    s[STEP_CLIPPED] = 0.0;
    if (scaler) {
        scaler_update(s, found_inf, applied, growth_factor, backoff_factor, growth_interval);
    }
}

// SGD's scalars of one optimizer step (SgdScalars).
struct SgdArgs {
    float neg_lr, wd, momentum, damp;
    u32 flags;
};
struct SgdChoice {
    SgdArgs at[STEP_CHOICES];
};

// SGD as decided: nothing unless applied; the chosen scalars; the gradient unscaled and
// clipped as the decision says (decided_grad).
extern "C" __global__ void sgd_decided_f32(float* p, const float* g, float* buf, u64 n,
                                           const double* s, SgdChoice choice) {
    if (s[STEP_APPLIED] != 1.0) return;
    u32 k = (u32)s[STEP_CHOICE];
    const SgdArgs a = choice.at[k < STEP_CHOICES ? k : STEP_CHOICES - 1];
    bool clipped = s[STEP_CLIPPED] == 1.0;
    float c = __double2float_rn(s[STEP_CLIP_COEF]);
    float u = __double2float_rn(s[STEP_UNSCALE]);
    GRID_STRIDE(i, n) {
        float gi = decided_grad(g[i], u, clipped, c);
        sgd_one(p, gi, buf, i, a.neg_lr, a.wd, a.momentum, a.damp, a.flags);
    }
}

// AdamW's scalars of one optimizer step (AdamWScalars, lerp_small as a u32).
struct AdamWArgs {
    float decay, w1, one_minus_w1;
    u32 lerp_small;
    float beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps;
};
struct AdamWChoice {
    AdamWArgs at[STEP_CHOICES];
};

// AdamW as `step_decide` decided: nothing unless applied; the chosen scalars; the gradient
// unscaled and clipped as the decision says (decided_grad).
extern "C" __global__ void adamw_decided_f32(float* p, const float* g, float* m, float* v,
                                             u64 n, const double* s, AdamWChoice choice) {
    if (s[STEP_APPLIED] != 1.0) return;
    u32 k = (u32)s[STEP_CHOICE];
    const AdamWArgs a = choice.at[k < STEP_CHOICES ? k : STEP_CHOICES - 1];
    bool clipped = s[STEP_CLIPPED] == 1.0;
    float c = __double2float_rn(s[STEP_CLIP_COEF]);
    float u = __double2float_rn(s[STEP_UNSCALE]);
    GRID_STRIDE(i, n) {
        float gi = decided_grad(g[i], u, clipped, c);
        adamw_one<float>(p, gi, m, v, i, a.decay, a.w1, a.one_minus_w1, a.lerp_small, a.beta2,
                         a.one_minus_beta2, a.neg_step_size, a.bc2_sqrt, a.eps);
    }
}

// adamw_decided_f32 on many tensors in one launch (multi_tensor_apply): blockIdx.y is the
// tensor, whose elements the blocks along x stride over; tensor k takes choice[decay[k]]
// (the set without or with weight decay). Each element's arithmetic is adamw_decided_f32's.
#define ADAMW_TENSORS 64
struct AdamWList {
    u64 p[ADAMW_TENSORS];
    u64 g[ADAMW_TENSORS];
    u64 m[ADAMW_TENSORS];
    u64 v[ADAMW_TENSORS];
    u64 n[ADAMW_TENSORS];
    u32 decay[ADAMW_TENSORS];
};

extern "C" __global__ void adamw_decided_many(AdamWList l, u32 count, const double* s,
                                              AdamWChoice plain, AdamWChoice decayed) {
    u32 t = blockIdx.y;
    if (t >= count || s[STEP_APPLIED] != 1.0) return;
    u32 k = (u32)s[STEP_CHOICE];
    const AdamWChoice choice = l.decay[t] ? decayed : plain;
    const AdamWArgs a = choice.at[k < STEP_CHOICES ? k : STEP_CHOICES - 1];
    bool clipped = s[STEP_CLIPPED] == 1.0;
    float c = __double2float_rn(s[STEP_CLIP_COEF]);
    float u = __double2float_rn(s[STEP_UNSCALE]);
    float* p = (float*)l.p[t];
    const float* g = (const float*)l.g[t];
    float* m = (float*)l.m[t];
    float* v = (float*)l.v[t];
    u64 n = l.n[t];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float gi = decided_grad(g[i], u, clipped, c);
        adamw_one<float>(p, gi, m, v, i, a.decay, a.w1, a.one_minus_w1, a.lerp_small, a.beta2,
                         a.one_minus_beta2, a.neg_step_size, a.bc2_sqrt, a.eps);
    }
}

