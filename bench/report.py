#!/usr/bin/env python3
# bench/report.py: PNG plots (matplotlib) and docs/performance.md from the CSVs scripts/bench
# writes to build/bench-results/. SPDX-License-Identifier: Apache-2.0
"""Plots and the performance page from the benchmark CSVs.

usage: report.py --results DIR [--doc FILE --images DIR]

Reads DIR/machine.csv, DIR/runs.csv and each benchmark's CSV (a missing or empty one becomes a
note), draws DIR/<benchmark>.png, and with --doc writes FILE (markdown) whose images are copies of
the PNGs in --images (linked relative to FILE).
"""
import argparse
import csv
import os
import pathlib
import shutil
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOTS = ["batch_norm", "allreduce", "reduce", "optimizer", "digits", "overlap",
         "hierarchical", "reproducible", "bn_step"]

# The GPU figures come from docs/gpu.md (a run on a GPU machine, not from build/bench-results/):
# update this summary with that page after each GPU run.
GPU_SUMMARY = (
    "[gpu.md](gpu.md#figures) has its figures from the run of 2026-12-04 on an H200 (commit "
    "27239b8, whose kernels have changed since, not yet measured: "
    "[gpu_batch_norm.md](gpu_batch_norm.md)): lockstep's batch norm at 1.29-4.07x its traffic "
    "bound where the activations are at least 16 MiB, and 1.00-2.50x slower than the best of "
    "cuDNN and PyTorch on every shape (cuDNN timed in the same call as lockstep; PyTorch in a "
    "separate run of the same shapes, as CUDA-graph replays).")


