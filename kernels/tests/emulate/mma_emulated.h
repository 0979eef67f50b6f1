// mma.sync.aligned.m16n8k16.row.col.f32.<H>.<H>.f32 for one warp, after cuda_shim.h and before
// the program's source (common.cuh's u16 and u32 spelled out here; H's to_f32 is found where
// the kernels instantiate it). The PTX ISA's fragment layouts, lane = 4 g + c (g = lane / 4, c = lane % 4), each
// 32-bit register two 16-bit values, the lower index in the low half:
//   A (16 x 16): row r, column k in lane (r % 8) * 4 + (k % 8) / 2, register
//                (r >= 8) + 2 (k >= 8), half k % 2
//   B (16 x 8):  row k, column n in lane n * 4 + (k % 8) / 2, register (k >= 8), half k % 2
//   C (16 x 8):  row r, column n in lane (r % 8) * 4 + n / 2, element 2 (r >= 8) + n % 2
#pragma once
#define FA_MMA_EMULATED 1

template <typename H> inline float fa_emu_half(unsigned reg, int half) {
    H h;
    h.bits = (unsigned short)(half ? (reg >> 16) : (reg & 0xffffu));
    return to_f32(h);
}

template <typename H> inline float fa_emu_a(int base, int r, int k) {
    int lane = (r % 8) * 4 + (k % 8) / 2, reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return fa_emu_half<H>(emu_block->mma_a[4 * (base + lane) + reg], k % 2);
}

template <typename H> inline float fa_emu_b(int base, int k, int n) {
    int lane = n * 4 + (k % 8) / 2, reg = k >= 8 ? 1 : 0;
    return fa_emu_half<H>(emu_block->mma_b[2 * (base + lane) + reg], k % 2);
}

template <typename H> inline void fa_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    int t = emu_tid, base = t & ~31, lane = t & 31;
    for (int i = 0; i < 4; ++i) emu_block->mma_a[4 * t + i] = a[i];
    emu_block->mma_b[2 * t] = b0;
    emu_block->mma_b[2 * t + 1] = b1;
    emu_warp_sync();
    int g = lane / 4, cc = lane % 4;
    for (int e = 0; e < 4; ++e) {
        // This lane's element e of C: row g (+ 8 for e >= 2), column 2 cc + e % 2.
        int r = g + (e >= 2 ? 8 : 0), n = 2 * cc + e % 2;
        float acc = c[e];
        for (int k = 0; k < 16; ++k) acc += fa_emu_a<H>(base, r, k) * fa_emu_b<H>(base, k, n);
        c[e] = acc;
    }
    emu_warp_sync();
}
