// Runs any kernel of one fsdp-kernels program on the host through cuda_shim.h, for
// kernels/tests/common/emulator.rs:
//   emu DIR
// DIR/program.cu is the program's very source (Program::source: common.cuh and its .cu files,
// what NVRTC compiles; after EMU_PRELUDE where the build names one) and DIR/registry.inc one
// `EMU_KERNEL(name)` line per kernel (Program::kernels) and one `EMU_BOUNDS(name, bound)` per
// `__launch_bounds__` of the source, both written by the test before it compiles this file.
// A launch is refused as a GPU refuses it: an empty grid, one past the grid's limits, a block
// past 1024 threads or past the kernel's __launch_bounds__; a pointer parameter not aligned for
// its type is refused as a GPU faults on it, and a launch whose blocks race (two setting one
// byte to different values, or one reading another's writes: cuda_shim.h's EmuWrites) as the
// race it is on a GPU. A run reads DIR/request.txt and DIR/in.bin (the buffers, concatenated),
// runs the launches in order and writes every buffer back to DIR/out.bin. request.txt:
//   buffers COUNT            then COUNT lines: BYTES
//   launch NAME GX GY BX BY ARGS     a grid of GX × GY blocks of BX × BY threads, then ARGS
//                                    lines, one per kernel parameter:
//     p BUF OFFSET           a pointer: buffer BUF's address plus OFFSET bytes
//     n                      a null pointer (what a launcher passes as 0 for "none")
//     v HEX RELOCS           a value of the parameter's type, its bytes in hex (a struct passed
//                            by value, as the launcher builds it), then RELOCS times
//                            `AT BUF OFFSET`: the 8 bytes at AT become that buffer's address
// A value's size must be the parameter's (a struct the launcher lays out otherwise fails).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_shim.h"
// What a program needs emulated besides the shim, before its source, named by the build
// (-DEMU_PRELUDE="file.h"; Program::Attention: mma.sync, mma_emulated.h).
#ifdef EMU_PRELUDE
#include EMU_PRELUDE
#endif
#include "program.cu"

[[noreturn]] static void emu_fail(const std::string& why) {
    std::fprintf(stderr, "emulator: %s\n", why.c_str());
    std::exit(2);
}

struct EmuArg {
    char kind = 0;
    std::vector<unsigned char> bytes;
    size_t buf = 0, offset = 0;
    // A value's relocations: the buffers its pointer fields reach.
    std::vector<size_t> reaches;
};

// The bytes around every buffer (64 to 127 before, 64 to 127 after), checked after the run: a
// kernel that writes past its buffer fails, and one that reads past it reads these, not zeros.
constexpr unsigned char EMU_CANARY = 0xa5;

struct EmuBuffers {
    std::vector<std::vector<unsigned char>> storage;
    // Each buffer's first byte, 64-byte aligned within its storage (vector loads).
    std::vector<unsigned char*> base;
    std::vector<size_t> sizes;
    unsigned char* at(size_t buf, size_t offset) const {
        if (buf >= base.size() || offset > sizes[buf]) emu_fail("a pointer past its buffer");
        return base[buf] + offset;
    }
};

template <typename T> static T emu_get(const EmuBuffers& b, const EmuArg& a, size_t i) {
    if constexpr (std::is_pointer_v<T>) {
        if (a.kind == 'n') return nullptr;
        if (a.kind != 'p') emu_fail("parameter " + std::to_string(i) + " is a pointer");
        unsigned char* p = b.at(a.buf, a.offset);
        // A pointer must be aligned for what it points to (an f32x4 to 16 bytes): a GPU faults
        // with "misaligned address" at its first access, and the error poisons the context.
        using P = std::remove_cv_t<std::remove_pointer_t<T>>;
        if constexpr (!std::is_void_v<P>) {
            if ((uintptr_t)p % alignof(P))
                emu_fail("parameter " + std::to_string(i) + " is misaligned: buffer " +
                         std::to_string(a.buf) + " + " + std::to_string(a.offset) +
                         " bytes, where its type needs " + std::to_string(alignof(P)) +
                         " (a misaligned address on a GPU)");
        }
        return reinterpret_cast<T>(p);
    } else {
        if (a.kind != 'v' || a.bytes.size() != sizeof(T))
            emu_fail("parameter " + std::to_string(i) + " is a value of " +
                     std::to_string(sizeof(T)) + " bytes, given " + std::to_string(a.bytes.size()));
        T v;
        std::memcpy(&v, a.bytes.data(), sizeof(T));
        return v;
    }
}

