#!/usr/bin/env bash
# Run every binary that scripts/gpu-build.sh built, on a GPU machine (no Rust toolchain
# needed), and write a report.
#
#   scripts/gpu-check.sh [BIN_DIR] [REPORT_DIR]   # defaults: gpu-bin, $OUT or gpu-report
#
# NVRTC and NCCL come from the Python packages' site-packages (PyTorch's CUDA wheels:
# nvidia/cu13/lib/libnvrtc.so.13, nvidia/nccl/lib/libnccl.so.2) when they are not on the
# loader path: their folders go on LD_LIBRARY_PATH, FSDP_NVRTC_LIB names NVRTC, and a
# temporary folder holds a `libnccl.so` link (cudarc opens NCCL by that name, the wheel ships
# only libnccl.so.2). Each binary runs with a timeout (FSDP_GPU_TIMEOUT seconds, default 240);
# its output goes to REPORT_DIR/<binary>.log and a summary to REPORT_DIR/report.md.
# fsdp-gpt--test--gpu_device_train runs the `fsdp` program copied beside it
# (fsdp-gpt--bin--fsdp: `fsdp train --device cuda` vs `--ranks 1`), with this script's
# FSDP_NVRTC_LIB and LD_LIBRARY_PATH. FSDP_GPU_ONLY (an extended regular expression) runs only
# the MANIFEST's binaries whose file names match it, e.g. FSDP_GPU_ONLY='gpu_(step|nn)$'.
# FSDP_GPU_DEADLINE (seconds since the epoch, gpu-lanes.sh sets it) shortens every timeout to
# end by then, and skips what would start with under 5 s left (a row says so).
set -uo pipefail
bin_dir="$(cd "${1:-gpu-bin}" && pwd)"
if [ ! -f "$bin_dir/MANIFEST" ]; then
    echo "gpu-check.sh: no MANIFEST in $bin_dir: pass the folder scripts/gpu-build.sh made" >&2
    exit 2
fi
report="${2:-${OUT:-gpu-report}}"
mkdir -p "$report"
report="$(cd "$report" && pwd)"
# The emulated kernel tests (fsdp-kernels--test--emulated_*, attention_emulated) run their
# launchers' plans on the GPU rather than on the host emulator.
export FSDP_EMULATED_ON=cuda
limit="${FSDP_GPU_TIMEOUT:-240}"
only="${FSDP_GPU_ONLY:-}"
deadline="${FSDP_GPU_DEADLINE:-0}"
# The timeout of the next run: FSDP_GPU_TIMEOUT, or less to end by the deadline (0: no time).
budget() {
    local t=$limit
    if [ "$deadline" -gt 0 ]; then
        local left=$((deadline - $(date +%s)))
        [ "$left" -lt "$t" ] && t=$left
        [ "$t" -lt 5 ] && t=0
    fi
    echo "$t"
}

# NVRTC and NCCL on the loader path: sets nvrtc, nccl, FSDP_NVRTC_LIB and LD_LIBRARY_PATH.
# shellcheck source=scripts/gpu-env.sh
. "$(dirname "$0")/gpu-env.sh"

{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
    echo "NVRTC: ${nvrtc:-not found}"
    echo "NCCL:  ${nccl:-not found}"
    echo '```'
    echo
    echo "| binary | exit | seconds | result | skipped |"
    echo "| --- | --- | --- | --- | --- |"
} >"$report/report.md"

failed=0
while read -r file kind what; do
    [ -z "$file" ] && continue
    [ -n "$only" ] && ! [[ $file =~ $only ]] && continue
    args=()
    if [ "$kind" = test ]; then args=(--nocapture --test-threads=1); else args=(--bench); fi
    echo "== $file ($what)"
    t=$(budget)
    if [ "$t" = 0 ]; then
        echo "| $file | - | 0 | not run: out of time | |" >>"$report/report.md"
        continue
    fi
    start=$(date +%s%N)
    (cd "$bin_dir" && timeout "$t" "./$file" "${args[@]}") >"$report/$file.log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - start) / 1000000))
    secs="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
    result=$(grep -E '^test result:' "$report/$file.log" | tail -n 1 | cut -c14-60)
    [ -z "$result" ] && result=$(tail -n 1 "$report/$file.log" | cut -c1-60)
    skipped=$(grep -c 'skipped' "$report/$file.log")
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    echo "| $file | $rc | $secs | $result | $skipped |" >>"$report/report.md"
    tail -n 3 "$report/$file.log"
done <"$bin_dir/MANIFEST"

