// Just enough of CUDA to compile fsdp-kernels' programs (src/cu/*.cu after src/cu/common.cuh)
// as C++ and run a kernel's block as host threads: one std::thread per CUDA thread,
// __syncthreads a barrier of the block, a warp's shuffles and mma.sync exchanges through memory
// between two barriers of the warp. Blocks run one after another (in a shuffled order), so a
// kernel's __shared__ arrays (function statics here) belong to the block that runs; a launch
// runs twice to find blocks that race on global memory (EmuWrites). The `_rn` intrinsics are the
// host's IEEE operations (compiled with -ffp-contract=off: nothing fused but __fmaf_rn).
//
// mma.sync.m16n8k16 (f32 accumulators, bf16 or f16 operands) is computed from the fragment
// layouts of the PTX ISA, written here once (fa_emu_a, fa_emu_b, fa_emu_c) independently of
// how the kernels index their fragments.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define __device__
// Not `inline`: a static of an inline function lives in a COMDAT group, and the poisoned
// section below must hold every __shared__ array alike (one translation unit: no ODR issue).
#define __forceinline__
#define __global__
// A block's __shared__ arrays are function statics in one section of their own, which every
// block starts with filled with 0xff bytes (NaN for floats, all ones for integers), as a GPU's
// shared memory starts with garbage: a kernel that reads a slot no thread of its block wrote
// sees NaN, not zero or the previous block's value.
#define __shared__ static __attribute__((section("emu_shared")))
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))

struct emu_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;
// The thread's index in its block (x fastest): warps are 32 consecutive ones, as on a GPU.
inline thread_local int emu_tid;

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
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __double2float_rn(double a) { return (float)a; }
using std::isfinite;

// The block's threads and their barriers.
struct EmuBlock {
    int threads;
    std::barrier<> block;
    std::vector<std::barrier<>*> warps;
    std::vector<unsigned long long> shfl;
    // A warp's mma operands, posted by each lane: a[4], b[2], c[4].
    std::vector<unsigned> mma_a, mma_b;
    std::vector<float> mma_c;
    // A block of `n` threads: its last warp has the remaining `n % 32` when that is not 0 (a
    // shuffle there reads the posted values of lanes that exist; past them, all ones).
    explicit EmuBlock(int n)
        : threads(n), block(n), shfl((n + 31) / 32 * 32, ~0ull), mma_a(4 * shfl.size()),
          mma_b(2 * shfl.size()), mma_c(4 * shfl.size()) {
        for (int w = 0; w * 32 < n; ++w) warps.push_back(new std::barrier<>(std::min(32, n - 32 * w)));
    }
    ~EmuBlock() {
        for (auto* w : warps) delete w;
    }
};
inline EmuBlock* emu_block = nullptr;

// The section's bounds (the linker's), and one byte in it so that it exists in every program.
extern "C" unsigned char __start_emu_shared[], __stop_emu_shared[];
static unsigned char emu_shared_anchor __attribute__((section("emu_shared"), used));
inline void emu_poison_shared() {
    std::memset(__start_emu_shared, 0xff, (size_t)(__stop_emu_shared - __start_emu_shared));
}

inline void __syncthreads() { emu_block->block.arrive_and_wait(); }
inline void emu_warp_sync() { emu_block->warps[emu_tid / 32]->arrive_and_wait(); }

// A warp's exchange: every lane posts `v` and reads lane `from(lane)`'s (every lane of the
// warp must take part, as `0xffffffff` promises; one that does not deadlocks the emulator,
// which its caller's timeout reports). Values travel as their bits (NaN payloads too); a lane
// past a partial last warp reads all ones (NaN), as undefined on a GPU.
template <typename T, typename F> inline T emu_shuffle(T v, F from) {
    static_assert(sizeof(T) <= 8, "a shuffle of at most 8 bytes");
    int t = emu_tid;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    emu_block->shfl[t] = bits;
    emu_warp_sync();
    int base = t & ~31, lane = t & 31;
    T r;
    std::memcpy(&r, &emu_block->shfl[base + (from(lane) & 31)], sizeof(T));
    emu_warp_sync();
    return r;
}
// The emulator exchanges whole warps: a shuffle naming fewer lanes is refused rather than left
// to deadlock (every kernel here names all 32).
inline void emu_whole_warp(unsigned lanes) {
    if (lanes != 0xffffffffu) {
        std::fprintf(stderr, "emulator: a shuffle of lanes 0x%08x (the emulator takes 0xffffffff)\n",
                     lanes);
        std::exit(2);
    }
}
template <typename T> inline T __shfl_xor_sync(unsigned lanes, T v, int mask) {
    emu_whole_warp(lanes);
    return emu_shuffle(v, [mask](int lane) { return lane ^ mask; });
}
template <typename T> inline T __shfl_sync(unsigned lanes, T v, int src) {
    emu_whole_warp(lanes);
    return emu_shuffle(v, [src](int) { return src; });
}

// The launches run so far (each one's blocks in an order of its own).
inline unsigned long long emu_launches = 0;

// The memory a launch may write (the buffers its non-const pointers and its structs' pointers
// reach, empty ones left out), set by the emulator's driver for each launch, and the kernel's
// name.
struct EmuRegion {
    size_t buffer;
    unsigned char* base;
    size_t size;
};
inline std::vector<EmuRegion> emu_regions;
inline const char* emu_kernel = "";

