"""Golden values for `crates/fsdp/tests/any_precision/bitwise.rs` (`steps_are_bitwise_pytorch_cpu`).

Runs torchdistx's AnyPrecisionAdamW update (the sequence of in-place tensor operations of its
`step`, for one parameter) on PyTorch CPU tensors and prints, as JSON, each case's settings, the
starting parameter, the f32 gradients of every step and the parameter and state after every
step, all as raw bit patterns. Regenerate with

    python3 torch_golden.py > torch.json

(needs `torch`; the committed file came from PyTorch 2.15.0 on an AVX512 CPU). The optimizer
is re-stated here so that the script needs nothing but torch.
"""

import json
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def update(param, grad, st, cfg):
    """One AnyPrecisionAdamW step of `param` (in place), torchdistx's operations in order."""
    lr, wd, eps = cfg["lr"], cfg["weight_decay"], cfg["eps"]
    b1, b2 = cfg["beta1"], cfg["beta2"]
    st["step"] += 1  # a float32 tensor, as torchdistx keeps it
    n = st["step"]
    if wd:
        param.mul_(1 - lr * wd)
    st["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
    st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
    step_size = lr / (1 - b1**n)
    denom = (st["exp_avg_sq"].sqrt() / (1 - b2**n) ** 0.5).add_(eps, alpha=1)
    if cfg["kahan"]:
        comp = st["compensation"]
        comp.addcdiv_(st["exp_avg"], denom, value=-step_size)
        before = param.detach().clone()
        param.add_(comp)
        comp.add_(before.sub_(param))
    else:
        param.addcdiv_(st["exp_avg"], denom, value=-step_size)


def bits(t):
    t = t.detach().contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32).tolist()
    return [x & 0xFFFF for x in t.view(torch.int16).tolist()]


def case(name, seed, n=40, steps=4, param_dtype="bfloat16", lr=1e-3, beta1=0.9, beta2=0.999,
         eps=1e-8, weight_decay=0.0, kahan=True, momentum_dtype="bfloat16",
         variance_dtype="bfloat16", compensation_dtype="bfloat16", grad_scale=1.0):
    cfg = dict(name=name, n=n, param_dtype=param_dtype, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, kahan=kahan, momentum_dtype=momentum_dtype,
               variance_dtype=variance_dtype, compensation_dtype=compensation_dtype)
    gen = torch.Generator().manual_seed(seed)
    param = (torch.randn(n, generator=gen) * 2).to(DTYPES[param_dtype])
    cfg["param0"] = bits(param)
    st = {"step": torch.tensor(0.0),
          "exp_avg": torch.zeros(n, dtype=DTYPES[momentum_dtype]),
          "exp_avg_sq": torch.zeros(n, dtype=DTYPES[variance_dtype])}
    if kahan:
        st["compensation"] = torch.zeros(n, dtype=DTYPES[compensation_dtype])
    cfg["grads"], cfg["steps"] = [], []
    for _ in range(steps):
        # Magnitudes 1e-10 .. 10, so that sqrt(exp_avg_sq) meets eps.
        scale = torch.pow(10.0, torch.randint(-10, 2, (n,), generator=gen).float())
        grad = torch.randn(n, generator=gen) * scale * grad_scale
        cfg["grads"].append(bits(grad))
        update(param, grad, st, cfg)
        cfg["steps"].append({
            "param": bits(param),
            "exp_avg": bits(st["exp_avg"]),
            "exp_avg_sq": bits(st["exp_avg_sq"]),
            "compensation": bits(st["compensation"]) if kahan else None,
        })
    return cfg


CASES = [
    case("bf16_kahan", 1),
    case("bf16_kahan_wd", 2, weight_decay=0.1, lr=3e-3),
    case("bf16_no_kahan", 3, kahan=False, weight_decay=0.01),
    case("f32_momentum", 4, momentum_dtype="float32"),
    case("f32_compensation", 5, compensation_dtype="float32", weight_decay=0.05),
    case("f32_states", 6, momentum_dtype="float32", variance_dtype="float32"),
    case("f16_states", 7, momentum_dtype="float16", variance_dtype="float16",
         compensation_dtype="float16", grad_scale=1e-2),
    case("f16_states_eps", 10, momentum_dtype="float16", variance_dtype="float16",
         compensation_dtype="float16", eps=1e-3),
    case("f32_param", 8, param_dtype="float32", weight_decay=0.1),
    case("betas_odd", 9, steps=3, beta1=0.5, beta2=0.75, eps=1e-6, lr=0.1),
]

if __name__ == "__main__":
    json.dump({"torch": torch.__version__,
               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "cases": CASES}, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