# GPT-2 124M (12 layers, 12 heads, 768 wide, 1024 tokens, vocab 50304), world 1, batch 8:
# `fsdp train --device cuda` (the release program; f32, and bf16 products) and, when
# this machine's Python has torch with CUDA, PyTorch FSDP2 (benches/torch_fsdp2_gpt.py) on the
# same GPU at f32 (the like-for-like figure) and bf16 (the gate's baseline), eager; with
# FSDP_GPU_COMPILE=1 also bf16 under torch.compile. Step times are medians after warm-up.
# FSDP_GPU_GPT=0 leaves this part out.
# FSDP_GPU_GPT_DTYPES (default "f32 bf16") chooses the 124M runs of both.
gpt_steps="${FSDP_GPU_GPT_STEPS:-10}"
gpt="${FSDP_GPU_GPT:-1}"
gpt_dtypes="${FSDP_GPU_GPT_DTYPES:-f32 bf16}"
# FSDP_GPU_RUNS (an extended regular expression, default all) picks this part's runs by the
# names of their logs, e.g. FSDP_GPU_RUNS='^(gpt_device_bench|torch_fsdp2_gpt_.*_bf16)$'.
picked() { [[ $1 =~ ${FSDP_GPU_RUNS:-.} ]]; }
if [ "$gpt" = 1 ] && [ -x "$bin_dir/fsdp-gpt--release--fsdp" ]; then
    for dtype in $gpt_dtypes; do
        picked "fsdp_gpt124m_$dtype" || continue
        echo "== fsdp train --device cuda, GPT-2 124M, --param-dtype $dtype (release)"
        log="$report/fsdp_gpt124m_$dtype.log"
        csv="$report/fsdp_gpt124m_$dtype.csv"
        trace="$report/fsdp_gpt124m_$dtype.trace.json"
        t=$(budget)
        [ "$t" = 0 ] && { echo "| fsdp_gpt124m_$dtype | - | | not run: out of time | |" >>"$report/report.md"; continue; }
        timeout "$t" "$bin_dir/fsdp-gpt--release--fsdp" train --device cuda --n-layer 12 \
            --n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50304 --batch-size 8 \
            --param-dtype "$dtype" --steps "$gpt_steps" --loss-log "$csv" --trace "$trace" \
            >"$log" 2>&1
        rc=$?
        [ "$rc" -ne 0 ] && failed=$((failed + 1))
        # The loss log's third column is each step's tokens/s; the first two steps warm up.
        med=$(python3 -c 'import csv,statistics,sys
rows=[r for r in csv.reader(open(sys.argv[1])) if r and r[0].isdigit()][2:]
t=statistics.median(float(r[2]) for r in rows)
print(f"median step {8*1024/t*1e3:.2f} ms, {t:,.0f} tokens/s")' "$csv" 2>/dev/null)
        echo "| fsdp train --device cuda 124M $dtype | $rc | | ${med:-$(tail -n 1 "$log" | cut -c1-60)} | |" \
            >>"$report/report.md"
        echo "RESULT fsdp 124m $dtype: $med"
        tail -n 2 "$log"
        # The trace's median time of each part of a step after the first two (device time).
        python3 -c 'import json,statistics,sys,collections
ev=[e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["ph"]=="X"]
first=min(e["args"]["step"] for e in ev)
parts=collections.defaultdict(list)
for e in ev:
    if e["args"]["step"]>=first+2: parts[e["name"]].append(e["dur"]/1e3)
for n,d in parts.items(): print(f"  {n}: median {statistics.median(d):.3f} ms")' "$trace" 2>&1 |
            tee "$report/fsdp_gpt124m_$dtype.parts.txt"
    done
fi
# The benchmarks' runs, with this section's batch, steps and warm-up: the log, then the
# arguments; bench_rows adds a report row per RESULT line of a gpt-device-bench log.
device_bench() {
    local log=$1
    shift
    picked "$(basename "$log" .log)" || { : >"$log"; return 0; }
    local t
    t=$(budget)
    [ "$t" = 0 ] && { echo "not run: out of time" >"$log"; return 124; }
    timeout "$t" "$bin_dir/fsdp-gpt--release--gpt-device-bench" --steps "$gpt_steps" \
        --warmup 3 "$@" >"$log" 2>&1
}
torch_bench() {
    local log=$1
    shift
    picked "$(basename "$log" .log)" || { : >"$log"; return 0; }
    local t
    t=$(budget)
    [ "$t" = 0 ] && { echo "not run: out of time" >"$log"; return 124; }
    timeout "$t" python3 "$bin_dir/torch_fsdp2_gpt.py" --device cuda --batch 8 \
        --steps "$gpt_steps" --warmup 3 "$@" >"$log" 2>&1
}
bench_rows() { # log, exit status, label
    grep RESULT "$1" | while read -r line; do
        echo "| $3 | $2 | | ${line#RESULT } | |" >>"$report/report.md"
    done
}
have_bench=0
[ "$gpt" = 1 ] && [ -x "$bin_dir/fsdp-gpt--release--gpt-device-bench" ] && have_bench=1
have_torch=0
[ "$gpt" = 1 ] && [ -f "$bin_dir/torch_fsdp2_gpt.py" ] &&
    python3 -c 'import torch,sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null &&
    have_torch=1
# The GPT step benchmark: GPT-2 124M and 350M, world 1, bf16 products, batch 8: median step,
# tokens/s, peak memory, MFU against the dense bf16 peak and a measured 8192³ bf16 GEMM.
if [ "$have_bench" = 1 ]; then
    echo "== gpt-device-bench 124m,350m bf16 (release)"
    log="$report/gpt_device_bench.log"
    device_bench "$log" --model 124m,350m
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" gpt-device-bench
    cat "$log"
    # The attention's probabilities kept and the logits whole (the baseline of the chunks).
    log="$report/gpt_device_bench_materialized.log"
    device_bench "$log" --model 124m,350m --attention materialized --logits whole
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --attention materialized --logits whole"
    cat "$log"
    # Fused attention (flash attention on tensor cores): no t × t matrix, one forward and
    # three backward kernels a block instead of batched products and softmaxes.
    log="$report/gpt_device_bench_fused.log"
    device_bench "$log" --model 124m,350m --attention fused
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --attention fused"
    cat "$log"
    # Larger attention chunks (fewer, larger products and softmaxes; more memory): where
    # between the default's 64 MiB and materialized the step time goes.
    for mib in 256 1024; do
        log="$report/gpt_device_bench_attention$mib.log"
        device_bench "$log" --model 124m,350m --attention "chunked:$mib"
        rc=$?
        [ "$rc" -ne 0 ] && failed=$((failed + 1))
        bench_rows "$log" "$rc" "gpt-device-bench --attention chunked:$mib"
        cat "$log"
    done
    # The buffers from the driver's stream-ordered pool instead of the caching allocator
    # (the default), at 124M: the allocator's cost or gain on the step.
    log="$report/gpt_device_bench_driver_pool.log"
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync device_bench "$log" --model 124m
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench (backend:cudaMallocAsync)"
    cat "$log"
    # f16 products with the grad scaler (its scale on the device, the seed scaled, AdamW
    # unscaling) at 124M: against the bf16 step above.
    log="$report/gpt_device_bench_f16.log"
    device_bench "$log" --model 124m --products f16
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --products f16"
    cat "$log"
    # The cost of activation checkpointing (one more forward of each block) at 124M.
    log="$report/gpt_device_bench_ckpt.log"
    device_bench "$log" --model 124m --activation-checkpointing
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --activation-checkpointing"
    cat "$log"
    # The same model through the fsdp engine (EngineGpt: the kernels driven by the engine's
    # hooks, FULL_SHARD at world 1, the buffers on the GPU) against the device trainer's step.
    log="$report/gpt_device_bench_engine.log"
    device_bench "$log" --model 124m --engine
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --engine"
    cat "$log"
    # The baseline of the one-late reads: the host waiting for every step's outcome.
    log="$report/gpt_device_bench_wait.log"
    device_bench "$log" --model 124m --wait-each-step
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --wait-each-step"
    cat "$log"
    # Worlds 2 and 4 as threads on the one GPU (PeerComm), the same global batch: rank 0's
    # step against the world-1 step measured in the same run (issue 16's aim: at most 1.1).
    for ranks in 2 4; do
        log="$report/gpt_device_bench_ranks$ranks.log"
        device_bench "$log" --model 124m --ranks "$ranks" --strategy full-shard
        rc=$?
        [ "$rc" -ne 0 ] && failed=$((failed + 1))
        bench_rows "$log" "$rc" "gpt-device-bench --ranks $ranks"
        cat "$log"
    done
    # The same at 2 ranks with the gradients reduced in bf16 (half the bytes each rank reads).
    log="$report/gpt_device_bench_ranks2_bf16.log"
    device_bench "$log" --model 124m --ranks 2 --strategy full-shard --reduce-dtype bf16
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --ranks 2 --reduce-dtype bf16"
    cat "$log"
    # Pure bf16 (AnyPrecisionAdamW: bf16 moments and compensation, bf16 parameter values): the
    # optimizer kernel's step at world 1, and at 2 ranks the units all-gathered in bf16.
    log="$report/gpt_device_bench_anyprecision.log"
    device_bench "$log" --model 124m --ranks 2 --strategy full-shard --optimizer anyprecision-adamw
    rc=$?
    [ "$rc" -ne 0 ] && failed=$((failed + 1))
    bench_rows "$log" "$rc" "gpt-device-bench --ranks 2 --optimizer anyprecision-adamw"
    cat "$log"
fi
if [ "$have_torch" = 1 ]; then
    runs=()
    for dtype in $gpt_dtypes; do runs+=("124m $dtype"); done
    runs+=("350m bf16")
    [ "${FSDP_GPU_COMPILE:-0}" = 1 ] && runs+=("124m bf16 --compile" "350m bf16 --compile")
    for run in "${runs[@]}"; do
        read -r model dtype extra <<<"$run"
        echo "== torch_fsdp2_gpt.py --model $model --param-dtype $dtype $extra (PyTorch FSDP2)"
        log="$report/torch_fsdp2_gpt_${model}_${dtype}${extra:+_compile}.log"
        torch_bench "$log" --model "$model" --param-dtype "$dtype" $extra
        echo "| torch_fsdp2_gpt.py $model $dtype $extra | $? | | $(grep -m1 -o 'median step.*' "$log" | cut -c1-60) | |" \
            >>"$report/report.md"
        tail -n 2 "$log"
    done
fi
# The gate's figure, ours / PyTorch FSDP2 eager at bf16, world 1, from rounds that each run
# gpt-device-bench and then PyTorch at 124M and 350M: the runs above are round 1, and
# FSDP_GPU_ROUNDS=R (default 1) adds rounds 2..R. PyTorch eager's step varies between runs
# (60 to 78 ms at 124M on one H200), so the report gives each round's ratio and their median.
rounds="${FSDP_GPU_ROUNDS:-1}"
if [ "$have_bench" = 1 ] && [ "$have_torch" = 1 ]; then
    for ((r = 2; r <= rounds; r++)); do
        echo "== round $r: gpt-device-bench, then PyTorch FSDP2 124m and 350m bf16"
        device_bench "$report/gpt_device_bench_r$r.log" --model 124m,350m
        for model in 124m 350m; do
            torch_bench "$report/torch_fsdp2_gpt_${model}_bf16_r$r.log" --model "$model" \
                --param-dtype bf16
        done
    done
    python3 - "$report" "$rounds" >>"$report/report.md" <<'PY'
import re, statistics, sys
report, rounds = sys.argv[1], int(sys.argv[2])
def ms(path, pattern):
    try:
        m = re.search(pattern, open(path).read())
        return float(m.group(1)) if m else None
    except OSError:
        return None
print("\n## Ours / PyTorch FSDP2 eager, bf16, world 1 (the gate: <= 1.0)\n")
print("| round | model | ours ms | PyTorch ms | ratio |\n| --- | --- | --- | --- | --- |")
ratios = {"124m": [], "350m": []}
for r in range(1, rounds + 1):
    tail = "" if r == 1 else f"_r{r}"
    for model in ratios:
        ours = ms(f"{report}/gpt_device_bench{tail}.log",
                  rf"RESULT gpt-device-bench {model} bf16 attention chunked[^:]*: median step ([0-9.]+) ms")
        torch = ms(f"{report}/torch_fsdp2_gpt_{model}_bf16{tail}.log", r"median step ([0-9.]+) ms")
        ratio = ours / torch if ours and torch else None
        if ratio:
            ratios[model].append(ratio)
        print(f"| {r} | {model} | {ours} | {torch} | {ratio and round(ratio, 3)} |")
        if r == 1:
            fused = ms(f"{report}/gpt_device_bench_fused.log",
                       rf"RESULT gpt-device-bench {model} bf16 attention fused[^:]*: median step ([0-9.]+) ms")
            fr = fused / torch if fused and torch else None
            print(f"| {r} | {model}, --attention fused | {fused} | {torch} | {fr and round(fr, 3)} |")
for model, rs in ratios.items():
    if rs:
        print(f"\nRESULT gate {model}: median ratio {statistics.median(rs):.3f} over {len(rs)} rounds")
PY
fi

{
    echo
    echo "$failed binaries failed. Logs: one per binary beside this file."
    echo
    echo "## Skips, figures and failures"
    echo '```'
    grep -hE 'skipped|GB/s|ulps|µs|us/|busbw|panicked|FAILED|RESULT' "$report"/*.log | head -n 200
    echo '```'
} >>"$report/report.md"
cat "$report/report.md"
[ "$failed" -eq 0 ]
