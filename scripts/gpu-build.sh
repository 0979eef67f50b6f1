#!/usr/bin/env bash
# Build every GPU test and bench binary here (no GPU needed) into gpu-bin/ (git-ignored), with
# a MANIFEST that scripts/gpu-check.sh runs on a GPU machine that has no Rust toolchain.
#
#   scripts/gpu-build.sh [OUT_DIR]        # default: gpu-bin
#
# Each binary is stripped of debug information (they travel to the GPU machine); MANIFEST has
# one line per binary: `<file> <test|bench> <what it checks>`.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-bin}"
export CARGO_INCREMENTAL=0 CARGO_TERM_COLOR=never

# package, features, kind (test|bench), target name, what it checks
targets=(
    "fsdp-device|cuda|test|cuda|CUDA streams and events: GPU-side waits, event pool, timeouts"
    "fsdp-device|cuda|test|cuda_buffers|stream-ordered device buffers: round trips, 256 MiB upload vs read race, deferred free"
    "fsdp-kernels||test|gpu|every kernel against its host twin"
    "fsdp-kernels||test|gpu_nn|the GPT layer kernels (layer norm, GELU, softmax, cross-entropy, embeddings, bias grad, bias add, heads split/merge) bitwise vs their twins"
    "fsdp-kernels||test|gpu_attention|fused attention (flash attention on tensor cores, bf16 and f16) forward and backward vs the host twins within 16-bit rounding; a GPT step with Attention::Fused on CUDA vs its twin"
    "fsdp-kernels||test|gpu_gemm|cuBLAS products (Linear forward/backward, attention) vs the f64 definition"
    "fsdp-kernels||test|gpu_gpt|the GPT step (loss, every gradient) on CUDA (kernels + cuBLAS) vs the same code on the host twins; the device trainer's AdamW, sum of squares and scale bitwise; the caching allocator vs the driver's pool bitwise, steady steps served from the cache"
    "fsdp-kernels||test|gpu_step|the end of a step decided on the device (loss_accumulate, step_decide, adamw_decided_f32) bitwise vs their twins; copy_scalars reads the point of the copy"
    "fsdp-kernels||test|nvrtc_compile|every kernel compiles with the machine's NVRTC"
    "fsdp-kernels||test|emulated_elementwise|the emulated tests on the GPU (FSDP_EMULATED_ON=cuda): casts, element-wise kernels, reductions, segments through the launchers' plans, bitwise vs their twins"
    "fsdp-kernels||test|emulated_nn|the emulated tests on the GPU: layer norm, GELU, the column reductions through the plans, bitwise"
    "fsdp-kernels||test|emulated_softmax|the emulated tests on the GPU: softmaxes and cross-entropy through the plans, bitwise"
    "fsdp-kernels||test|emulated_embed_heads|the emulated tests on the GPU: embeddings, bias add, heads split/merge through the plans, bitwise"
    "fsdp-kernels||test|emulated_norm_decide|the emulated tests on the GPU: sums of squares, loss, clip coefficient, the step's decisions through the plans, bitwise"
    "fsdp-kernels||test|emulated_optim|the emulated tests on the GPU: every optimizer, one and many tensors, through the plans, bitwise"
    "fsdp-kernels||test|attention_emulated|the emulated tests on the GPU: the fused attention's plans within the twins' bounds"
    "fsdp-gpt||test|gpu_device_train|fsdp train --device cuda --steps 20 vs --ranks 1 on the CPU: losses within 1e-4; peak memory = fsdp plan --device cuda, the caching allocator's peak within 5% (also with --cpu-offload and --activation-checkpointing); the caching allocator, expandable segments and backend:cudaMallocAsync give the same losses, --memory-snapshot the allocator's segments; --cpu-offload and --activation-checkpointing losses within 1e-6 of the device run (runs fsdp-gpt--bin--fsdp beside it)"
    "fsdp-gpt||test|gpu_golden|fsdp train --device cuda on the golden fixtures: f32 within 1e-4 of PyTorch's golden losses; bf16 within 2·g of PyTorch FSDP2's bf16 curve (runs fsdp-gpt--bin--fsdp, torch_fsdp2_gpt.py and golden/ beside it)"
    "fsdp-gpt||test|gpu_sharded|sharded training on one GPU, ranks as threads (PeerComm over CudaOps): every collective at 2 and 4 ranks equals the host twins bitwise; fsdp train --device cuda --ranks 2|4 --strategy full-shard|no-shard|shard-grad-op vs the engine: losses within 1e-4, each rank's peak the plan's; 2 processes under fsdp launch --device cuda vs the engine; fsdp train --device cuda --engine (the engine's buffers on the GPU, the kernels in place) vs the engine on the CPU at 1, 2, 4 ranks (runs fsdp-gpt--bin--fsdp beside it)"
    "fsdp|cuda|test|gpu_engine|the engine on CUDA (Fsdp::new_on, ComputeDevice::cuda over the CUDA ring, ranks as threads): the tied MLP bitwise the host engine's losses, parameters and schedule, FULL_SHARD/SHARD_GRAD_OP/NO_SHARD at worlds 1, 2, 4, f32 and bf16 parameters with f32 and bf16 reductions, both placements; the division by the data-parallel size; AnyPrecisionAdamW on bf16 shards bitwise; clipping on the device (clip_grad_norm_async) within 1e-12 of the host's norms; the grad scaler with its state on the GPU (fp16, overflowing first scales) bitwise at worlds 1, 2, 4; the device memory all released after"
    "fsdp-gpt||test|engine_on_device|the reference GPT through the engine on CUDA (FsdpGpt over Fsdp::new_on, the GPT on host copies of the device's buffers, the CUDA ring): losses and parameters bitwise the host engine's at worlds 1, 2, 4, f32 and bf16 parameters"
    "fsdp-gpt||test|engine_gpt|the GPT's kernels driven by the engine's hooks (EngineGpt<CudaOps> on the engine's CUDA buffers in place, CudaOps::view; the CUDA ring): losses within 1e-4 of the host twins on the host engine at worlds 1 and 2"
    "fsdp-kernels||bench|kernels_bandwidth|fused AdamW, reduce, cast, norm vs copy bandwidth"
    "fsdp-allocator|cuda|test|cuda|the caching allocator over CUDA memory"
    "fsdp-allocator|cuda|test|cuda_streams|allocator on CUDA streams: stats/snapshot vs host, record_stream vs a busy stream, destroyed streams"
    "fsdp-allocator|cuda|bench|cuda_pairs|allocator cached pair medians on CUDA (plain, record_stream, expandable)"
    "fsdp-collectives|nccl|test|nccl|the NCCL backend against the host reference"
    "fsdp-collectives|nccl|test|nccl_conformance|the conformance suite on NCCL (3 ranks as threads on one GPU)"
    "fsdp-collectives|nccl|test|nccl_stream|NCCL stream ordering: upload race, current stream, abort of every rank"
    "fsdp-collectives|nccl|bench|nccl_all_gather|NCCL all-gather base bandwidth, gaps vs raw NCCL, check cost"
    "fsdp-collectives|cuda|test|cuda_ring|the CUDA ring bitwise against the host ring, worlds 1-4; timeout"
    "fsdp-collectives|cuda|bench|cuda_ring_all_gather|CUDA ring all-gather base vs copy bandwidth"
)

