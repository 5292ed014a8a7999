#!/usr/bin/env python3
# tests/cuda/check_kernel_images.py: every kernel that the host code of a CUDA object file
# launches has device code in that object, checked from the symbols alone (no GPU needed).
#
# For each kernel the host code launches, nvcc emits a host wrapper,
# __wrapper__device_stub_<kernel>. When its device pass instantiated the kernel too, it also
# emits the registering stub __device_stub_<mangled kernel>; without it, the launch fails with
# cudaErrorInvalidDeviceFunction on every GPU. nvcc's two passes can disagree: a
# requires-expression holding a lambda is true in the host pass and false in the device pass
# (train/detail/replica_core.hpp's norm_reducing says so), and a kernel guarded by it got a
# wrapper and no device code. Arguments: object files, or ;-separated lists of them (CMake's
# $<TARGET_OBJECTS>). SPDX-License-Identifier: Apache-2.0
import re
import subprocess
import sys


def kernel_name(name):
    """'void a::b::f<c::d, e(g)>(int*)' -> 'f<c::d, e(g)>': the outermost name without its
    return type, namespaces and parameter list (what a wrapper and its kernel share)."""
    name = name.replace("(anonymous namespace)", "{anonymous}")
    depth = 0
    start = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0 and ch == "(":
            return name[start:i]
        elif depth == 0 and ch == " ":
            start = i + 1
        elif depth == 0 and ch == ":" and name[i + 1 : i + 2] == ":":
            start = i + 2
    return name[start:]


def demangle(names):
    """c++filt, with nvcc's per-file names of anonymous namespaces written as c++filt writes
    the plain ones, so a kernel and its wrapper read alike."""
    if not names:
        return []
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout
    return [re.sub(r"_GLOBAL__N__\w+?::", "(anonymous namespace)::", line)
            for line in out.split("\n")[: len(names)]]


def check(obj):
    """(launched kernels, kernels without device code) of one object file. Each host wrapper
    has exactly one registering stub when every kernel has device code, so the counts decide;
    the names (matched after demangling) only say which kernels lack it."""
    nm = subprocess.run(["nm", "--defined-only", obj], capture_output=True, text=True, check=True)
    functions = [f[2] for f in (line.split() for line in nm.stdout.splitlines())
                 if len(f) == 3 and f[1] in "tTW"]
    wrapper_symbols = [f for f in functions if "__wrapper__device_stub_" in f]
    stub_symbols = [f for f in functions if "__device_stub__Z" in f and f not in wrapper_symbols]
    missing = max(0, len(wrapper_symbols) - len(stub_symbols))
    print(f"{obj}: {len(wrapper_symbols)} launched kernels, {missing} without device code")
    if missing:
        wrappers = {kernel_name(w.split("__wrapper__device_stub_", 1)[1])
                    for w in demangle(wrapper_symbols)}
        kernels = [d.split("__device_stub_", 1)[1].split("(", 1)[0]
                   for d in demangle(stub_symbols)]
        with_device = {kernel_name(k) for k in demangle(kernels)}
        for w in sorted(wrappers - with_device):
            print(f"    no device code: {w[:400]}")
    return len(wrapper_symbols), missing


def main(args):
    objects = [o for arg in args for o in arg.split(";") if o]
    if not objects:
        sys.exit("usage: check_kernel_images.py OBJECT...")
    launched = 0
    missing = 0
    for obj in objects:
        w, m = check(obj)
        launched += w
        missing += m
    if launched == 0:
        sys.exit("no launched kernels found: the check would prove nothing")
    if missing:
        sys.exit(f"{missing} launched kernels have no device code")
    print(f"all {launched} launched kernels have device code")


if __name__ == "__main__":
    main(sys.argv[1:])
