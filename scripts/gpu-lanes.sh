#!/usr/bin/env bash
# Run gpu-check.sh's test binaries in parallel lanes (one GPU, several processes), then the
# timed runs alone, under one deadline: for a short lease of a GPU machine.
#
#   scripts/gpu-lanes.sh [BIN_DIR] [REPORT_DIR] [SECONDS]   # defaults: gpu-bin, $OUT, 540
#
# Each lane is an extended regular expression over the MANIFEST's file names (FSDP_GPU_LANES,
# separated by spaces; default below) that one gpu-check.sh runs, with its own report folder
# and FSDP_GPU_GPT=0. Tests only time out under contention: the timed part (FSDP_GPU_TIMED, a
# gpu-check.sh `FSDP_GPU_ONLY` expression for benchmarks plus its GPT section, default on)
# runs after every lane has ended, and only while the deadline leaves FSDP_GPU_TIMED_NEEDS
# seconds (default 150). Everything is packed into REPORT_DIR/reports.tar.gz (the device tool
# brings back few files) and each lane's report.md is printed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin_dir="$(cd "${1:-gpu-bin}" && pwd)"
out="${2:-${OUT:-gpu-report}}"
budget="${3:-540}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
start=$(date +%s)
lanes="${FSDP_GPU_LANES:-gpu_(nn|gemm|step|attention)$|nvrtc_compile$|kernels--test--gpu$ gpu_gpt$|gpu_golden$ gpu_device_train$ gpu_sharded$|gpu_engine$|engine_on_device$|engine_gpt$|cuda_ring$|device--test--cuda|allocator--test}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
i=0
pids=()
for lane in $lanes; do
    i=$((i + 1))
    mkdir -p "$work/lane$i"
    left=$((budget - ($(date +%s) - start) - 20))
    FSDP_GPU_ONLY="$lane" FSDP_GPU_GPT=0 FSDP_GPU_TIMEOUT="${FSDP_GPU_TIMEOUT:-$left}" \
        "$here/gpu-check.sh" "$bin_dir" "$work/lane$i" >"$work/lane$i/stdout.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "lanes done after $(($(date +%s) - start)) s"
left=$((budget - ($(date +%s) - start)))
if [ "${FSDP_GPU_TIMED:-1}" != 0 ] && [ "$left" -gt "${FSDP_GPU_TIMED_NEEDS:-150}" ]; then
    mkdir -p "$work/timed"
    FSDP_GPU_ONLY="${FSDP_GPU_TIMED_ONLY:-^$}" FSDP_GPU_TIMEOUT=$((left - 15)) \
        timeout $((left - 10)) "$here/gpu-check.sh" "$bin_dir" "$work/timed" \
        >"$work/timed/stdout.log" 2>&1
    echo "timed part done after $(($(date +%s) - start)) s"
fi
tar -C "$work" -czf "$out/reports.tar.gz" .
for r in "$work"/*/report.md; do
    echo "#### $r"
    sed -n '/^| binary/,/^$/p' "$r"
    grep -E 'panicked|FAILED|RESULT|ratio' "$r" | head -n 40
done
