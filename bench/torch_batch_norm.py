#!/usr/bin/env python3
# bench/torch_batch_norm.py: PyTorch's batch norm (F.batch_norm, training forward and backward) on
# gpu_bench's shapes, layouts and types, for the comparison of docs/gpu_batch_norm.md.
# SPDX-License-Identifier: Apache-2.0
"""Times torch.nn.functional.batch_norm as PyTorch users run it, beside bench/gpu_bench.cu.

Every (shape, layout, type): the forward (training, running statistics updated) is captured in
one CUDA graph and the backward (torch.autograd.grad of x, weight and bias) in a second one, as
torch.cuda.make_graphed_callables does; each replay is timed alone with CUDA events after a
read-only pass over four L2 sizes (as gpu_bench evicts the L2), and the median is kept. NHWC is
channels_last. Parameters are float32 for every data type (PyTorch's mixed batch norm, as
lockstep keeps them). One eager forward+backward runs under torch.profiler to record which
backend ran: the aten operator (cudnn_batch_norm or native_batch_norm) and the kernels' names.

  python3 bench/torch_batch_norm.py --csv torch_bn.csv
  python3 bench/torch_batch_norm.py --torch-csv torch_bn.csv --compare gpu_bench.csv
      (joins gpu_bench's CSV: lockstep's step against the best of cuDNN and PyTorch)

Exits 77 (skipped) without PyTorch or without a CUDA device.
"""
import argparse
import csv
import math
import sys

SHAPES = [(32, 64, 56, 56), (64, 256, 28, 28), (256, 64, 14, 14), (32, 1024, 14, 14),
          (256, 2048, 7, 7), (64, 256, 56, 56)]
TYPES = ["float", "half", "bf16"]
LAYOUTS = ["NCHW", "NHWC"]
FIELDS = ["device", "shape", "n", "c", "h", "w", "layout", "type", "mib", "torch_version",
          "cudnn_enabled", "cudnn_version", "backend", "graph", "fwd_ms", "fwd_min_ms", "bwd_ms",
          "bwd_min_ms", "step_ms", "ops", "kernels"]


def shape_name(s):
    return "x".join(str(v) for v in s)


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class Timer:
    """CUDA events around each call, after a read-only L2 flush."""

    def __init__(self, torch, warmup, iterations):
        self.torch = torch
        self.warmup = warmup
        self.iterations = max(iterations, 1)
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 0) or (50 << 20)
        self.flush_bytes = max(4 * l2, 128 << 20)
        self.flush_buf = torch.zeros(self.flush_bytes // 4, dtype=torch.int32, device="cuda")

    def flush(self):
        # a reduction reads the buffer and writes one value: the lines left in L2 are clean
        self.flush_buf.max()

    def time(self, f):
        torch = self.torch
        for _ in range(self.warmup):
            self.flush()
            f()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iterations)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(self.iterations)]
        for i in range(self.iterations):
            self.flush()
            starts[i].record()
            f()
            stops[i].record()
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in zip(starts, stops)]
        return median(ms), min(ms)


def short_kernel(name):
    """A kernel's name without its template arguments and parameter list."""
    depth = 0
    out = []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip()
    return s.split(" ")[-1] if " " in s else s