rm -rf "$out"
mkdir -p "$out"
: >"$out/MANIFEST"
for t in "${targets[@]}"; do
    IFS='|' read -r pkg features kind name what <<<"$t"
    args=(-p "$pkg" --no-run --message-format=json)
    [ -n "$features" ] && args+=(--features "$features")
    if [ "$kind" = test ]; then
        args=(test "${args[@]}" --test "$name")
    else
        args=(bench "${args[@]}" --bench "$name")
    fi
    echo "== cargo ${args[*]}" >&2
    exe=$(cargo "${args[@]}" \
        | jq -r --arg n "$name" 'select(.reason == "compiler-artifact" and .target.name == $n
                                         and .executable != null) | .executable' \
        | tail -n 1)
    if [ -z "$exe" ] || [ ! -x "$exe" ]; then
        echo "no executable for $pkg $kind $name" >&2
        exit 1
    fi
    file="${pkg}--${kind}--${name}"
    cp "$exe" "$out/$file"
    strip --strip-debug "$out/$file"
    printf '%s %s %s\n' "$file" "$kind" "$what" >>"$out/MANIFEST"
done
# Copy the program `$2` (a bin target of fsdp-gpt) that `cargo "${@:3}" --message-format=json`
# builds to $out/$1.
gpt_program() {
    local name="$1" target="$2" exe
    shift 2
    exe=$(cargo "$@" --message-format=json \
        | jq -r --arg t "$target" 'select(.reason == "compiler-artifact" and .target.name == $t
                        and (.target.kind | index("bin")) and .executable != null) | .executable' \
        | tail -n 1)
    if [ -z "$exe" ] || [ ! -x "$exe" ]; then
        echo "no executable for the $target program ($*)" >&2
        exit 1
    fi
    cp "$exe" "$out/$name"
    strip --strip-debug "$out/$name"
}
# The `fsdp` program that gpu_device_train runs (it looks for it beside itself): the one cargo
# built with that test (same profile). Not in MANIFEST: gpu-check.sh runs only the tests.
echo "== the fsdp program for gpu_device_train" >&2
gpt_program fsdp-gpt--bin--fsdp fsdp test -p fsdp-gpt --test gpu_device_train --no-run
# The release `fsdp` program for the GPT-2 124M comparison with PyTorch FSDP2 in gpu-check.sh,
# and the release benchmark of the GPT step (124M and 350M: tokens/s, memory, MFU).
echo "== the release fsdp and gpt-device-bench programs (GPT-2 timing)" >&2
gpt_program fsdp-gpt--release--fsdp fsdp build --release -p fsdp-gpt --bin fsdp
gpt_program fsdp-gpt--release--gpt-device-bench gpt-device-bench build --release -p fsdp-gpt \
    --bin gpt-device-bench
