#!/usr/bin/python3
# bench/torch_ddp_overlap.py: bench_overlap's network (ResNet-50's 161 tensors, calibrated per-layer
# backward compute) under PyTorch DistributedDataParallel on gloo. SPDX-License-Identifier: Apache-2.0
"""Runs the network bench_overlap trains under torch DDP (gloo, --procs processes x 1 thread,
127.0.0.1 only) and measures, as bench_overlap does, round-robin over --reps repetitions (medians,
each fenced by barriers):

- compute: a step of the same network without DDP (forward, backward, SGD), every process at once;
- allreduce: DDP's buckets (reverse parameter order, 1 MiB first, then --bucket-mb) all_reduced alone;
- step: the DDP step (DDP overlaps its bucket all_reduces with the backward).

The backward runs from the last tensor to the first; per tensor it burns its share (the --layers
file, written by bench_overlap) of --backward-ms with in-place adds over a 16 MiB scratch tensor
(the same memory-bound work as bench_overlap's), calibrated at start-up, and returns a filled
gradient. Prints one machine-readable line:

    torch_ddp procs=P ... compute_ms=C allreduce_ms=A step_ms=S step_over_sum=S/(C+A) ...

Every wait is bounded: the process group times out after --timeout seconds, the parent kills its
workers after 2 x --timeout, and bench_overlap runs this under `timeout`.
"""
import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

SCRATCH = 1 << 22  # floats, as bench_overlap's burner


def read_layers(path):
    names, shares, shapes = [], [], []
    with open(path) as f:
        for line in f:
            parts = line.strip().split(",")
            if len(parts) < 3:
                continue
            names.append(parts[0])
            shares.append(float(parts[1]))
            shapes.append(tuple(int(e) for e in parts[2:]))
    return names, shares, shapes


class Burner:
    def __init__(self):
        self.s = torch.ones(SCRATCH)
        self.pos = 0

    def run(self, units):
        while units > 0:
            k = min(units, SCRATCH - self.pos)
            self.s[self.pos:self.pos + k].add_(1e-3)
            self.pos = (self.pos + k) % SCRATCH
            units -= k


class Layer(torch.autograd.Function):
    """Identity forward; backward burns the layer's compute and returns a filled gradient."""

    @staticmethod
    def forward(ctx, x, w, index, net):
        ctx.index = index
        ctx.net = net
        ctx.shape = w.shape
        return x.clone()

    @staticmethod
    def backward(ctx, gx):
        net = ctx.net
        net.burner.run(net.units[ctx.index])
        return gx, torch.full(ctx.shape, net.grad_value), None, None


class Net(nn.Module):
    def __init__(self, shapes, burner, grad_value):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
        self.burner = burner
        self.units = [0] * len(shapes)
        self.grad_value = grad_value

    def forward(self, x):
        for i, p in enumerate(self.params):
            x = Layer.apply(x, p, i, self)
        return x


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def worker(rank, args, port, result_queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs,
                            timeout=timedelta(seconds=args.timeout))
    names, shares, shapes = read_layers(args.layers)
    burner = Burner()
    grad_value = 1e-4 * (rank + 1)
    plain = Net(shapes, burner, grad_value)
    ddp_net = Net(shapes, burner, grad_value)
    ddp = DDP(ddp_net, bucket_cap_mb=args.bucket_mb)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=1e-3, momentum=0.9)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    x = torch.zeros(1)

    # DDP's buckets: reverse parameter order, the first ~1 MiB, then ~bucket_cap_mb.
    buckets, held, cap = [], 0, 1 << 20
    for s in reversed(shapes):
        n = 1
        for e in s:
            n *= e
        if not buckets or held >= cap:
            if buckets:
                cap = int(args.bucket_mb * (1 << 20))
            buckets.append(0)
            held = 0
        buckets[-1] += n
        held += 4 * n
    flats = [torch.full((n,), 1e-4) for n in buckets]

    def timed(f):
        dist.barrier()
        t0 = time.perf_counter()
        f()
        dist.barrier()
        return (time.perf_counter() - t0) * 1e3

    def set_total(total):
        units = [int(total * sh) for sh in shares]
        plain.units = units
        ddp_net.units = units

    def plain_backward():
        plain.zero_grad(set_to_none=True)
        plain(x).sum().backward()

    def compute_step():
        opt_plain.zero_grad(set_to_none=True)
        plain(x).sum().backward()
        opt_plain.step()

    def reduce_alone():
        for t in flats:
            dist.all_reduce(t)

    def ddp_step():
        opt_ddp.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        opt_ddp.step()

    # Calibration: the burn rate with every process burning, then one correction on the backward.
    dist.barrier()
    chunk, burned, t0 = 1 << 20, 0, time.perf_counter()
    while time.perf_counter() - t0 < (0.1 if args.reps <= 3 else 0.3):
        burner.run(chunk)
        burned += chunk
    rate = torch.tensor([burned / (time.perf_counter() - t0)], dtype=torch.float64)
    dist.all_reduce(rate)
    rate = rate.item() / args.procs
    target = args.backward_ms * 1e-3
    set_total(rate * target)
    first = timed(plain_backward)
    set_total(rate * target * (args.backward_ms / first))

    compute, reduce, step = [], [], []
    for rep in range(args.reps + 1):  # round-robin; repetition 0 warms up
        c = timed(compute_step)
        r = timed(reduce_alone)
        s = timed(ddp_step)
        if rep > 0:
            compute.append(c)
            reduce.append(r)
            step.append(s)
    if rank == 0:
        result_queue.put((median(compute), median(reduce), median(step), len(buckets), rate))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", required=True, help="name,share,shape... per tensor (bench_overlap)")
    p.add_argument("--backward-ms", type=float, required=True)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=25, help="DDP's bucket_cap_mb")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a process waits for its peers before failing (no hangs)")
    args = p.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(args.procs)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + 2 * args.timeout
    result = None
    try:
        result = q.get(timeout=2 * args.timeout)
    except Exception:
        pass
    for pr in procs:
        pr.join(timeout=max(1.0, deadline - time.monotonic()))
    failed = result is None or any(pr.exitcode != 0 for pr in procs)
    for pr in procs:
        if pr.is_alive():
            pr.kill()
            pr.join(5)
    if result is None:
        print("torch_ddp failed: no result (a worker failed or timed out)", file=sys.stderr)
        sys.exit(1)
    c, r, s, nb, rate = result
    print(f"torch_ddp procs={args.procs} threads_per_proc=1 backward_target_ms={args.backward_ms:.1f} "
          f"buckets={nb} burn_rate_G_per_s={rate * 1e-9:.2f} compute_ms={c:.1f} allreduce_ms={r:.1f} "
          f"step_ms={s:.1f} step_over_sum={s / (c + r):.3f} step_over_max={s / max(c, r):.3f}")
    sys.stdout.flush()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
