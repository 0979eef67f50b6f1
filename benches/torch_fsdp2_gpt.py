#!/usr/bin/env python3
"""PyTorch FSDP2 training the reference GPT (nanoGPT layout): the baseline of `fsdp train`.

The model is the project's reference GPT (crates/gpt): Linear y = x·Wᵀ + b, LayerNorm eps 1e-5,
GELU exact (erf), causal attention with scale 1/sqrt(head_dim) (here through
`scaled_dot_product_attention`, flash on a GPU), heads split from `c_attn`'s output as q, k, v,
the head tied to `wte`, mean cross-entropy over every token. FSDP2 as torchtitan's recipes:
`fully_shard` on each block and on the root, `MixedPrecisionPolicy(param_dtype, reduce_dtype)`,
AdamW (fused on CUDA; lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every
parameter, as the golden reference), eager or `--compile`.

Prints one human-readable block and one JSON line (`RESULT {...}`): median step time, tokens/s,
peak memory, and MFU against the GPU's dense bf16 peak and against a large bf16 GEMM measured in
the same run. Model FLOPs per token (nanoGPT's estimate): 6·N, N the parameters without the
position embedding (wte, counted once, stands for the tied head's product), plus attention
12·L·T·E.

Runs alone (world 1: a process group of one is created) or under torchrun:

    python benches/torch_fsdp2_gpt.py --model 124m --device cuda --steps 30
    torchrun --nproc-per-node 2 benches/torch_fsdp2_gpt.py --model 124m --device cuda
    # parity check on the CPU against the golden losses (f32, world 1):
    python benches/torch_fsdp2_gpt.py --model tiny --device cpu --param-dtype f32 \
        --init crates/gpt/tests/fixtures/gpt_tiny_init.safetensors \
        --tokens crates/gpt/tests/fixtures/tokens.bin --batch 8 --seq 16 --steps 10 --loss-csv -
"""

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MODELS = {
    # name: (n_layer, n_head, n_embd, block_size, vocab)
    "tiny": (2, 2, 32, 16, 96),
    "124m": (12, 12, 768, 1024, 50304),
    "350m": (24, 16, 1024, 1024, 50304),
}

# Dense bf16 peaks (TFLOP/s, without sparsity) by device name.
BF16_PEAK_TFLOPS = [("H200", 989.4), ("H100 SXM", 989.4), ("H100 PCIe", 756.0),
                    ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0)]

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class Block(nn.Module):
    def __init__(self, n_head, n_embd):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        b, t, e = x.shape
        h = self.ln_1(x)
        q, k, v = self.attn.c_attn(h).split(e, dim=2)
        q, k, v = (z.view(b, t, self.n_head, e // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).contiguous().view(b, t, e))
        x = x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="none"))
        return x


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, n_embd)
        self.transformer.wpe = nn.Embedding(block_size, n_embd)
        self.transformer.h = nn.ModuleList(Block(n_head, n_embd) for _ in range(n_layer))
        self.transformer.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        t = idx.shape[1]
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(t, device=idx.device))
        for block in tr.h:
            x = block(x)
        logits = F.linear(tr.ln_f(x), tr.wte.weight)  # the head is tied to wte
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def read_safetensors(path):
    """The tensors of a safetensors file (its format is an 8-byte header length, a JSON header
    and the raw little-endian data; read here so that the script needs torch alone)."""
    kinds = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F64": torch.float64, "I64": torch.int64}
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        data = bytearray(raw[8 + n + lo:8 + n + hi])
        out[name] = torch.frombuffer(data, dtype=kinds[meta["dtype"]]).reshape(meta["shape"])
    return out


def load_init(model, path):
    tensors = read_safetensors(path)
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(tensors))
    if missing:
        sys.exit(f"error: {path} lacks {missing}")
    with torch.no_grad():
        for name, p in own.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                sys.exit(f"error: {name} is {tuple(tensors[name].shape)} in {path}, "
                         f"the model wants {tuple(p.shape)}")
            p.copy_(tensors[name])


