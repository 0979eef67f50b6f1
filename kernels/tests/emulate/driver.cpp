// Runs the fused attention's four kernels (src/cu/attention.cu) on the host through
// cuda_shim.h, for kernels/tests/attention_emulated.rs:
//   emu DIR bf16|f16 D PAIRS T SCALE
// reads DIR/{q,k,v,dout,rows}.bin (16-bit values; rows: forward's output as token rows of one
// sequence of PAIRS heads) and writes DIR/{y,lse,dq,dk,dv}.bin (f32), each kernel launched on
// the grid its launcher (src/launch/attention.rs) uses.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda_shim.h"
#include "common.cuh"
#include "mma_emulated.h"
#include "attention.cu"

template <typename T> static std::vector<T> load(const std::string& path, size_t n) {
    std::vector<T> v(n);
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f || std::fread(v.data(), sizeof(T), n, f) != n) {
        std::fprintf(stderr, "cannot read %zu values from %s\n", n, path.c_str());
        std::exit(2);
    }
    std::fclose(f);
    return v;
}

template <typename T> static void store(const std::string& path, const std::vector<T>& v) {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) {
        std::fprintf(stderr, "cannot write %s\n", path.c_str());
        std::exit(2);
    }
    std::fclose(f);
}

using Fwd = void (*)(const u16*, const u16*, const u16*, float*, float*, int, float);
using Dot = void (*)(const u16*, const u16*, float*, u64, int, int, int, int);
using Dkv = void (*)(const u16*, const u16*, const u16*, const u16*, const float*, const float*,
                     float*, float*, int, float, float);
using Dq = void (*)(const u16*, const u16*, const u16*, const u16*, const float*, const float*,
                    float*, int, float, float);

int main(int argc, char** argv) {
    if (argc != 7) {
        std::fprintf(stderr, "usage: emu DIR bf16|f16 D PAIRS T SCALE\n");
        return 2;
    }
    std::string dir = argv[1], h = argv[2];
    int d = std::atoi(argv[3]), pairs = std::atoi(argv[4]), t = std::atoi(argv[5]);
    float scale = std::strtof(argv[6], nullptr);
    Fwd fwd;
    Dot dot;
    Dkv dkv;
    Dq dq;
#define PICK(H, D)                          \
    if (h == #H && d == D) {                \
        fwd = flash_forward_##H##_d##D;     \
        dot = flash_backward_dot_##H##_d##D; \
        dkv = flash_backward_dkv_##H##_d##D; \
        dq = flash_backward_dq_##H##_d##D;   \
    } else
    PICK(bf16, 32) PICK(f16, 32) PICK(bf16, 64) PICK(f16, 64) {
        std::fprintf(stderr, "no kernels for %s heads of %d\n", h.c_str(), d);
        return 2;
    }
    size_t n = (size_t)pairs * t * d, rows = (size_t)pairs * t;
    auto q = load<u16>(dir + "/q.bin", n), k = load<u16>(dir + "/k.bin", n);
    auto v = load<u16>(dir + "/v.bin", n), dout = load<u16>(dir + "/dout.bin", n);
    auto yrows = load<u16>(dir + "/rows.bin", n);
    std::vector<float> y(n, NAN), lse(rows, NAN), dsum(rows, NAN);
    std::vector<float> gq(n, NAN), gk(n, NAN), gv(n, NAN);
    float scale2 = scale * 1.44269504088896341f;
    unsigned tiles = (unsigned)((t + FA_TILE - 1) / FA_TILE);
    emu_launch({tiles, (unsigned)pairs, 1}, FA_THREADS,
               [&] { fwd(q.data(), k.data(), v.data(), y.data(), lse.data(), t, scale2); });
    unsigned warps = FA_THREADS / 32;
    emu_launch({(unsigned)((rows + warps - 1) / warps), 1, 1}, FA_THREADS, [&] {
        dot(dout.data(), yrows.data(), dsum.data(), rows, t, pairs, pairs * d, 0);
    });
    emu_launch({tiles, (unsigned)pairs, 1}, FA_THREADS, [&] {
        dkv(q.data(), k.data(), v.data(), dout.data(), lse.data(), dsum.data(), gk.data(),
            gv.data(), t, scale, scale2);
    });
    emu_launch({tiles, (unsigned)pairs, 1}, FA_THREADS, [&] {
        dq(q.data(), k.data(), v.data(), dout.data(), lse.data(), dsum.data(), gq.data(), t,
           scale, scale2);
    });
    store(dir + "/y.bin", y);
    store(dir + "/lse.bin", lse);
    store(dir + "/dq.bin", gq);
    store(dir + "/dk.bin", gk);
    store(dir + "/dv.bin", gv);
    return 0;
}
