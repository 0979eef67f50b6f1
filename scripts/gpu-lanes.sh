#!/usr/bin/env bash
# Run gpu-check.sh's test binaries in parallel lanes (one GPU, several processes), then the
# timed runs alone, under one deadline: for a short lease of a GPU machine.
#
#   gpu-bin/gpu-lanes.sh [BIN_DIR] [REPORT_DIR] [SECONDS]   # defaults: this script's folder
#                                                           # (gpu-bin), $OUT, 540
#
# BIN_DIR is the folder scripts/gpu-build.sh made (it holds MANIFEST); a folder without one
# (e.g. the repository's root) falls back to this script's own folder when that has one.
# Each lane is an extended regular expression over the MANIFEST's file names (FSDP_GPU_LANES,
# separated by spaces; default below) that one gpu-check.sh runs, with its own report folder
# and FSDP_GPU_GPT=0. Every run of every lane ends by the deadline (FSDP_GPU_DEADLINE, which
# gpu-check.sh honours: what would start with under 5 s left is listed as not run). The timed
# part (on unless FSDP_GPU_TIMED=0: the benchmarks matching FSDP_GPU_TIMED_ONLY, default none,
# and gpu-check.sh's GPT section limited to FSDP_GPU_RUNS, default the gate's runs —
# gpt-device-bench at 124M and 350M and PyTorch FSDP2 bf16 at both, then the gate's table)
# runs after every lane has ended, while the deadline leaves FSDP_GPU_TIMED_NEEDS seconds
# (default 150). NVRTC, NCCL and ptxas are looked up once (gpu-env.sh) for every lane. After
# each lane ends its table is printed and REPORT_DIR/reports.tar.gz is rewritten with
# everything so far (the device tool brings back few files, and a run cut short keeps what
# finished).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin_dir="${1:-$here}"
if [ ! -f "$bin_dir/MANIFEST" ]; then
    if [ -f "$here/MANIFEST" ]; then
        echo "gpu-lanes.sh: no MANIFEST in $bin_dir: using $here" >&2
        bin_dir="$here"
    else
        echo "gpu-lanes.sh: no MANIFEST in $bin_dir or $here: run scripts/gpu-build.sh" >&2
        exit 2
    fi
fi
bin_dir="$(cd "$bin_dir" && pwd)"
out="${2:-${OUT:-gpu-report}}"
budget="${3:-540}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
start=$(date +%s)
export FSDP_GPU_DEADLINE=$((start + budget - 10))
# NVRTC, NCCL and ptxas once, exported to every lane.
# shellcheck source=scripts/gpu-env.sh
. "$here/gpu-env.sh"
lanes="${FSDP_GPU_LANES:-gpu_(nn|gemm|step|attention)$|nvrtc_compile$|kernels--test--gpu$ emulated_|attention_emulated$ gpu_gpt$|gpu_golden$ gpu_device_train$ gpu_sharded$|gpu_engine$|engine_on_device$|engine_gpt$|cuda_ring$|device--test--cuda|allocator--test collectives--test--nccl}"
work="$(mktemp -d)"
trap 'rm -rf "$work" "$links"' EXIT
pack() { tar -C "$work" -czf "$out/reports.tar.gz.part" . && mv "$out/reports.tar.gz.part" "$out/reports.tar.gz"; }
show() { # a report.md
    echo "#### $1 ($(($(date +%s) - start)) s)"
    sed -n '/^| binary/,/^$/p' "$1"
    grep -E 'panicked|FAILED|RESULT|ratio' "$1" | head -n 40
}
i=0
pids=()
for lane in $lanes; do
    i=$((i + 1))
    mkdir -p "$work/lane$i"
    FSDP_GPU_ONLY="$lane" FSDP_GPU_GPT=0 FSDP_GPU_TIMEOUT="${FSDP_GPU_TIMEOUT:-$budget}" \
        "$here/gpu-check.sh" "$bin_dir" "$work/lane$i" >"$work/lane$i/stdout.log" 2>&1 &
    pids+=($!)
done
i=0
for p in "${pids[@]}"; do
    i=$((i + 1))
    wait "$p"
    pack
    show "$work/lane$i/report.md"
done
echo "lanes done after $(($(date +%s) - start)) s"
left=$((FSDP_GPU_DEADLINE - $(date +%s)))
if [ "${FSDP_GPU_TIMED:-1}" != 0 ] && [ "$left" -gt "${FSDP_GPU_TIMED_NEEDS:-150}" ]; then
    mkdir -p "$work/timed"
    FSDP_GPU_ONLY="${FSDP_GPU_TIMED_ONLY:-^$}" \
        FSDP_GPU_RUNS="${FSDP_GPU_RUNS:-^(gpt_device_bench|torch_fsdp2_gpt_(124m|350m)_bf16)$}" \
        FSDP_GPU_TIMEOUT="$left" "$here/gpu-check.sh" "$bin_dir" "$work/timed" \
        >"$work/timed/stdout.log" 2>&1
    echo "timed part done after $(($(date +%s) - start)) s"
    pack
    show "$work/timed/report.md"
fi
pack