def backend_of(torch, run_eager):
    """(backend, aten batch-norm operators, kernels) of one eager forward+backward, from the
    profiler's events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_eager()
        torch.cuda.synchronize()
    ops = set()
    kernels = []
    for e in prof.events():
        kind = str(getattr(e, "device_type", ""))
        if kind.endswith("CUDA"):
            k = short_kernel(e.name)
            if k not in kernels and "memset" not in k.lower() and "memcpy" not in k.lower():
                kernels.append(k)
        else:
            ops.add(e.name)
    bn_ops = sorted(o for o in ops if "batch_norm" in o)
    lowered = [k.lower() for k in kernels]
    if any("cudnn_batch_norm" in o for o in bn_ops) or any(
            "cudnn" in k or "bn_fw" in k or "bn_bw" in k or "batchnorm" in k for k in lowered):
        backend = "cudnn"
    elif any("miopen" in o for o in bn_ops):
        backend = "miopen"
    elif any("batch_norm" in k for k in lowered) or any("native_batch_norm" in o for o in bn_ops):
        backend = "native"
    else:
        backend = "unknown"
    return backend, ";".join(bn_ops), ";".join(kernels)


def bench_one(torch, timer, device, s, layout, type_name):
    F = torch.nn.functional
    dtype = {"float": torch.float32, "half": torch.float16, "bf16": torch.bfloat16}[type_name]
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    n, c, h, w = s
    x = torch.empty(s, dtype=dtype, device="cuda").uniform_(-1.5, 2.5)
    x = x.contiguous(memory_format=fmt).requires_grad_(True)
    dy = torch.empty(s, dtype=dtype, device="cuda").uniform_(-1.0, 1.0)
    dy = dy.contiguous(memory_format=fmt)
    weight = torch.ones(c, device="cuda", requires_grad=True)
    bias = torch.zeros(c, device="cuda", requires_grad=True)
    running_mean = torch.zeros(c, device="cuda")
    running_var = torch.ones(c, device="cuda")

    def forward():
        return F.batch_norm(x, running_mean, running_var, weight, bias, training=True,
                            momentum=0.1, eps=1e-5)

    def eager():
        y = forward()
        torch.autograd.grad(y, (x, weight, bias), dy)

    backend, bn_ops, kernels = backend_of(torch, eager)
    graph = "yes"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(side)
        fwd_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd_graph):
            y = forward()
        bwd_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bwd_graph, pool=fwd_graph.pool()):
            torch.autograd.grad(y, (x, weight, bias), dy)
        fwd = timer.time(fwd_graph.replay)
        bwd = timer.time(bwd_graph.replay)
    except RuntimeError as e:  # capture refused: eager calls, marked as such
        graph = "no: " + str(e).splitlines()[0][:80].replace(",", ";")
        torch.cuda.synchronize()
        state = {}

        def eager_forward():
            state["y"] = forward()

        fwd = timer.time(eager_forward)
        bwd = timer.time(
            lambda: torch.autograd.grad(state["y"], (x, weight, bias), dy, retain_graph=True))
    mib = x.numel() * x.element_size() / (1 << 20)
    return {
        "device": device, "shape": shape_name(s), "n": n, "c": c, "h": h, "w": w,
        "layout": layout, "type": type_name, "mib": "%.3f" % mib,
        "torch_version": torch.__version__,
        "cudnn_enabled": int(torch.backends.cudnn.enabled),
        "cudnn_version": torch.backends.cudnn.version() or "",
        "backend": backend, "graph": graph,
        "fwd_ms": "%.6f" % fwd[0], "fwd_min_ms": "%.6f" % fwd[1],
        "bwd_ms": "%.6f" % bwd[0], "bwd_min_ms": "%.6f" % bwd[1],
        "step_ms": "%.6f" % (fwd[0] + bwd[0]), "ops": bn_ops, "kernels": kernels,
    }


def measure(args):
    try:
        import torch
    except ImportError:
        print("torch_batch_norm: skipped: no PyTorch")
        return None
    if not torch.cuda.is_available():
        print("torch_batch_norm: skipped: no CUDA device")
        return None
    timer = Timer(torch, args.warmup, args.iterations)
    device = torch.cuda.get_device_name(0)
    print("%s, torch %s, cudnn %s (enabled %s), L2 flushed by reading %.0f MiB before every "
          "timed replay, median of %d" % (device, torch.__version__, torch.backends.cudnn.version(),
                                          torch.backends.cudnn.enabled,
                                          timer.flush_bytes / 1048576, timer.iterations))
    rows = []
    for s in SHAPES:
        if args.shape and shape_name(s) not in args.shape:
            continue
        for layout in LAYOUTS:
            if args.layout and layout.lower() not in [v.lower() for v in args.layout]:
                continue
            for t in TYPES:
                if args.type and t not in args.type:
                    continue
                r = bench_one(torch, timer, device, s, layout, t)
                rows.append(r)
                print("%-16s %s %-5s fwd %8.3f ms bwd %8.3f ms step %8.3f ms  %s (graph %s)" %
                      (r["shape"], layout, t, float(r["fwd_ms"]), float(r["bwd_ms"]),
                       float(r["step_ms"]), r["backend"], r["graph"]), flush=True)
    return rows


def key(r):
    return (r["shape"], r["layout"].upper(), r["type"])


def compare(torch_rows, gpu_bench_csv, out_path):
    """lockstep's step against min(best cuDNN entry point, PyTorch) per configuration."""
    with open(gpu_bench_csv, newline="") as f:
        ours = {key(r): r for r in csv.DictReader(f)}
    theirs = {key(r): r for r in torch_rows}
    rows = []
    print("%-16s %-4s %-5s %9s %9s %9s %9s %s" % ("shape", "lay.", "type", "lockstep", "cuDNN",
                                                  "PyTorch", "vs best", "1.25x 8S"))
    for k, r in ours.items():
        t = theirs.get(k)
        lock = float(r["step_ms"])
        cud = float(r["best_cudnn_step_ms"])
        pt = float(t["step_ms"]) if t else math.nan
        best = min(v for v in (cud, pt, math.inf) if not math.isnan(v))
        ratio = lock / best if best < math.inf else math.nan
        rows.append({"shape": k[0], "layout": k[1], "type": k[2], "lockstep_step_ms": lock,
                     "best_cudnn": r["best_cudnn"], "best_cudnn_step_ms": cud,
                     "torch_step_ms": pt, "torch_backend": t["backend"] if t else "",
                     "step_over_best": ratio, "step_over_bound": r["step_over_bound"],
                     "target_1p25": r["target_1p25"],
                     "no_slower": "n/a" if math.isnan(ratio) else ("yes" if ratio <= 1 else "no")})
        print("%-16s %-4s %-5s %9.3f %9.3f %9.3f %9.2f %s" % (k[0], k[1], k[2], lock, cud, pt,
                                                              ratio, r["target_1p25"]))
    if out_path:
        with open(out_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["shape"])
            w.writeheader()
            w.writerows(rows)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", help="write the PyTorch timings here")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--shape", action="append", help="NxCxHxW (repeatable; default all)")
    p.add_argument("--layout", action="append", help="nchw or nhwc (repeatable)")
    p.add_argument("--type", action="append", choices=TYPES, help="repeatable")
    p.add_argument("--torch-csv", help="read PyTorch timings from this CSV instead of measuring")
    p.add_argument("--compare", metavar="GPU_BENCH_CSV",
                   help="join gpu_bench --csv output: lockstep against the best of cuDNN and "
                        "PyTorch")
    p.add_argument("--combined", help="write the joined table here (with --compare)")
    args = p.parse_args()
    if args.torch_csv:
        with open(args.torch_csv, newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = measure(args)
        if rows is None:
            return 77
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(rows)
    if args.compare:
        compare(rows, args.compare, args.combined)
    return 0


if __name__ == "__main__":
    sys.exit(main())
