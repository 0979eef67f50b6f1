# Sourced by gpu-check.sh and gpu-profile.sh on a GPU machine: finds NVRTC and NCCL under the
# Python packages' site-packages (PyTorch's CUDA wheels: nvidia/cu13/lib/libnvrtc.so.13,
# nvidia/nccl/lib/libnccl.so.2) when they are not on the loader path, puts their folders on
# LD_LIBRARY_PATH, names NVRTC in FSDP_NVRTC_LIB, and makes a temporary folder with a
# `libnccl.so` link (cudarc opens NCCL by that name; the wheel ships only libnccl.so.2),
# removed at exit. Sets `nvrtc` and `nccl` to the paths found (empty when not found), and
# exports them (FSDP_NVRTC_LIB, FSDP_NCCL_LIB) so that a script it starts does not search
# again; FSDP_PTXAS names ptxas when it is on the path or in /usr/local/cuda (the NVRTC
# tests assemble every kernel with it).
sites=""
if command -v python3 >/dev/null 2>&1; then
    sites=$(python3 -c 'import site,sys
p=[]
try: p=site.getsitepackages()+[site.getusersitepackages()]
except Exception: pass
print("\n".join(p+sys.path))' 2>/dev/null)
fi
find_lib() { # $1: file name
    local s f
    for s in $sites; do
        for f in "$s"/nvidia/*/lib/"$1"; do
            [ -f "$f" ] && { echo "$f"; return 0; }
        done
    done
    timeout 60 find / -xdev -name "$1" -path '*nvidia*' 2>/dev/null | head -n 1
}
if [ -n "${FSDP_GPU_LIBS_SEARCHED:-}" ]; then
    # A parent script searched already (gpu-lanes.sh): what it found, or nothing.
    nvrtc="${FSDP_NVRTC_LIB:-}"
    nccl="${FSDP_NCCL_LIB:-}"
else
    nvrtc="${FSDP_NVRTC_LIB:-$(find_lib libnvrtc.so.13)}"
    nccl="${FSDP_NCCL_LIB:-$(find_lib libnccl.so.2)}"
    export FSDP_GPU_LIBS_SEARCHED=1
fi
links="$(mktemp -d)"
trap 'rm -rf "$links"' EXIT
ld="$links"
if [ -n "$nccl" ]; then
    ln -s "$nccl" "$links/libnccl.so"
    ld="$ld:$(dirname "$nccl")"
fi
if [ -n "$nvrtc" ]; then
    export FSDP_NVRTC_LIB="$nvrtc"
    ld="$ld:$(dirname "$nvrtc")"
fi
[ -n "$nccl" ] && export FSDP_NCCL_LIB="$nccl"
if [ -z "${FSDP_PTXAS:-}" ]; then
    ptxas="$(command -v ptxas || true)"
    [ -z "$ptxas" ] && [ -x /usr/local/cuda/bin/ptxas ] && ptxas=/usr/local/cuda/bin/ptxas
    [ -n "$ptxas" ] && export FSDP_PTXAS="$ptxas"
fi
export LD_LIBRARY_PATH="$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
