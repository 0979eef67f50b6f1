// Just enough of CUDA to compile fsdp-kernels' fused attention (src/cu/attention.cu, with
// src/cu/common.cuh) as C++ and run a kernel's block as host threads: one std::thread per CUDA
// thread, __syncthreads a barrier of the block, a warp's shuffles and mma.sync exchanges
// through memory between two barriers of the warp. Blocks run one after another, so a kernel's
// __shared__ arrays (function statics here) belong to the block that runs.
//
// mma.sync.m16n8k16 (f32 accumulators, bf16 or f16 operands) is computed from the fragment
// layouts of the PTX ISA, written here once (fa_emu_a, fa_emu_b, fa_emu_c) independently of
// how the kernels index their fragments.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))

struct emu_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline double __longlong_as_double(long long v) {
    double d;
    std::memcpy(&d, &v, 8);
    return d;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

// The block's threads and their barriers.
struct EmuBlock {
    int threads;
    std::barrier<> block;
    std::vector<std::barrier<>*> warps;
    std::vector<float> shfl;
    // A warp's mma operands, posted by each lane: a[4], b[2], c[4].
    std::vector<unsigned> mma_a, mma_b;
    std::vector<float> mma_c;
    explicit EmuBlock(int n)
        : threads(n), block(n), shfl(n), mma_a(4 * n), mma_b(2 * n), mma_c(4 * n) {
        for (int w = 0; w < n / 32; ++w) warps.push_back(new std::barrier<>(32));
    }
    ~EmuBlock() {
        for (auto* w : warps) delete w;
    }
};
inline EmuBlock* emu_block = nullptr;

inline void __syncthreads() { emu_block->block.arrive_and_wait(); }
inline void emu_warp_sync() { emu_block->warps[threadIdx.x / 32]->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int mask) {
    int t = (int)threadIdx.x;
    emu_block->shfl[t] = v;
    emu_warp_sync();
    int base = t & ~31, lane = t & 31;
    float r = emu_block->shfl[base + (lane ^ mask)];
    emu_warp_sync();
    return r;
}

// Runs `kernel` (a lambda over the kernel's arguments) on a grid of blocks of `threads`.
inline void emu_launch(emu_dim3 grid, int threads, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = {(unsigned)threads, 1, 1};
    for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
            EmuBlock b(threads);
            emu_block = &b;
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; ++t)
                ts.emplace_back([&, t, x, y] {
                    threadIdx = {(unsigned)t, 0, 0};
                    blockIdx = {x, y, 0};
                    kernel();
                });
            for (auto& t : ts) t.join();
            emu_block = nullptr;
        }
}