def read(path):
    """The rows of a CSV as dicts ([] when the file is missing or has no rows)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def num(v):
    """A CSV cell as float (None for an empty cell)."""
    return float(v) if v not in ("", None, "-") else None


def fmt(v, digits=3):
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}" if abs(v) < 1 else f"{v:.{digits + 1}g}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def human_bytes(b):
    b = int(b)
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b // size} {unit}"
    return f"{b} B"


# ---- plots ------------------------------------------------------------------------------------


def plot_batch_norm(rows, png):
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = [v for v in ("lockstep", "onednn", "bound") if any(r["variant"] == v for r in rows)]
    label = {"lockstep": "lockstep", "onednn": "oneDNN", "bound": "bandwidth bound"}
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        groups = list(dict.fromkeys((r["layout"], r["pass"]) for r in rows if r["shape"] == shape))
        width = 0.8 / len(variants)
        for k, v in enumerate(variants):
            ys = []
            for g in groups:
                m = [num(r["ms"]) for r in rows
                     if r["shape"] == shape and (r["layout"], r["pass"]) == g and r["variant"] == v]
                ys.append(m[0] if m else 0)
            ax.bar([i + k * width for i in range(len(groups))], ys, width, label=label[v])
        ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{l}\n{p}" for l, p in groups])
        ax.set_title(f"batch norm {shape} (NxCxHxW), float")
        ax.set_ylabel("time per call (ms), lower is better")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_series_by_size(series, png, ylabel, title):
    """A log-log plot over message size: series = [(label, style, [(bytes, value)...])]."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, style, pts in series:
        if pts:
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size per replica (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_ratio_bars(rows, png, key, value, xlabel, title, height_in=4.5):
    """Horizontal bars of rows[value] per rows[key] (one bar per backend), with a line at 1."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    keys = list(dict.fromkeys(r[key] for r in rows))
    fig, ax = plt.subplots(figsize=(8, height_in))
    height = 0.8 / max(1, len(backends))
    for k, b in enumerate(backends):
        xs = []
        for m in keys:
            v = [num(r[value]) for r in rows if r["backend"] == b and r[key] == m]
            xs.append(v[0] if v else 0)
        ax.barh([i + k * height for i in range(len(keys))], xs, height, label=b)
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_yticks([i + height * (len(backends) - 1) / 2 for i in range(len(keys))])
    ax.set_yticklabels(keys, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_allreduce(rows, png):
    series = [("thread_group", "lockstep", "thread_group (lockstep)", "-o"),
              ("thread_group", "traffic_bound", "thread_group traffic bound (DRAM)", "--"),
              ("mpi", "plain", "mpi_communicator, verify off", "-s"),
              ("mpi", "verify", "mpi_communicator (default, verify on)", "-^"),
              ("mpi", "raw", "raw MPI_Allreduce (MPICH)", "-x")]
    plot_series_by_size(
        [(name, style, [(int(r["bytes"]), num(r["busbw_gbps"])) for r in rows
                        if r["backend"] == backend and r["variant"] == variant and r["busbw_gbps"]])
         for backend, variant, name, style in series],
        png, "bus bandwidth (GB/s), higher is better", "all_reduce (sum, float), 2 replicas")


def plot_reduce(rows, png):
    plot_ratio_bars(rows, png, "method", "median_over_flat",
                    "median time / flat all_reduce's median (lower is better)",
                    "gradient reduction of ResNet-50's 161 tensors, 2 replicas")


def plot_optimizer(rows, png):
    kernels = [r["kernel"] for r in rows]
    best = [num(r["best_ms"]) for r in rows]
    roof = [num(r["bound_ms"]) for r in rows]
    rmw = [num(r["rmw_bound_over_time"]) * num(r["best_ms"]) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.27
    xs = range(len(kernels))
    ax.bar([x - w for x in xs], best, w, label="step time (best)")
    ax.bar(list(xs), roof, w, label="roof: bytes / STREAM copy")
    ax.bar([x + w for x in xs], rmw, w, label="roof: bytes / in-place a += b")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(kernels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step, 25.6 M floats (lower is better)")
    ax.set_title("fused optimizer step vs the memory roof")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_digits(rows, png):
    replicas = sorted({int(r["replicas"]) for r in rows})
    variants = [v for v in ("lockstep", "torch_ddp") if any(r["variant"] == v for r in rows)]
    label = {"lockstep": "lockstep (thread group)", "torch_ddp": "PyTorch DDP (gloo)"}
    fig, ax = plt.subplots(figsize=(6, 4))
    w = 0.8 / len(variants)
    for k, v in enumerate(variants):
        ys = []
        for n in replicas:
            m = [num(r["samples_per_s"]) for r in rows
                 if int(r["replicas"]) == n and r["variant"] == v]
            ys.append(m[0] if m else 0)
        ax.bar([i + k * w for i in range(len(replicas))], ys, w, label=label[v])
    ax.set_xticks([i + w * (len(variants) - 1) / 2 for i in range(len(replicas))])
    ax.set_xticklabels([f"{n} replica{'s' if n > 1 else ''}" for n in replicas])
    ax.set_ylabel("training samples/s (higher is better)")
    ax.set_title("examples/digits MLP training throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def overlap_label(r):
    return f"{r['backend']}, {r['replicas']}"


def plot_overlap(rows, png):
    configs = list(dict.fromkeys(overlap_label(r) for r in rows))
    modes = [m for m in ("never", "always", "always_inline", "ddp")
             if any(r["mode"] == m for r in rows)]
    label = {"never": "overlap never", "always": "overlap always",
             "always_inline": "always (fell back to inline)", "ddp": "DDP's own overlap"}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    h = 0.8 / len(modes)
    for k, m in enumerate(modes):
        ys = [i + k * h for i, c in enumerate(configs)]
        xs = []
        for c in configs:
            v = [num(r["step_over_max"]) for r in rows if overlap_label(r) == c and r["mode"] == m]
            xs.append(v[0] if v else 0)
        ax.barh(ys, xs, h, label=label[m])
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_yticks([i + h * (len(modes) - 1) / 2 for i in range(len(configs))])
    ax.set_yticklabels([c + " replicas" for c in configs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("step / max(compute, wire)  (1.0 = perfect overlap, lower is better)")
    ax.set_title("overlap of gradient reduction with backward (ResNet-50-shaped)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ---- the page ---------------------------------------------------------------------------------


def section_batch_norm(rows):
    text = ["## Batch norm vs oneDNN (bench/batch_norm.cpp)", "",
            "Host batch norm (float, forward training and backward, `bn::local`) in NCHW and NHWC "
            "against oneDNN's batch normalization on the same data and layout, and against the "
            "bandwidth bound: the pass's traffic (forward 3 x S, backward 5 x S bytes) at the "
            "STREAM-copy bandwidth measured in the same run with the same threads. Best of the "
            "round-robin repetitions. *lockstep/oneDNN* < 1 means lockstep is faster; "
            "*bound/lockstep* = 1 means lockstep runs at copy speed.", ""]
    if not any(r["variant"] == "onednn" for r in rows):
        text += ["oneDNN was not found when the benchmark was configured: its columns are empty.",
                 ""]
    out = []
    for r in rows:
        if r["variant"] != "lockstep":
            continue
        same = [num(x["ms"]) for x in rows if x["variant"] == "onednn" and
                (x["shape"], x["layout"], x["pass"]) == (r["shape"], r["layout"], r["pass"])]
        bound = [num(x["ms"]) for x in rows if x["variant"] == "bound" and
                 (x["shape"], x["layout"], x["pass"]) == (r["shape"], r["layout"], r["pass"])]
        ms = num(r["ms"])
        out.append([r["shape"], r["layout"], r["pass"], fmt(ms), fmt(same[0] if same else None),
                    fmt(bound[0] if bound else None), fmt(num(r["ratio_to_onednn"])),
                    fmt(bound[0] / ms if bound else None)])
    text += [table(["shape", "layout", "pass", "lockstep ms", "oneDNN ms", "bound ms",
                    "lockstep/oneDNN", "bound/lockstep"], out)]
    return text


def section_allreduce(rows):
    text = ["## all_reduce bandwidth (bench/allreduce.cpp)", "",
            "all_reduce (sum, float) of S bytes per replica, 2 replicas: the thread group (one "
            "process) against its traffic bound (4 x S bytes at the STREAM-copy bandwidth of "
            "64 MiB arrays with the same 2 threads: the speed of the plainest code moving those "
            "bytes, not a hardware limit; where the arrays stay in a large last-level cache "
            "(see [Machine and load](#machine-and-load)) lockstep can beat it), and under "
            "`mpiexec -n 2` `mpi_communicator` (with and without its signature check) against raw "
            "`MPI_Allreduce` on the same buffers. Medians of the slowest replica's time per call. "
            "Bus bandwidth = S / time x 2 (n - 1) / n (for n = 2 it equals S / time). Thread "
            "group rows of tens of us at small sizes are sleeps, not transfers: a waiting replica "
            "spins (at a collective's entry twice as long as its recent entries waited, 4 to "
            "200 us; after a data phase about as long as its own part took), then sleeps, and "
            "each wake-up costs about 15 us on the 2-core VM (on a loaded machine small rows "
            "can pay it).", ""]
    by = {}
    for r in rows:
        by.setdefault(int(r["bytes"]), {})[(r["backend"], r["variant"])] = r
    out = []
    for b in sorted(by):
        d = by[b]
        tg, raw, plain, verify = (d.get(k) for k in (("thread_group", "lockstep"), ("mpi", "raw"),
                                                     ("mpi", "plain"), ("mpi", "verify")))
        if not (tg or raw):
            continue
        out.append([human_bytes(b), fmt(num(tg["busbw_gbps"])) if tg else "-",
                    fmt(num(tg["ratio"])) if tg else "-",
                    fmt(num(raw["busbw_gbps"])) if raw else "-",
                    fmt(num(plain["busbw_gbps"])) if plain else "-",
                    fmt(num(plain["ratio"])) if plain else "-",
                    fmt(num(verify["ratio"])) if verify else "-"])
    text += [table(["size", "thread_group GB/s", "thread_group time/bound", "raw MPI GB/s",
                    "mpi_communicator (verify off) GB/s", "plain/raw", "verify/raw"], out)]
    paired = [r for r in rows if r["variant"] == "lockstep_paired"]
    if paired:
        plain = {int(r["bytes"]): r for r in rows if r["variant"] == "openmp_paired"}
        text += ["", "Paired with a STREAM copy on the same threads, interleaved call by call "
                     "(robust to load): the copy moves exactly the all_reduce's traffic bound "
                     "(the two threads together read 2 x S and write 2 x S bytes), so "
                     "*time/bound* = the median over calls of the call's all_reduce time / its "
                     "copy's time, and *bound/time* is "
                     "the fraction of the bound reached. *plain* is an OpenMP reduce-scatter + "
                     "all-gather written without lockstep (two threads, each summing its half of "
                     "both inputs, a barrier, then copying the other half), paired with its own "
                     "copy the same way; the two take turns in 3 rounds of about 1/3 GiB each.", ""]
        out = []
        for r in sorted(paired, key=lambda r: int(r["bytes"])):
            b = int(r["bytes"])
            ratio = num(r["ratio"])
            p = plain.get(b)
            pr = num(p["ratio"]) if p else None
            out.append([human_bytes(b), fmt(num(r["time_us"])), fmt(ratio), fmt(1 / ratio),
                        fmt(pr) if pr else "-", fmt(ratio / pr) if pr else "-"])
        text += [table(["size", "all_reduce us", "time/bound", "bound/time",
                        "plain time/bound", "lockstep/plain"], out)]
    return text


def section_reduce(rows):
    text = ["## Reduction policies vs one flat all_reduce (bench/reduce.cpp)", "",
            "The gradient of a ResNet-50-shaped parameter list (161 tensors, 25.6 M floats) "
            "reduced by every `ReducePolicy` against one all_reduce of the whole flat buffer in "
            "the same run (round-robin repetitions, each between barriers), on the thread group "
            "(2 replicas) and over MPI (2 processes). Ratios < 1 are faster than flat.", ""]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = ["method"]
    for b in backends:
        head += [f"{b}: collectives", f"{b}: best/flat", f"{b}: median/flat"]
    out = []
    for m in methods:
        line = [f"`{m}`"]
        for b in backends:
            r = [x for x in rows if x["backend"] == b and x["method"] == m]
            line += ([r[0]["collectives"], fmt(num(r[0]["best_over_flat"])),
                      fmt(num(r[0]["median_over_flat"]))] if r else ["-"] * 3)
        out.append(line)
    text += [table(head, out)]
    flats = [x for x in rows if x["method"].startswith("flat")]
    if flats:
        text += ["", "Flat all_reduce (the anchor), median: " +
                 ", ".join(f"{x['backend']} {fmt(num(x['median_ms']))} ms" for x in flats) + "."]
    return text


def plot_hierarchical(rows, png):
    series = [("flat", "flat mpi_communicator, shared memory", "-o"),
              ("hierarchical", "hierarchical 2 x 2, shared memory", "-s"),
              ("flat_10g", "flat, every collective over a 10 Gb/s link", "--o"),
              ("hierarchical_10g", "hierarchical, inter-node level over a 10 Gb/s link", "--s"),
              ("flat_1g", "flat, every collective over a 1 Gb/s link", ":o"),
              ("hierarchical_1g", "hierarchical, inter-node level over a 1 Gb/s link", ":s")]
    plot_series_by_size(
        [(name, style, [(int(r["bytes"]), num(r["ms"])) for r in rows if r["variant"] == variant])
         for variant, name, style in series],
        png, "all_reduce time (ms), lower is better",
        "all_reduce over 4 MPI processes: flat vs hierarchical (2 nodes x 2)")


def section_hierarchical(rows):
    text = ["## Hierarchical all_reduce vs flat MPI (bench/hierarchical.cpp)", "",
            "all_reduce (sum, float) over the same 4 MPI processes (`mpiexec -n 4` on the 2 "
            "cores): one flat `mpi_communicator`, and `hierarchical_communicator` with the "
            "processes as 2 nodes of 2 (an intra-node and an inter-node `mpi_communicator`). On "
            "one machine both levels are shared memory, so the hierarchy can only add steps; the "
            "10G and 1G columns model the link between the two nodes as 10 Gb/s and 1 Gb/s "
            "Ethernet (`simulated_link`, a link per replica; an operation takes the longer of its "
            "real time and its modelled wire time): flat, each all_reduce crosses the link with "
            "the whole message (1.5x its bytes for 4 replicas); hierarchical, only the inter-node "
            "all_reduce of each replica's half does (0.5x). With 4 processes on 2 cores the "
            "shared-memory work takes longer than a 10 Gb/s wire, so the 10G columns measure that "
            "work; at 1 Gb/s the wire dominates. Ratios < 1: hierarchical is faster.", ""]
    sizes = sorted({int(r["bytes"]) for r in rows})
    out = []
    for b in sizes:
        get = {r["variant"]: r for r in rows if int(r["bytes"]) == b}
        line = [human_bytes(b)]
        for flat, hier in (("flat", "hierarchical"), ("flat_10g", "hierarchical_10g"),
                           ("flat_1g", "hierarchical_1g")):
            line += ([fmt(num(get[flat]["ms"])), fmt(num(get[hier]["ms"])),
                      fmt(num(get[hier]["ratio_to_flat"]))]
                     if flat in get and hier in get else ["-"] * 3)
        out.append(line)
    text += [table(["bytes", "flat ms", "hier ms", "hier/flat", "flat 10G ms", "hier 10G ms",
                    "hier/flat 10G", "flat 1G ms", "hier 1G ms", "hier/flat 1G"], out)]
    return text


def plot_reproducible(rows, png):
    plot_ratio_bars(rows, png, "policy", "ratio_to_bucketed",
                    "step time / bucketed step time (lower is better)",
                    "reduce::reproducible and sharded vs bucketed, ResNet-50's gradients, "
                    "2 replicas", height_in=3.5)


def section_reproducible(rows):
    text = ["## Reproducible and sharded reduction vs bucketed (bench/reproducible.cpp)", "",
            "One synchronous step of a network with ResNet-50's 161 tensors (25.6 M floats, global "
            "batch 64, SGD with momentum) whose backward only adds to each gradient once per call "
            "and marks each tensor ready, so the rows isolate the reduction policy's cost: "
            "`reduce::bucketed<>` calls it once per replica and all_reduces 4 bytes per parameter; "
            "`reduce::reproducible<C>` calls it once per chunk of C samples and keeps each chunk's "
            "gradient but the last, each tensor as the backward marks it ready (one pass that "
            "copies it and leaves the zeros the next chunk starts on); over MPI it sends each "
            "chunk's values of every block of elements to the block's owner (an all_to_all per "
            "chunk index, 4 bytes per parameter and chunk), which sums them in fixed point "
            "anchored at each element's largest exponent and rounds once, and all-gathers the "
            "blocks (4 bytes per parameter); on the thread group one all_combine has each block's "
            "owner read every replica's chunks where they lie and store the sums to every replica "
            "in one pass. That buys weights that are bitwise the same for every replica count; "
            "`reduce::sharded<>` (ZeRO stage 1) reduce-scatters each bucket, updates its shard "
            "with its share of the optimizer state and all-gathers the parameters. The bucketed "
            "trainer with 4 micro-batches calls the backward as often as `reproducible<8>` does. "
            "A sixth, bucketed, trainer reports stragglers after every step "
            "(`train_params::report_stragglers_every = 1`). "
            "2 thread replicas and 2 MPI processes. The trainers live side by side and take "
            "turns, one step each per round (30 rounds), so a slow spell of the machine hits "
            "every row alike: *step ms* is the median step, */ bucketed* the median over rounds "
            "of the step over the bucketed step of the same round, */ bucketed, same calls* the "
            "same against the bucketed trainer that calls the backward as often per replica (what "
            "the policy costs beyond the calls themselves).", ""]
    out = [[r["backend"], f"`{r['policy']}`", fmt(num(r["step_ms"])),
            fmt(num(r["ratio_to_bucketed"])), fmt(num(r.get("ratio_to_same_calls", "")))]
           for r in rows]
    text += [table(["backend", "policy", "step ms", "/ bucketed", "/ bucketed, same calls"], out)]
    return text


def plot_bn_step(rows, png):
    plot_ratio_bars(rows, png, "policy", "step_over_local",
                    "step time / bn::local step time (lower is better)",
                    "ResNet-50's 53 BN layers, forward + backward, 2 replicas", height_in=3)


def section_bn_step(rows):
    text = ["## Synchronized batch norm (bench/bn_step.cpp)", "",
            "Training steps of a network made of ResNet-50's 53 batch-norm layers (their channels "
            "and feature-map sides at the input side given in the table), NCHW float, forward "
            "through every layer then backward, with `bn::global` (synchronized: one all_gather "
            "in forward and one all_reduce in backward per layer) beside the same layers with "
            "`bn::local` (no collectives) in the same run, round-robin; each inside "
            "`data_parallel`'s synchronous step (`reduce::bucketed<>`, SGD with momentum), on 2 "
            "thread replicas and 2 MPI processes (`mpi_communicator` with its default signature "
            "check). BN alone, no convolutions: a whole network's "
            "compute would make the ratio smaller. *collective ms* is the time a replica spends "
            "inside the collectives its step function issues (the communicator's flight "
            "recorder, waiting for the peer included), mean over the replicas; *last-arrival ms* "
            "sums, per collective, the shorter of the replicas' times (the replica that arrived "
            "last): the collectives' cost without the wait for a late arrival, which a loaded "
            "machine inflates; *global - local* is the paired difference of step times. "
            "Medians over the repetitions.", ""]
    out = [[r["backend"], r["replicas"], r["batch_per_replica"], r["input_side"],
            f"`bn::{r['policy']}`", fmt(num(r["collectives_per_step"])), fmt(num(r["step_ms"])),
            fmt(num(r["collective_ms"])), fmt(num(r["collective_share"])),
            fmt(num(r["last_arrival_ms"])), fmt(num(r["step_over_local"])),
            fmt(num(r["minus_local_ms"]))] for r in rows]
    text += [table(["backend", "replicas", "samples/replica", "input side", "policy",
                    "collectives/step", "step ms", "collective ms", "collective/step",
                    "last-arrival ms", "step/local", "global - local ms"], out)]
    return text


def section_optimizer(rows):
    text = ["## Optimizer step vs the memory roof (bench/optimizer.cpp)", "",
            "The fused step of each optimizer over ResNet-50's 25.6 M float parameters against "
            "its memory roof: the bytes it must move per parameter at the STREAM-copy bandwidth "
            "(b = a) and at the bandwidth of an in-place a += b (the optimizers' own access "
            "pattern, without copy's write-allocate traffic), both measured in the same run with "
            "the same threads. *roof/time* = 1 means the step runs at memory speed; above 1 "
            "against STREAM copy is expected (copy's 8 counted bytes cost 12).", ""]
    out = [[r["kernel"], r["bytes_per_param"], fmt(num(r["best_ms"])), fmt(num(r["median_ms"])),
            fmt(num(r["gbps"])), fmt(num(r["bound_over_time"])),
            fmt(num(r["rmw_bound_over_time"]))] for r in rows]
    text += [table(["kernel", "bytes/param", "best ms", "median ms", "GB/s",
                    "roof/time (STREAM copy)", "roof/time (a += b)"], out)]
    if rows:
        text += ["", f"Threads: {rows[0]['threads']}."]
    return text


def section_digits(rows):
    text = ["## Training throughput vs PyTorch DDP (bench/digits_throughput.sh)", "",
            "examples/digits (an MLP on the 8x8 digits set) trained with 1 and 2 replicas of the "
            "thread group next to the same network, data, batch and optimizer in PyTorch DDP "
            "(gloo) with 1 and 2 processes; both sides get the same cores and count training "
            "samples per second of the training loop only; median of the runs. The network is "
            "tiny (9.7 k parameters): the numbers measure per-step overhead more than arithmetic. "
            "With one replica both sides run their kernels on OpenMP threads over all cores, and "
            "on a loaded machine OpenMP's spinning waits make that row slow "
            "([the digits example](../examples/digits/README.md) has runs with "
            "`OMP_WAIT_POLICY=passive`).", ""]
    has_torch = any(r["variant"] == "torch_ddp" for r in rows)
    if rows and not has_torch:
        text += ["PyTorch was not importable: the torch rows were skipped.", ""]
    out = []
    for n in sorted({int(r["replicas"]) for r in rows}):
        ls = [r for r in rows if int(r["replicas"]) == n and r["variant"] == "lockstep"]
        tr = [r for r in rows if int(r["replicas"]) == n and r["variant"] == "torch_ddp"]
        out.append([n, fmt(num(ls[0]["samples_per_s"])) if ls else "-",
                    fmt(num(tr[0]["samples_per_s"])) if tr else "-",
                    fmt(num(ls[0]["ratio_to_torch"])) if ls else "-",
                    ls[0]["test_accuracy_pct"] if ls else "-",
                    tr[0]["test_accuracy_pct"] if tr else "-"])
    text += [table(["replicas", "lockstep samples/s", "torch DDP samples/s", "lockstep/torch",
                    "lockstep test acc %", "torch test acc %"], out)]
    return text


def section_digits_reproducible(rows):
    """The digits_reproducible rows of digits.csv: reproducible / bucketed samples/s."""
    if not rows:
        return []
    text = ["", "What reproducibility costs on the same MLP: `--reduce reproducible --bn ghost` "
                "(`reduce::reproducible<16>`, `bn::ghost<16>`: weights bitwise the same for every "
                "replica count) next to `--reduce bucketed --bn local`, 60 epochs, 21 alternating pairs of "
                "runs: median samples/s, and the median of the pairs' ratios; "
                "thread replicas and `mpiexec -n 2 digits --mpi` (when the binary has MPI).", ""]
    out = []
    for backend, n in dict.fromkeys((r["variant"].split("/")[0], r["replicas"]) for r in rows):
        get = {r["variant"].split("/")[1]: r for r in rows
               if r["variant"].split("/")[0] == backend and r["replicas"] == n}
        b, p = get.get("bucketed"), get.get("reproducible")
        out.append([backend, n, fmt(num(b["samples_per_s"])) if b else "-",
                    fmt(num(p["samples_per_s"])) if p else "-",
                    fmt(num(p["ratio_to_torch"])) if p else "-",
                    b["test_accuracy_pct"] if b else "-", p["test_accuracy_pct"] if p else "-"])
    text += [table(["backend", "replicas", "bucketed samples/s", "reproducible samples/s",
                    "reproducible/bucketed", "bucketed test acc %", "reproducible test acc %"],
                   out)]
    return text


def section_overlap(rows):
    text = ["## Overlap of reduction with backward (bench/overlap.cpp)", "",
            "A network with ResNet-50's 161 parameter tensors whose backward is calibrated to take "
            "as long as its gradient reduction, trained with `reduce::bucketed<8 MiB>` and "
            "`train_params::overlap` never and always, over a simulated 10 Gb/s link (2 and 4 "
            "replicas), the thread group and MPI, beside PyTorch DDP on gloo running the same "
            "network (when torch is installed; its backward is calibrated to the thread_group "
            "row's reduction, not to its own gloo reduction, so its *step/max* measures gloo "
            "more than its overlap). *step/max* = step / max(compute, wire) (1.0 = "
            "the reduction fully hidden); *step/sum* = step / (compute + reduce). On the "
            "simulated link, *carriage* is the wrapped communicator's all_reduce of the same "
            "buckets alone (the data the link's model sends, moved by memory work on the compute "
            "cores) and *floor/max* = (compute + carriage) / max(compute, wire): what a step that "
            "hides the wire completely still takes on these cores. The *reproducible* rows "
            "train the same network and backward with `reduce::reproducible<1>` (one chunk of one "
            "sample per replica; its exchange needs every gradient, so it does not overlap) on the "
            "communicators with all_to_all. "
            "[overlap.md](overlap.md) describes the method.", ""]
    out = [[r["backend"], r["replicas"], r["mode"], fmt(num(r["compute_ms"])),
            fmt(num(r["reduce_ms"])), fmt(num(r["wire_model_ms"])),
            fmt(num(r.get("carriage_ms", ""))), fmt(num(r["step_ms"])),
            fmt(num(r["step_over_max"])), fmt(num(r.get("floor_over_max", ""))),
            fmt(num(r["step_over_sum"]))] for r in rows]
    text += [table(["backend", "n", "overlap", "compute ms", "reduce ms", "wire model ms",
                    "carriage ms", "step ms", "step/max", "floor/max", "step/sum"], out)]
    ratios = []
    for r in rows:
        if r["mode"] != "reproducible":
            continue
        never = [q for q in rows if q["mode"] == "never" and q["backend"] == r["backend"]
                 and q["replicas"] == r["replicas"]]
        if never:
            ratios.append(f"{r['backend']}, {r['replicas']} replicas: "
                          f"{fmt(num(r['step_ms']) / num(never[0]['step_ms']))}x")
    if ratios:
        text += ["", "Reproducible step / bucketed step (overlap never): " + "; ".join(ratios) +
                 "."]
    if rows and not any(r["mode"] == "ddp" for r in rows):
        text += ["", "No PyTorch DDP row: torch was not importable or its run failed (see "
                     "overlap_threads.txt)."]
    return text


def machine_section(machine, runs):
    keys = [("date", "measured"), ("mode", "mode"), ("commit", "commit"), ("cpu", "CPU"),
            ("cores", "cores"), ("threads_per_core", "threads per core"), ("l3", "L3 cache"),
            ("memory", "memory"), ("kernel", "kernel"), ("os", "OS"), ("compiler", "compiler"),
            ("cmake", "CMake"), ("mpi", "MPI"), ("onednn", "oneDNN (libdnnl-dev)"),
            ("python", "Python"), ("torch", "torch"), ("matplotlib", "matplotlib")]
    text = ["## Machine and load", "",
            table(["", ""], [[label, machine.get(k, "-")] for k, label in keys]), "",
            "Load average (1, 5, 15 minutes) before and after each benchmark. Other processes "
            "only add time, so a load above the core count makes every number slower and the "
            "ratios less reliable:", ""]
    out = [[r["bench"], f"`{r['command']}`", r["started"], r["seconds"], r["exit_status"],
            f"{r['load_before_1m']} {r['load_before_5m']} {r['load_before_15m']}",
            f"{r['load_after_1m']} {r['load_after_5m']} {r['load_after_15m']}"] for r in runs]
    text += [table(["benchmark", "command", "started (UTC)", "seconds", "exit", "load before",
                    "load after"], out)]
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, type=pathlib.Path)
    ap.add_argument("--doc", type=pathlib.Path)
    ap.add_argument("--images", type=pathlib.Path)
    a = ap.parse_args()
    res = a.results
    if a.doc and not a.images:
        ap.error("--doc needs --images")

    data = {
        "batch_norm": read(res / "batch_norm.csv"),
        "allreduce": read(res / "allreduce_threads.csv") + read(res / "allreduce_mpi.csv"),
        "reduce": read(res / "reduce_threads.csv") + read(res / "reduce_mpi.csv"),
        "optimizer": read(res / "optimizer.csv"),
        "digits": [r for r in read(res / "digits.csv") if r["bench"] == "digits"],
        "digits_reproducible": [r for r in read(res / "digits.csv")
                                if r["bench"] == "digits_reproducible"],
        "overlap": read(res / "overlap_threads.csv") + read(res / "overlap_mpi.csv"),
        "hierarchical": read(res / "hierarchical.csv"),
        "reproducible": read(res / "reproducible_threads.csv") + read(res / "reproducible_mpi.csv"),
        "bn_step": read(res / "bn_step_threads.csv") + read(res / "bn_step_mpi.csv"),
    }
    plotters = {"batch_norm": plot_batch_norm, "allreduce": plot_allreduce,
                "reduce": plot_reduce, "optimizer": plot_optimizer, "digits": plot_digits,
                "overlap": plot_overlap, "hierarchical": plot_hierarchical,
                "reproducible": plot_reproducible, "bn_step": plot_bn_step}
    drawn = []
    for name in PLOTS:
        if data[name]:
            plotters[name](data[name], res / f"{name}.png")
            drawn.append(name)
    print(f"report.py: plots {', '.join(drawn) or '(none)'} in {res}")
    if not a.doc:
        return 0

    machine = {r["key"]: r["value"] for r in read(res / "machine.csv")}
    runs = read(res / "runs.csv")
    a.images.mkdir(parents=True, exist_ok=True)
    for old in a.images.glob("*.png"):
        old.unlink()
    for name in drawn:
        shutil.copyfile(res / f"{name}.png", a.images / f"{name}.png")
    rel = pathlib.Path(os.path.relpath(a.images, a.doc.parent))

    mode = machine.get("mode", "unknown")
    loads = [float(r[k]) for r in runs for k in ("load_before_1m", "load_after_1m")]
    load_range = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "unknown"
    cores = machine.get("cores", "?")
    lines = ["# Performance", "",
             "<!-- Generated by scripts/bench (bench/report.py) from build/bench-results/; "
             "edits here are overwritten. -->", "",
             f"Measured {machine.get('date', 'on an unknown date')} in a **{mode}** run on "
             f"{machine.get('cpu', 'an unknown CPU')} ({cores} cores, "
             f"{machine.get('memory', '?')}); 1-minute load average {load_range} across the "
             f"benchmarks (details in [Machine and load](#machine-and-load))."]
    if mode == "quick":
        lines += ["", "**This is a quick run** (`scripts/bench --quick`): few repetitions and "
                      "small sizes, to check the pipeline. Its numbers are not measurements; a "
                      "full run (`scripts/bench`) on a quiet machine replaces them."]
    try:
        busy = loads and max(loads) > float(cores) + 1
    except ValueError:
        busy = False
    lines += ["", "Load averages count the benchmarks' own threads (2 busy threads read 2.0; "
                  "`mpiexec -n 4` reads up to 4) and decay over a minute, so they sit near the "
                  "core count during a run."]
    if busy:
        lines += ["", f"The load average exceeded the {cores} cores by more than one during the "
                      "run: other work may have shared the machine, so times may be inflated."]
    failed = [r["bench"] for r in runs if r["exit_status"] != "0"]
    if failed:
        lines += ["", "Failed benchmarks (their numbers are missing or partial): " +
                  ", ".join(failed) + "."]
    lines += ["", "Every benchmark times its anchor in the same run, on the same threads; the "
                  "tables show the ratios to it. Reproduce with `bash scripts/bench` (add "
                  "`--quick` for a short pipeline check); it installs what is missing, builds the "
                  "`bench` preset, runs everything (MPI rows under `mpiexec -n 2`, the "
                  "hierarchical ones under `-n 4`, with `OMP_NUM_THREADS=1`) and writes the CSVs, "
                  "text outputs and plots to `build/bench-results/`. `bench/gpu_bench.cu` (CUDA "
                  "batch norm against cuDNN, NCCL all_reduce) needs a GPU and is not part of this "
                  "page; " + GPU_SUMMARY]

    sections = [("batch_norm", section_batch_norm(data["batch_norm"])),
                ("allreduce", section_allreduce(data["allreduce"])),
                ("reduce", section_reduce(data["reduce"])),
                ("optimizer", section_optimizer(data["optimizer"])),
                ("digits", section_digits(data["digits"]) +
                 section_digits_reproducible(data["digits_reproducible"])),
                ("overlap", section_overlap(data["overlap"])),
                ("hierarchical", section_hierarchical(data["hierarchical"])),
                ("reproducible", section_reproducible(data["reproducible"])),
                ("bn_step", section_bn_step(data["bn_step"]))]
    for name, text in sections:
        lines += [""] + text[:1] + [""]
        if not data[name]:
            lines += [text[2], "", "No results: the benchmark did not produce its CSV (see "
                      "runs in [Machine and load](#machine-and-load))."]
            continue
        lines += text[2:]
        lines += ["", f"![{name}]({(rel / (name + '.png')).as_posix()})"]
    lines += [""] + machine_section(machine, runs) + [""]
    a.doc.write_text("\n".join(lines))
    print(f"report.py: wrote {a.doc} and {len(drawn)} plots in {a.images}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