[[noreturn]] inline void emu_race(const char* what, size_t byte, size_t buffer) {
    std::fprintf(stderr,
                 "emulator: %s: %s byte %zu of buffer %zu (a race on a GPU, whose blocks run "
                 "concurrently: no kernel here uses atomics or orders its blocks)\n",
                 emu_kernel, what, byte, buffer);
    std::exit(2);
}

// A launch's blocks against the memory they may write. GPU blocks run concurrently, and no
// kernel here uses atomics, so two things are races whatever order the blocks run in:
// - a byte that two blocks set to different values (a lost update: two additions give the
//   same sum in either order, so the shuffle alone cannot show it);
// - a block reading what another block of the launch wrote.
// So a launch runs twice. First every block sees memory as it was at the launch's start (its
// own writes aside): after each block the bytes it changed are claimed — a byte another block
// set to another value is the first race — kept aside and restored. Then the blocks run again
// from the launch's start, in the same order, each seeing the writes of those before it, as a
// sequential run would: memory that then differs from the first run's is the second race.
struct EmuWrites {
    // The watched memory at the launch's start; the first run's result; who set each byte
    // there (1 + the block's index, 0: none).
    std::vector<std::vector<unsigned char>> start, result;
    std::vector<std::vector<unsigned long long>> writer;
    EmuWrites() {
        for (const auto& r : emu_regions) {
            start.emplace_back(r.base, r.base + r.size);
            writer.emplace_back(r.size, 0ull);
        }
        result = start;
    }
    // After block `o` (x + y · gridDim.x) of the first run: claims the bytes it changed and
    // restores them for the next block.
    void after_block(unsigned long long o) {
        constexpr size_t CHUNK = 64;
        for (size_t i = 0; i < emu_regions.size(); ++i) {
            const auto& r = emu_regions[i];
            const unsigned char* old = start[i].data();
            for (size_t at = 0; at < r.size; at += CHUNK) {
                size_t n = std::min(CHUNK, r.size - at);
                if (std::memcmp(old + at, r.base + at, n) == 0) continue;
                for (size_t k = at; k < at + n; ++k) {
                    if (old[k] == r.base[k]) continue;
                    unsigned long long w = writer[i][k];
                    if (w != 0 && w != o + 1 && result[i][k] != r.base[k]) {
                        char what[160];
                        std::snprintf(what, sizeof what,
                                      "blocks (%llu, %llu) and (%llu, %llu) both wrote",
                                      (w - 1) % gridDim.x, (w - 1) / gridDim.x, o % gridDim.x,
                                      o / gridDim.x);
                        emu_race(what, k, r.buffer);
                    }
                    writer[i][k] = o + 1;
                    result[i][k] = r.base[k];
                    r.base[k] = old[k];
                }
            }
        }
    }
    // After the second run: its memory must be the first run's.
    void compare() const {
        for (size_t i = 0; i < emu_regions.size(); ++i) {
            const auto& r = emu_regions[i];
            if (std::memcmp(result[i].data(), r.base, r.size) == 0) continue;
            size_t k = 0;
            while (result[i][k] == r.base[k]) ++k;
            emu_race("a block read what another block of the launch wrote: run one after another, "
                     "the blocks leave another value than when each sees the launch's start at",
                     k, r.buffer);
        }
    }
};

// Runs `kernel` (a lambda over the kernel's arguments) on a grid of blocks of `block.x` ×
// `block.y` threads. The blocks run one after another in a shuffled order (fixed by the
// launch's number, so a run is repeatable), as a GPU promises no order: a kernel whose
// blocks read what other blocks of the same launch write fails, whichever comes first; where
// the driver names the memory the launch may write (emu_regions), twice, as EmuWrites says.
inline void emu_launch(emu_dim3 grid, emu_dim3 block, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = {block.x, block.y, 1};
    int threads = (int)(block.x * block.y);
    std::vector<unsigned long long> order((unsigned long long)grid.x * grid.y);
    for (unsigned long long i = 0; i < order.size(); ++i) order[i] = i;
    unsigned long long state = 0x9e3779b97f4a7c15ull * ++emu_launches;
    for (unsigned long long i = order.size(); i > 1; --i) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        std::swap(order[i - 1], order[(state >> 33) % i]);
    }
    auto run_block = [&](unsigned long long o) {
        unsigned x = (unsigned)(o % grid.x), y = (unsigned)(o / grid.x);
        EmuBlock b(threads);
        emu_block = &b;
        emu_poison_shared();
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
            ts.emplace_back([&, t, x, y] {
                emu_tid = t;
                threadIdx = {(unsigned)t % block.x, (unsigned)t / block.x, 0};
                blockIdx = {x, y, 0};
                kernel();
            });
        for (auto& t : ts) t.join();
        emu_block = nullptr;
    };
    if (emu_regions.empty()) {
        for (unsigned long long o : order) run_block(o);
        return;
    }
    EmuWrites writes;
    for (unsigned long long o : order) {
        run_block(o);
        writes.after_block(o);
    }
    for (unsigned long long o : order) run_block(o);
    writes.compare();
}

// The same on one-dimensional blocks of `threads`.
inline void emu_launch(emu_dim3 grid, int threads, const std::function<void()>& kernel) {
    emu_launch(grid, emu_dim3{(unsigned)threads, 1, 1}, kernel);
}
