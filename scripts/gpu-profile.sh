#!/usr/bin/env bash
# Per-kernel GPU time of `fsdp train --device cuda` at GPT-2 124M width: nsys at 12 layers
# where it is installed, else ncu (clocks locked, caches flushed: compare kernels, not totals)
# at 2 layers, one step. Run on the GPU machine from the folder scripts/gpu-build.sh filled:
#   gpu-bin/gpu-profile.sh   # writes into $OUT (or ./gpu-profile)
set -u
OUT="${OUT:-gpu-profile}"; mkdir -p "$OUT"
B=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/gpu-env.sh
. "$B/gpu-env.sh"
cfg="--n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50304 --batch-size 8"
echo "nsys: $(command -v nsys) ncu: $(command -v ncu)"; ls /usr/local/cuda/bin 2>/dev/null | tr '\n' ' '; echo
if command -v nsys >/dev/null; then
  timeout 150 nsys profile -t cuda -o $OUT/prof $B/fsdp-gpt--release--fsdp train --device cuda --n-layer 12 $cfg --steps 3 > $OUT/nsys.log 2>&1
  timeout 60 nsys stats --report cuda_gpu_kern_sum --format csv -o $OUT/kern $OUT/prof.nsys-rep >> $OUT/nsys.log 2>&1
  rm -f $OUT/prof.nsys-rep $OUT/prof.sqlite
elif command -v ncu >/dev/null; then
  timeout 150 ncu --metrics gpu__time_duration.sum --csv $B/fsdp-gpt--release--fsdp train --device cuda --n-layer 2 $cfg --steps 1 > $OUT/ncu.csv 2>$OUT/ncu.err
fi
ls -la $OUT