using EmuEntry =
    std::function<void(const EmuBuffers&, const std::vector<EmuArg>&, emu_dim3, emu_dim3)>;

template <typename... A, size_t... I>
static void emu_call(void (*f)(A...), const EmuBuffers& b, const std::vector<EmuArg>& a,
                     emu_dim3 grid, emu_dim3 block, std::index_sequence<I...>) {
    // The arguments are unpacked once; every thread calls the kernel with the same values.
    auto args = std::make_tuple(emu_get<A>(b, a[I], I)...);
    // The buffers the launch may write: those of its pointers to non-const and those a struct
    // passed by value points into (their fields' constness is not known here).
    std::vector<bool> written(b.base.size(), false);
    auto mark = [&](auto type, const EmuArg& arg) {
        using T = typename decltype(type)::type;
        if constexpr (std::is_pointer_v<T>) {
            if (!std::is_const_v<std::remove_pointer_t<T>> && arg.kind == 'p') written[arg.buf] = true;
        } else {
            for (size_t r : arg.reaches) written[r] = true;
        }
    };
    (mark(std::type_identity<A>{}, a[I]), ...);
    emu_regions.clear();
    for (size_t i = 0; i < written.size(); ++i)
        if (written[i] && b.sizes[i] > 0) emu_regions.push_back({i, b.base[i], b.sizes[i]});
    emu_launch(grid, block, [&] { std::apply(f, args); });
    emu_regions.clear();
}

template <typename... A> static EmuEntry emu_entry(void (*f)(A...)) {
    return [f](const EmuBuffers& b, const std::vector<EmuArg>& a, emu_dim3 grid, emu_dim3 block) {
        if (a.size() != sizeof...(A))
            emu_fail("the kernel takes " + std::to_string(sizeof...(A)) + " parameters, given " +
                     std::to_string(a.size()));
        emu_call(f, b, a, grid, block, std::index_sequence_for<A...>{});
    };
}

static const std::map<std::string, EmuEntry>& emu_kernels() {
#define EMU_KERNEL(name) {#name, emu_entry(&name)},
#define EMU_BOUNDS(name, ...)
    static const std::map<std::string, EmuEntry> k = {
#include "registry.inc"
    };
#undef EMU_KERNEL
#undef EMU_BOUNDS
    return k;
}

// The kernels' __launch_bounds__ (their most threads a block), where they declare one.
static unsigned emu_first(unsigned b, ...) { return b; }
static const std::map<std::string, unsigned>& emu_bounds() {
#define EMU_KERNEL(name)
#define EMU_BOUNDS(name, ...) {#name, emu_first(__VA_ARGS__)},
    static const std::map<std::string, unsigned> k = {
#include "registry.inc"
    };
#undef EMU_KERNEL
#undef EMU_BOUNDS
    return k;
}

static std::vector<unsigned char> emu_hex(const std::string& h) {
    if (h.size() % 2) emu_fail("odd hex value " + h);
    std::vector<unsigned char> v;
    for (size_t i = 0; i < h.size(); i += 2) v.push_back((unsigned char)std::stoul(h.substr(i, 2), nullptr, 16));
    return v;
}

