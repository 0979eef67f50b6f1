#!/usr/bin/env python3
"""Two nodes x 2 ranks over a shaped link: step time and bytes crossing the link per strategy.

Makes two hosts with scripts/two-hosts.sh (network namespaces joined by a veth pair, as root),
limits the link with `tc` (tbf at --rate; netem delay too when the kernel has sch_netem, else it
says so), and trains the default GPT for --steps steps under `fsdp launch --nnodes 2` with
FULL_SHARD, HYBRID_SHARD and HYBRID_SHARD_ZERO2 (backward prefetch on), and FULL_SHARD with
backward prefetch off. For each it prints the step time (rank 0's "done" line), the bytes that
crossed the link (the veth's tx counters of both ends, so TCP/IP headers included) and the bytes
`fsdp plan` predicts for the ring schedule over these two nodes (payload only).

    sudo scripts/two-hosts-bench.py --fsdp target/release/fsdp [--steps 20] [--rate 1gbit]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "two-hosts.sh")
NAME = "fsdpbench"
PORT = "29470"


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


def link_bytes():
    """Bytes sent by both ends of the veth pair (each direction once)."""
    total = 0
    for h in (0, 1):
        out = sh("ip", "-n", f"{NAME}-{h}", "-j", "-s", "link", "show", "dev", f"{NAME}-v{h}").stdout
        total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
    return total


def shape(rate, delay_ms):
    """tbf (and netem delay if available) on both ends; the description of what was applied."""
    netem = None
    for h in (0, 1):
        dev = f"{NAME}-v{h}"
        ns = ("ip", "netns", "exec", f"{NAME}-{h}")
        if delay_ms > 0:
            r = subprocess.run(
                ns + ("tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms", "rate", rate),
                capture_output=True, text=True)
            if r.returncode == 0:
                netem = True
                continue
            netem = False
        sh(*ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms")
    if netem:
        return f"netem delay {delay_ms} ms + rate {rate} on each end"
    if netem is False:
        return f"tbf rate {rate} on each end (netem is not available in this kernel: no added delay)"
    return f"tbf rate {rate} on each end"


def plan_cross_bytes(fsdp, strategy, steps):
    """Bytes the ring schedule sends across the two nodes per step, from `fsdp plan` (payload).

    Ranks 0,1 on node 0 and 2,3 on node 1. A ring over all 4 ranks (0-1-2-3-0) crosses the link
    on 2 of its 4 hops; an all-gather or reduce-scatter of per-rank shard s sends (g-1)*s per hop;
    a ring all-reduce of n bytes sends 2(g-1)/g * n per hop. Hybrid: the shard groups stay inside
    a node; each of the F replicate groups ({0,2}, {1,3}) is a 2-rank ring whose 2 hops both cross.
    """
    args = [fsdp, "plan", "--ranks", "4", "--strategy", strategy]
    if strategy.startswith("hybrid"):
        args += ["--ranks-per-node", "2"]
    out = sh(*args).stdout
    total = 0
    for line in out.splitlines():
        m = re.match(r"\s*\d+\s+\S+\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", line)
        if not m:
            continue
        _params, f, ag, rs, ar, fag, bag, nrs, nar = map(int, m.groups())
        if strategy.startswith("hybrid"):
            replicas = 4 // f
            total += f * 2 * (2 * (replicas - 1) / replicas) * ar * nar
        else:
            g = f
            total += 2 * (g - 1) * (ag * (fag + bag) + rs * nrs)
    return total


def run(fsdp, strategy, prefetch, steps, timeout):
    train = ["train", "--strategy", strategy, "--steps", str(steps), "--backward-prefetch", prefetch]
    procs = []
    env = dict(os.environ, FSDP_JOB_TOKEN="two-hosts-bench-token-0123456789")
    for node in (1, 0):
        cmd = ["ip", "netns", "exec", f"{NAME}-{node}", fsdp, "launch", "--nnodes", "2",
               "--node-rank", str(node), "-n", "2", "--master-addr", "10.77.0.1",
               "--master-port", PORT, "--timeout", str(timeout)] + train
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=timeout * 4) for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"{strategy}: a node failed ({p.returncode}):\n{e}")
    m = re.search(r"done: (\d+) steps in ([\d.]+) s", outs[1][0])
    if not m:
        sys.exit(f"{strategy}: no summary from rank 0:\n{outs[1][0]}")
    return float(m.group(2)) / int(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp", default=os.path.join(HERE, "..", "target", "release", "fsdp"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay-ms", type=float, default=1.0)
    ap.add_argument("--timeout", type=int, default=120)
    a = ap.parse_args()
    fsdp = os.path.abspath(a.fsdp)
    if os.geteuid() != 0:
        sys.exit("two-hosts-bench: needs root (network namespaces)")
    subprocess.run(["bash", SCRIPT, "up", NAME], check=True, capture_output=True)
    try:
        how = shape(a.rate, a.delay_ms)
        print(f"link: {how}; default GPT (0.83 M parameters), 2 nodes x 2 ranks, {a.steps} steps")
        print(f"{'strategy':<22} {'prefetch':<8} {'step ms':>9} {'link MB/step':>13} {'plan MB/step':>13} {'measured/plan':>14}")
        rows = {}
        for strategy, prefetch in [("full-shard", "pre"), ("hybrid-shard", "pre"),
                                   ("hybrid-shard-zero2", "pre"), ("full-shard", "none")]:
            before = link_bytes()
            t0 = time.time()
            step = run(fsdp, strategy, prefetch, a.steps, a.timeout)
            crossed = (link_bytes() - before) / a.steps
            plan = plan_cross_bytes(fsdp, strategy, a.steps)
            rows[(strategy, prefetch)] = (step, crossed, plan)
            print(f"{strategy:<22} {prefetch:<8} {step * 1e3:>9.1f} {crossed / 1e6:>13.2f} {plan / 1e6:>13.2f} {crossed / plan:>14.3f}",
                  flush=True)
        fs = rows[("full-shard", "pre")]
        for s in ("hybrid-shard", "hybrid-shard-zero2"):
            h = rows[(s, "pre")]
            print(f"{s} / full-shard bytes across the link: measured {h[1] / fs[1]:.3f}, plan {h[2] / fs[2]:.3f}")
        off = rows[("full-shard", "none")]
        print(f"full-shard step time, backward prefetch on / off: {fs[0] / off[0]:.3f}")
    finally:
        subprocess.run(["bash", SCRIPT, "down", NAME], capture_output=True)


if __name__ == "__main__":
    main()
