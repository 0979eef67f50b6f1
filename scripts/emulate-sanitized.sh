#!/usr/bin/env bash
# Every emulated kernel test (kernels/tests/emulated_*, attention_emulated) with the emulators
# built under a sanitizer: thread (default: races between a block's threads, a missing
# __syncthreads), address (out-of-bounds reads and writes past the canaries' reach) or
# undefined (CI runs this one: an access misaligned for its type, a signed overflow, a shift past
# a width). A sanitizer's report fails the run, naming the kernel's source line.
#   scripts/emulate-sanitized.sh [thread|address|undefined]
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-thread}"
tests=()
for f in kernels/tests/emulated_*.rs kernels/tests/emulated_*/ kernels/tests/attention_emulated.rs; do
    [ -e "$f" ] || continue
    name="$(basename "${f%.rs}")"
    tests+=(--test "${name%/}")
done
# The sanitized executables are built apart from the plain ones (a directory per sanitizer).
FSDP_EMU_SANITIZE="$kind" TSAN_OPTIONS="halt_on_error=1" ASAN_OPTIONS="halt_on_error=1" \
    cargo test --no-fail-fast -p fsdp-kernels "${tests[@]}" -- --test-threads 1
