#!/usr/bin/python3
# bench/torch_ddp_digits.py: the examples/digits MLP in PyTorch with DistributedDataParallel on gloo,
# the anchor of the digits training-throughput benchmark. SPDX-License-Identifier: Apache-2.0
"""Trains 64 -> hidden (no bias) -> BatchNorm1d -> ReLU -> Dropout -> 10 (softmax cross-entropy) on the
digits data with DDP over `--procs` processes (gloo, 127.0.0.1), the same global batch, epochs,
train/test split (sample i is a test sample iff i % 5 == 4) and input scaling ([0, 16] -> [0, 1])
as examples/digits. Prints one machine-readable line:

    torch_ddp procs=P samples_per_s=S seconds=T test_accuracy=A

Throughput counts training samples processed per second of the training loop (startup, process
spawn and evaluation are excluded), like examples/digits does.
"""
import argparse
import gzip
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def load(path):
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = data[:, :64] / 16.0
    y = data[:, 64].astype(np.int64)
    test = (np.arange(len(y)) % 5) == 4
    return (x[~test], y[~test]), (x[test], y[test])


def worker(rank, args, threads, result_queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs,
                            timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)

    (xtr, ytr), (xte, yte) = load(args.data)
    xtr, ytr = torch.from_numpy(xtr), torch.from_numpy(ytr)
    model = nn.Sequential(
        nn.Linear(64, args.hidden, bias=False), nn.BatchNorm1d(args.hidden), nn.ReLU(),
        nn.Dropout(args.dropout), nn.Linear(args.hidden, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    n = len(ytr)
    gen = torch.Generator().manual_seed(args.seed)
    dist.barrier()
    start = time.perf_counter()
    processed = 0
    for _ in range(args.epochs):
        order = torch.randperm(n, generator=gen)
        for b0 in range(0, n, args.batch):
            idx = order[b0:b0 + args.batch]
            # contiguous shard of the global batch, like lockstep's shard(): uneven allowed
            per, extra = divmod(len(idx), args.procs)
            lo = rank * per + min(rank, extra)
            hi = lo + per + (1 if rank < extra else 0)
            mine = idx[lo:hi]
            opt.zero_grad(set_to_none=True)
            out = ddp(xtr[mine])
            # DDP averages gradients over processes; scale so the step follows the mean loss over
            # the global batch (as lockstep does), exact for uneven shards too.
            loss = loss_fn(out, ytr[mine]) * (len(mine) * args.procs / len(idx))
            loss.backward()
            opt.step()
            processed += len(idx)
    dist.barrier()
    seconds = time.perf_counter() - start

    if rank == 0:
        model.eval()
        with torch.no_grad():
            pred = model(torch.from_numpy(xte)).argmax(dim=1).numpy()
        acc = float((pred == yte).mean())
        result_queue.put((processed / seconds, seconds, acc))
    dist.destroy_process_group()


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="cores shared by all processes (threads per process = cores / procs)")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--timeout", type=float, default=120,
                   help="seconds a process waits for its peers before failing (no hangs)")
    p.add_argument("--data", default=os.path.join(here, "..", "examples", "digits", "data",
                                                  "digits.csv.gz"))
    args = p.parse_args()
    threads = max(1, args.cores // args.procs)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(worker, args=(args, threads, q), nprocs=args.procs, join=True)
    rate, seconds, acc = q.get()
    print(f"torch_ddp procs={args.procs} threads_per_proc={threads} samples_per_s={rate:.1f} "
          f"seconds={seconds:.3f} test_accuracy={acc:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