def batches(args, vocab, device, rank, world):
    """Global batch k: B rows (this rank's B/world of them); with --tokens, row j starts at token
    ((k·B + j)·T) mod (L − T − 1) as the golden reference; else seeded random tokens."""
    b, t = args.batch, args.seq
    if b % world:
        sys.exit(f"error: --batch {b} is not a multiple of the world size {world}")
    rows = range(rank * (b // world), (rank + 1) * (b // world))
    if args.tokens:
        with open(args.tokens, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint16).to(torch.int64)
        span = data.numel() - t - 1
        k = 0
        while True:
            starts = [((k * b + j) * t) % span for j in rows]
            x = torch.stack([data[s:s + t] for s in starts])
            y = torch.stack([data[s + 1:s + 1 + t] for s in starts])
            yield x.to(device), y.to(device)
            k += 1
    gen = torch.Generator().manual_seed(1234 + rank)
    while True:
        xy = torch.randint(0, vocab, (b // world, t + 1), generator=gen)
        yield xy[:, :-1].to(device), xy[:, 1:].to(device)


def gemm_tflops(device, n=8192, reps=20):
    """Measured bf16 GEMM throughput (TFLOP/s) of an n×n×n product, median of reps."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def init_distributed(device):
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="124m")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default block size)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="f32")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--init", help="initial weights (safetensors, nanoGPT names)")
    p.add_argument("--tokens", help="nanoGPT-format token file (little-endian u16)")
    p.add_argument("--loss-csv", help="write step,loss to this file ('-': stdout)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak (default: by GPU name)")
    args = p.parse_args()

    n_layer, n_head, n_embd, block, vocab = MODELS[args.model]
    args.seq = args.seq or block
    if args.seq > block:
        sys.exit(f"error: --seq {args.seq} exceeds the model's block size {block}")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: --device cuda but torch sees no GPU")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", device.index if device.index is not None else local)
        torch.cuda.set_device(device)
    rank, world = init_distributed(device)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(n_layer, n_head, n_embd, block, vocab)
    if args.init:
        load_init(model, args.init)
    n_params = sum(p.numel() for p in model.parameters())
    n_flop_params = n_params - model.transformer.wpe.weight.numel()
    model.to(device)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[args.param_dtype],
                              reduce_dtype=DTYPES[args.reduce_dtype])
    for i, blk in enumerate(model.transformer.h):
        if args.compile:
            model.transformer.h[i] = blk = torch.compile(blk)
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=device.type == "cuda")
    data = batches(args, vocab, device, rank, world)

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for step in range(args.steps):
        x, y = next(data)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The mean over ranks of the local means: the global batch's loss.
        val = loss.detach().clone()
        dist.all_reduce(val, op=dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM)
        if not cuda:
            val /= world
        losses.append(val.item())  # the read synchronises, so the step time is the real one
        times.append(time.perf_counter() - t0)

    tokens = args.batch * args.seq
    timed = times[args.warmup:] or times
    step_s = statistics.median(timed)
    # Model FLOPs per token as nanoGPT's estimate: 6 per parameter without the position
    # embedding (a lookup; wte counts once and stands for the tied head's product), plus
    # attention.
    flops_per_token = 6 * n_flop_params + 12 * n_layer * args.seq * n_embd
    result = {
        "model": args.model, "world": world, "device": str(device), "batch": args.batch,
        "seq": args.seq, "param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype,
        "compile": args.compile, "params": n_params, "steps": args.steps,
        "step_s_median": step_s, "tokens_per_s": tokens / step_s,
        "final_loss": losses[-1],
        "torch": torch.__version__,
    }
    if cuda:
        name = torch.cuda.get_device_name(device)
        peak = args.peak_tflops or next((v for k, v in BF16_PEAK_TFLOPS if k in name), None)
        achieved = flops_per_token * tokens / step_s / world / 1e12  # per GPU
        result.update(gpu=name, peak_mem_bytes=torch.cuda.max_memory_allocated(device),
                      achieved_tflops_per_gpu=achieved)
        result["gemm_tflops"] = gemm_tflops(device)
        result["mfu_vs_gemm"] = achieved / result["gemm_tflops"]
        if peak:
            result["mfu_vs_peak"] = achieved / peak
    if rank == 0:
        if args.loss_csv:
            out = sys.stdout if args.loss_csv == "-" else open(args.loss_csv, "w")
            out.write("step,loss\n")
            for i, v in enumerate(losses):
                out.write(f"{i},{v:.9g}\n")
            if out is not sys.stdout:
                out.close()
        print(f"PyTorch {torch.__version__} FSDP2 {args.model} world {world} on {device}: "
              f"median step {step_s * 1e3:.2f} ms, {tokens / step_s:,.0f} tokens/s"
              + (f", peak {result['peak_mem_bytes'] / 2**30:.2f} GiB, MFU "
                 f"{result.get('mfu_vs_peak', float('nan')):.1%} of peak, "
                 f"{result['mfu_vs_gemm']:.1%} of a measured bf16 GEMM"
                 f" ({result['gemm_tflops']:.0f} TFLOP/s)" if cuda else ""))
        print("RESULT " + json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