cp scripts/gpu-check.sh scripts/gpu-lanes.sh scripts/gpu-env.sh scripts/gpu-profile.sh benches/torch_fsdp2_gpt.py "$out/"
# The golden fixtures gpu_golden reads beside itself.
mkdir -p "$out/golden"
cp crates/gpt/tests/fixtures/{gpt_tiny_init.safetensors,tokens.bin,expected_losses.csv} "$out/golden/"
# The device tool carries at most 64 MiB with the working tree's files: past what they leave
# (less 2 MiB), the symbol tables go too (a panic's backtrace then names addresses, not
# functions), and a folder still too large is an error here rather than a failed carry there.
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
room=$(((64 << 20) - ${tracked:-0} - (2 << 20)))
if [ "$(du -sb "$out" | cut -f1)" -gt "$room" ]; then
    echo "== over $((room >> 20)) MiB: stripping the symbol tables too" >&2
    for f in "$out"/*--*; do strip --strip-all "$f"; done
fi
(cd "$out" && sha256sum -- *--* >SHA256SUMS)
# Still too large: one gzip archive of the folder to carry instead (gpu-pack/, git-ignored),
# unpacked there first; an archive that does not fit either is an error here.
if [ "$(du -sb "$out" | cut -f1)" -gt "$room" ]; then
    mkdir -p gpu-pack
    tar -C "$(dirname "$out")" -czf "gpu-pack/$(basename "$out").tar.gz" "$(basename "$out")"
    packed=$(du -sb gpu-pack | cut -f1)
    if [ "$packed" -gt "$room" ]; then
        echo "error: $out is $(du -sh "$out" | cut -f1) with everything stripped, \
$((packed >> 20)) MiB packed: more than the $((room >> 20)) MiB the device tool carries" >&2
        exit 1
    fi
    echo "== $out is $(du -sh "$out" | cut -f1): carry gpu-pack ($((packed >> 20)) MiB) instead," >&2
    echo "   and there: tar xzf gpu-pack/$(basename "$out").tar.gz && $out/gpu-lanes.sh $out \$OUT 380" >&2
fi
echo "built into $out/ ($(du -sh "$out" | cut -f1)):" >&2
cat "$out/MANIFEST" >&2