int main(int argc, char** argv) {
    if (argc != 2) emu_fail("usage: emu DIR");
    std::string dir = argv[1];
    std::ifstream req(dir + "/request.txt");
    std::ifstream in(dir + "/in.bin", std::ios::binary);
    if (!req || !in) emu_fail("cannot open " + dir + "/request.txt and in.bin");
    EmuBuffers b;
    std::string word;
    size_t count = 0;
    if (!(req >> word >> count) || word != "buffers") emu_fail("request: no buffers line");
    for (size_t i = 0; i < count; ++i) {
        size_t n = 0;
        if (!(req >> n)) emu_fail("request: a buffer's size");
        b.storage.emplace_back(n + 192, EMU_CANARY);
        unsigned char* p = b.storage.back().data();
        b.base.push_back(p + (128 - (uintptr_t)p % 64));
        b.sizes.push_back(n);
        if (!in.read(reinterpret_cast<char*>(b.base.back()), (std::streamsize)n))
            emu_fail("in.bin is shorter than the buffers");
    }
    const auto& kernels = emu_kernels();
    while (req >> word) {
        if (word != "launch") emu_fail("request: expected launch, got " + word);
        std::string name;
        emu_dim3 grid, block;
        size_t nargs = 0;
        if (!(req >> name >> grid.x >> grid.y >> block.x >> block.y >> nargs))
            emu_fail("request: a launch");
        grid.z = block.z = 1;
        if (block.x * block.y == 0 || block.x * block.y > 1024)
            emu_fail(name + ": a block of " + std::to_string(block.x * block.y) +
                     " threads (1 to 1024)");
        if (grid.x == 0 || grid.y == 0) emu_fail(name + ": an empty grid (a launch error on a GPU)");
        if (grid.x > 2147483647u || grid.y > 65535u)
            emu_fail(name + ": a grid of " + std::to_string(grid.x) + " x " + std::to_string(grid.y) +
                     " blocks (at most 2^31 - 1 x 65535)");
        if (auto bound = emu_bounds().find(name);
            bound != emu_bounds().end() && block.x * block.y > bound->second)
            emu_fail(name + ": a block of " + std::to_string(block.x * block.y) +
                     " threads past its __launch_bounds__(" + std::to_string(bound->second) + ")");
        auto k = kernels.find(name);
        if (k == kernels.end()) emu_fail("no kernel " + name);
        std::vector<EmuArg> args(nargs);
        for (auto& a : args) {
            std::string kind;
            req >> kind;
            if (kind == "n") {
                a.kind = 'n';
            } else if (kind == "p") {
                a.kind = 'p';
                req >> a.buf >> a.offset;
            } else if (kind == "v") {
                a.kind = 'v';
                std::string hex;
                size_t relocs = 0;
                req >> hex >> relocs;
                a.bytes = emu_hex(hex);
                for (size_t r = 0; r < relocs; ++r) {
                    size_t at = 0, buf = 0, offset = 0;
                    req >> at >> buf >> offset;
                    if (at + 8 > a.bytes.size()) emu_fail("a relocation past its value");
                    unsigned long long addr = (unsigned long long)(uintptr_t)b.at(buf, offset);
                    std::memcpy(a.bytes.data() + at, &addr, 8);
                    a.reaches.push_back(buf);
                }
            } else {
                emu_fail("request: an argument of kind " + kind);
            }
            if (!req) emu_fail("request: the arguments of " + name);
        }
        emu_kernel = name.c_str();
        k->second(b, args, grid, block);
    }
    for (size_t i = 0; i < b.base.size(); ++i) {
        const auto& st = b.storage[i];
        size_t first = (size_t)(b.base[i] - st.data()), last = first + b.sizes[i];
        for (size_t k = 0; k < st.size(); ++k)
            if ((k < first || k >= last) && st[k] != EMU_CANARY)
                emu_fail("buffer " + std::to_string(i) + " was written " +
                         (k < first ? std::to_string(first - k) + " bytes before its start"
                                    : std::to_string(k - last) + " bytes past its end"));
    }
    std::ofstream out(dir + "/out.bin", std::ios::binary);
    for (size_t i = 0; i < b.base.size(); ++i)
        out.write(reinterpret_cast<const char*>(b.base[i]), (std::streamsize)b.sizes[i]);
    if (!out) emu_fail("cannot write out.bin");
    return 0;
}
