#!/usr/bin/env python3
# gpu_run.py: scripts/gpu_check's bundle tool: `stage` lays out a bundle from a CUDA build (the
# CTest manifest, the executables, the digits data); `run` runs it stage by stage on a GPU machine.
# SPDX-License-Identifier: Apache-2.0
#
# Python 3.8+, standard library only: it runs on the build machine and on the GPU machine.
# The stages of `run`, in order, each under its own timeout (its process group killed at the
# end) and each recording its result as it ends: env (versions, libraries, the NCCL check),
# nccl_probe (2 ranks), the multi-rank tests, the single-GPU tests of FIRST_SINGLE_TESTS,
# gpu_digits (accuracy), gpu_bench, its PyTorch anchor, ncu (batch-norm kernel metrics),
# gpu_bench_odd (the odd-plane shape 32x288x35x35), then the other single-GPU CUDA tests: what
# has never passed on a GPU first, so a short budget leaves out what has. A stage still running
# when the budget ends is killed and recorded as failed (it may hang); one the budget leaves no
# time to start, as skipped. Without a GPU every stage is recorded as skipped.
import argparse
import csv
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

RESULTS = "results.jsonl"
SUMMARY = "summary.md"
ARCHIVE = "gpu-check-results.tar.gz"
EXTRA_EXECUTABLES = {"gpu_bench": "bench", "gpu_digits": "digits", "gpu_check_probe": "probe"}
# A shape outside the that gpu_bench also times: odd planes too wide for the channel tiles,
# whose reductions read the vectors inside each plane and its edges by value.
ODD_PLANES_SHAPE = "32x288x35x35"
DIGITS_DATA = "examples/digits/data/digits.csv.gz"
SOURCE_FILES = ["scripts/trace_merge.py", "bench/torch_batch_norm.py"]
# The wheels (and toolkit) whose lib folders are searched, by the library each must provide.
RUNTIME_LIBS = ["libnccl.so", "libcudnn.so", "libcublas.so", "libcublasLt.so", "libcudart.so"]
NCU_METRICS = [
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
    "launch__block_size",
    "launch__grid_size",
    "launch__occupancy_limit_registers",
    "sm__maximum_warps_per_active_cycle_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
]
# The configurations ncu profiles, one gpu_bench call each (its forward and backward: 4 launches):
# the 7x7 channel tiles in both types, the NCHW planes vectors, the NHWC rows and their fold.
NCU_CASES = [
    ("7x7_nchw_half", ["--shape", "256x2048x7x7", "--layout", "nchw", "--type", "half"]),
    ("7x7_nchw_float", ["--shape", "256x2048x7x7", "--layout", "nchw", "--type", "float"]),
    ("56x56_nchw_float", ["--shape", "32x64x56x56", "--layout", "nchw", "--type", "float"]),
    ("28x28_nhwc_half", ["--shape", "64x256x28x28", "--layout", "nhwc", "--type", "half"]),
]
LOG_LIMIT = 2 << 20  # bytes of one stage's log kept (head and tail) in the archive
# The single-GPU tests run before the benchmarks: the kernels gpu_bench times, shown correct first.
FIRST_SINGLE_TESTS = ("test_bn_cuda",)
# Each test's seconds in the last GPU run (2026-12-04, H200; docs/gpu.md). A test starts only
# with 1.5x its last time left in the budget (so the budget does not cut a test that is merely
# slow and record it failed) and is stopped at the longer of 4x that time, 60 s and
# LOCKSTEP_TIMEOUT + 30 s (so one hang cannot take the rest of the budget; lockstep's own
# timeout still fires first). A test not listed starts with --test-min-seconds left and runs
# under its CTest timeout.
LAST_SECONDS = {
    "multi_rank:test_nccl_ranks_collectives_r2": 10.7,
    "multi_rank:test_nccl_ranks_collectives_r3": 16.0,
    "multi_rank:test_nccl_ranks_trainer_r2": 19.9,
    "multi_rank:test_nccl_ranks_trainer_r3": 24.8,
    "multi_rank:test_nccl_ranks_faults_throw_r2": 2.6,
    "multi_rank:test_nccl_ranks_faults_throw_r3": 3.3,
    "multi_rank:test_nccl_ranks_faults_kill_r2": 2.0,
    "multi_rank:test_nccl_ranks_faults_kill_r3": 2.8,
    "multi_rank:test_nccl_ranks_faults_shrink_r2": 23.0,
    "multi_rank:test_nccl_ranks_faults_shrink_r3": 23.7,
    "single:test_cuda_system": 0.6,
    "single:test_nccl_init_timeout": 1.9,
    "single:test_nccl": 51.0,
    "single:test_cuda_kernels": 8.8,
    "single:test_bn_cuda": 39.2,
    "single:test_trainer_nccl": 5.9,
    "single:test_trainer_gpu": 15.1,
    "single:test_graph_capture": 5.9,
    "single:test_bn_nccl": 16.9,
    "single:test_mixed_precision_cuda": 2.8,
    "single:test_shared_gpu": 13.4,
    "single:test_exact_sum_cuda": 0.8,
    "single:test_verify_cuda": 3.3,
    "digits:example_gpu_digits": 2.6,
}
# The reasons a runner gives a stage it skips that a rerun may remove (the budget, no GPU, the
# NCCL probe, a library or executable missing): --rerun-failed repeats such stages too. A stage
# that skipped itself (exit 77, no ncu permission, an excluded test) is not repeated.
RERUN_SKIP = re.compile(r"^(budget:|no GPU:|stage 0 )|is not in the bundle|not found \(LD_LIBRARY"
                        r"|is older than the headers")


# ---------------------------------------------------------------------------------------------
# stage: the bundle's layout from a build directory


def ctest_tests(build_dir):
    """The tests labelled cuda, as `ctest --show-only=json-v1` describes them."""
    ctest = os.environ.get("CTEST", "ctest")
    out = subprocess.run(
        [ctest, "--test-dir", build_dir, "--show-only=json-v1", "-L", "cuda"], check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
    return json.loads(out)["tests"]


def ctest_file_commands(build_dir):
    """Each test's command as CTestTestfile.cmake writes it: `ctest --show-only` names none for
    a test whose executable is not built (the skip test's case), this file always does."""
    commands = {}
    for here, _, files in os.walk(build_dir):
        if "CTestTestfile.cmake" not in files:
            continue
        with open(os.path.join(here, "CTestTestfile.cmake"), errors="replace") as f:
            for line in f:
                m = re.match(r"add_test\(\[=\[(.+?)\]=\] (.*)\)\s*$", line)
                if m:
                    commands[m.group(1)] = [x.replace('\\"', '"') for x in
                                            re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2))]
    return commands


def find_executable(build_dir, name):
    for sub in ("tests/cuda", "bench", "examples/gpu_digits", "tests", "examples"):
        path = os.path.join(build_dir, sub, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def needed_libraries(path):
    """The DT_NEEDED entries of an ELF file (readelf), so the runner can say what is missing."""
    try:
        out = subprocess.run(["readelf", "-d", path], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, universal_newlines=True).stdout
    except OSError:
        return []
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def header_versions(build_dir):
    """NCCL, cuDNN and cuBLAS versions of the headers the build compiled against."""
    cache = {}
    with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
        for line in f:
            m = re.match(r"([A-Za-z_0-9]+):[A-Z]+=(.*)", line.strip())
            if m:
                cache[m.group(1)] = m.group(2)
    dirs = [cache.get("LOCKSTEP_NCCL_INCLUDE_DIR", ""), cache.get("LOCKSTEP_CUDNN_INCLUDE_DIR", ""),
            cache.get("CUDAToolkit_INCLUDE_DIR", ""), "/usr/local/cuda/include", "/usr/include"]

    def grab(header, names):
        for d in dirs:
            path = os.path.join(d, header)
            if d and os.path.isfile(path):
                text = open(path, errors="replace").read()
                parts = []
                for n in names:
                    m = re.search(r"#define\s+%s\s+(\d+)" % n, text)
                    parts.append(m.group(1) if m else "?")
                return {"version": ".".join(parts), "header": path}
        return None

    return {
        "nccl": grab("nccl.h", ["NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"]),
        "cudnn": grab("cudnn_version.h", ["CUDNN_MAJOR", "CUDNN_MINOR", "CUDNN_PATCHLEVEL"]),
        "cublas": grab("cublas_api.h",
                       ["CUBLAS_VER_MAJOR", "CUBLAS_VER_MINOR", "CUBLAS_VER_PATCH"]),
        "cuda_architectures": cache.get("CMAKE_CUDA_ARCHITECTURES"),
        "nvcc": cache.get("CMAKE_CUDA_COMPILER"),
        "cudart": cache.get("CUDA_cudart_LIBRARY"),
    }


def git_state(source_dir):
    def git(*args):
        return subprocess.run(["git", "-C", source_dir] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, universal_newlines=True).stdout.strip()
    status = git("status", "--porcelain", "--untracked-files=normal").splitlines()
    untracked = [ln for ln in status if ln.startswith("??")]
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(status),
            "changed_files": len(status) - len(untracked), "untracked_files": len(untracked)}


def classify(name, args, exe):
    if exe == "gpu_digits":
        return "digits"
    if re.search(r"_r\d+$", name) or "--ranks" in args:
        return "multi_rank"
    return "single"


def stage_bundle(a):
    """Writes the bundle's tree: bin/, lib/, data/, manifest.json, build_info.json, gpu_run.py."""
    build_dir = os.path.realpath(a.build_dir)
    source_dir = os.path.realpath(a.source_dir)
    out = os.path.abspath(a.out)
    os.makedirs(os.path.join(out, "bin"), exist_ok=True)
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    os.makedirs(os.path.join(out, "lib"), exist_ok=True)
    entries, executables, problems = [], {}, []

    def bundle_executable(name, path):
        if name in executables:
            return executables[name]["path"] is not None
        target = os.path.join(out, "bin", name)
        present = path is not None and os.path.isfile(path)
        if present:
            if a.link:
                if os.path.lexists(target):
                    os.remove(target)
                os.symlink(path, target)
            else:
                shutil.copy2(path, target)
                subprocess.run(["strip", "--strip-unneeded", target], check=True)
        executables[name] = {"path": "bin/" + name if present else None,
                             "needs": needed_libraries(path) if present else []}
        return present

    file_commands = ctest_file_commands(build_dir)
    for t in ctest_tests(build_dir):
        name = t["name"]
        if name.startswith("gpu_check"):
            continue  # the runner's own test: running it inside the runner would recurse
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        command = t.get("command") or file_commands.get(name)
        entry = {"name": name, "labels": props.get("LABELS", []),
                 "timeout": float(props.get("TIMEOUT", 300)),
                 "skip_code": props.get("SKIP_RETURN_CODE"),
                 "environment": props.get("ENVIRONMENT", []),
                 "environment_modification": props.get("ENVIRONMENT_MODIFICATION", []),
                 "processors": props.get("PROCESSORS", 1),
                 # The runner gives each test a fresh folder instead (the build tree is not there).
                 "working_directory": os.path.relpath(props.get("WORKING_DIRECTORY", build_dir),
                                                      build_dir)}
        if not command:
            entry.update(kind="excluded", executable=None, args=[],
                         excluded="CTest names no command for it")
            entries.append(entry)
            continue
        if "no_gpu" in entry["labels"]:
            entry.update(kind="excluded", executable=None, args=command[1:],
                         excluded="needs no GPU (label no_gpu): it runs on the build machine")
            entries.append(entry)
            continue
        exe_path = os.path.realpath(command[0])
        exe = os.path.basename(exe_path)
        if not exe_path.startswith(build_dir + os.sep):
            entry.update(kind="excluded", executable=None, args=command[1:],
                         excluded="runs %s (a build-machine test, not a bundled executable)" % exe)
            entries.append(entry)
            continue
        args = []
        for arg in command[1:]:
            if arg.startswith(build_dir + os.sep) or arg.startswith(source_dir + os.sep):
                problems.append("%s: argument %s is a path of this machine" % (name, arg))
            args.append(arg)
        if exe == "gpu_digits" and "--data" not in args:
            args += ["--data", "{root}/data/digits.csv.gz"]
        entry.update(kind=classify(name, args, exe), executable=exe, args=args, excluded=None)
        bundle_executable(exe, exe_path if os.path.isfile(exe_path) else None)
        entries.append(entry)
    for exe in EXTRA_EXECUTABLES:
        bundle_executable(exe, find_executable(build_dir, exe))
    missing = sorted(n for n, e in executables.items() if e["path"] is None)
    if missing and not a.allow_missing:
        raise SystemExit("gpu_run.py stage: not built in %s: %s" % (build_dir, " ".join(missing)))
    data = os.path.join(source_dir, DIGITS_DATA)
    shutil.copy2(data, os.path.join(out, "data", "digits.csv.gz"))
    versions = header_versions(build_dir)
    # The CUDA runtime the build linked, for a GPU machine whose toolkit lies outside the
    # loader's path (0.7 MiB); NCCL, cuDNN and cuBLAS come from that machine's wheels.
    cudart = versions.get("cudart")
    if cudart and os.path.isfile(cudart) and not a.link:
        real = os.path.realpath(cudart)
        soname = re.sub(r"(\.so\.\d+).*$", r"\1", os.path.basename(real))
        shutil.copy2(real, os.path.join(out, "lib", soname))
    shutil.copy2(os.path.abspath(__file__), os.path.join(out, "gpu_run.py"))
    # Source files the stages run: trace_merge.py (the fault tests merge flight-recorder files
    # with it; the runner points LOCKSTEP_SOURCE_DIR at src/) and gpu_bench's PyTorch anchor.
    for rel in SOURCE_FILES:
        if os.path.isfile(os.path.join(source_dir, rel)):
            os.makedirs(os.path.dirname(os.path.join(out, "src", rel)), exist_ok=True)
            shutil.copy2(os.path.join(source_dir, rel), os.path.join(out, "src", rel))
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"tests": entries, "executables": executables}, f, indent=1)
    info = {"built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_dir": build_dir, "git": git_state(source_dir), "headers": versions,
            "missing": missing, "problems": problems, "linked": bool(a.link),
            "stale_steps": a.stale_steps}
    with open(os.path.join(out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    for p in problems:
        print("gpu_run.py stage: warning: " + p, file=sys.stderr)
    print("staged %d tests, %d executables%s into %s" % (
        len(entries), len(executables),
        " (not built: %s)" % " ".join(missing) if missing else "", out))


# ---------------------------------------------------------------------------------------------
# run: the stages on the GPU machine


def version_tuple(text):
    nums = [int(x) for x in re.findall(r"\d+", text or "")[:3]]
    return tuple(nums) if nums else None


def nccl_code_to_version(code):
    code = int(code)
    if code >= 10000:  # NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9
        return "%d.%d.%d" % (code // 10000, (code // 100) % 100, code % 100)
    return "%d.%d.%d" % (code // 1000, (code // 100) % 10, code % 100)


# The interpreters asked where torch and the NVIDIA wheels are, after --python (LOCKSTEP_PYTHON),
# the PATH's python3 and python and the running one: the usual places of conda, venvs and pyenv
# ("~": the home folder). A pattern matching no file costs nothing.
PYTHON_PLACES = ["/opt/conda/bin/python", "/opt/conda/envs/*/bin/python", "~/.venv/bin/python",
                 "~/*/.venv/bin/python", "~/venv/bin/python", "~/miniconda3/bin/python",
                 "~/miniconda3/envs/*/bin/python", "~/anaconda3/bin/python",
                 "~/anaconda3/envs/*/bin/python", "/opt/*/bin/python", "/opt/*/.venv/bin/python",
                 "~/.pyenv/versions/*/bin/python", "/usr/local/bin/python3", "/usr/bin/python3"]
# What each interpreter answers (any Python 3; a Python 2 or a broken one answers nothing usable).
PYTHON_PROBE = r"""
import importlib.util, json, os, sys
def spec(name):
    try:
        return importlib.util.find_spec(name)
    except Exception:
        return None
t, n = spec("torch"), spec("nvidia")
print(json.dumps({"prefix": sys.prefix,
                  "torch": os.path.dirname(t.origin) if t is not None and t.origin else None,
                  "nvidia": list(n.submodule_search_locations or []) if n is not None else []}))
"""
# Folders the bounded walk for */site-packages/nvidia never enters (at the root: the kernel's).
WALK_SKIP_TOP = {"proc", "sys", "dev", "run"}
WALK_SKIP = {".git", "node_modules", "__pycache__", ".cache"}


def nccl_version_of(name):
    """The version a file or dist-info folder name states: libnccl.so.2.28.9 or
    nvidia_nccl_cu13-2.28.9.dist-info gives (2, 28, 9); None for any other name."""
    m = re.match(r"libnccl\.so\.(\d+\.\d+\.\d+)$|nvidia_nccl_cu\d+-(\d+(?:\.\d+)+)\.dist-info$",
                 name)
    return version_tuple(m.group(1) or m.group(2)) if m else None


def wheel_tree(locations, python=None, torch=None, how=""):
    """One installation's NVIDIA wheels: `locations`, the nvidia package's folders in its
    interpreter's own order (kept: it is the order that interpreter loads them in). Returns
    its library folders (those holding a library of RUNTIME_LIBS, in that order), the wheels'
    versions (from the dist-info folders beside each location) and its newest NCCL version (from
    libnccl.so.X.Y.Z names and the nvidia-nccl wheels; None: not stated)."""
    dirs, wheels, nccl = [], {}, None
    for loc in locations:
        for here, subdirs, files in os.walk(loc):
            subdirs.sort()
            if here[len(loc):].count(os.sep) > 3:
                subdirs[:] = []
                continue
            if any(f.startswith(lib) for f in files for lib in RUNTIME_LIBS):
                dirs.append(here)
            for f in files:
                v = nccl_version_of(f)
                nccl = max(nccl, v) if nccl and v else (nccl or v)
        try:
            beside = sorted(os.listdir(os.path.dirname(loc)))
        except OSError:
            beside = []
        for f in beside:
            m = re.match(r"(nvidia_[^-]*|torch)-([^-]+)\.dist-info$", f)
            if m:
                wheels.setdefault(m.group(1).replace("_", "-").lower(), m.group(2))
            v = nccl_version_of(f)
            nccl = max(nccl, v) if nccl and v else (nccl or v)
    return {"python": python, "how": how, "locations": list(locations), "torch": torch,
            "dirs": dirs, "wheels": wheels, "nccl": nccl}


def ask_python(python, timeout):
    """What `python` answers to PYTHON_PROBE within `timeout` seconds, or None."""
    code, text = quick([python, "-c", PYTHON_PROBE], timeout=max(0.5, timeout))
    try:
        answer = json.loads(text.strip().splitlines()[-1]) if code == 0 else None
    except (ValueError, IndexError):
        answer = None
    return answer if isinstance(answer, dict) else None


def python_candidates(root):
    """The interpreters to ask, in order, without duplicates: PATH's python3 and python and the
    running one (not under a simulated `root`), then PYTHON_PLACES, each under `root` ("~":
    root/home there)."""
    found = []
    if root == "/":
        for d in os.environ.get("PATH", "").split(os.pathsep):
            for name in ("python3", "python"):
                found.append(os.path.join(d or ".", name))
        found.append(sys.executable)
        home = os.path.expanduser("~")
    else:
        home = os.path.join(root, "home")
    for pattern in PYTHON_PLACES:
        if pattern.startswith("~"):
            pattern = home + pattern[1:]
        else:
            pattern = os.path.join(root, pattern.lstrip("/"))
        found += sorted(glob.glob(pattern))
    out = []
    for p in found:
        p = os.path.abspath(p)  # not realpath: a venv's python is a link to its base's
        if p not in out and os.path.isfile(p) and os.access(p, os.X_OK):
            out.append(p)
    return out


def walk_site_packages(root, deadline, max_depth=8):
    """Each */site-packages and */dist-packages under `root` that holds an nvidia package,
    shallowest first (breadth first, at most `max_depth` folders down, until `deadline`
    (time.monotonic()), never following a link nor entering WALK_SKIP(_TOP))."""
    found, level = [], [root]
    for depth in range(max_depth + 1):
        below = []
        for here in level:
            if time.monotonic() > deadline:
                return found
            try:
                entries = sorted(os.scandir(here), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                try:
                    if not e.is_dir(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                if e.name in WALK_SKIP or (depth == 0 and e.name in WALK_SKIP_TOP):
                    continue
                if e.name in ("site-packages", "dist-packages"):
                    if os.path.isdir(os.path.join(e.path, "nvidia")):
                        found.append(e.path)
                else:
                    below.append(e.path)
        level = below
    return found


def site_python(site):
    """The interpreter of a site-packages folder found by the walk (PREFIX/lib/pythonX.Y/...:
    PREFIX/bin/pythonX.Y, python3 or python), or None."""
    parts = site.split(os.sep)
    if len(parts) >= 4 and parts[-3] in ("lib", "lib64") and parts[-2].startswith("python"):
        prefix = os.sep.join(parts[:-3])
        for name in (parts[-2], "python3", "python"):
            p = os.path.join(prefix, "bin", name)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    return None


def wheel_library_dirs(python=None, root="/", budget_s=30.0, nccl_version=None):
    """The NVIDIA pip wheels (the nvidia.* namespace, cu12 or cu13 layout) of ONE installation,
    and the interpreter that runs the PyTorch anchor. `python` (--python, LOCKSTEP_PYTHON) is
    asked first and, when it holds the wheels, chosen; otherwise every interpreter of
    python_candidates(root) is asked (PYTHON_PROBE, a few seconds each) and, when none holds
    them or none holds torch, the folders under `root` are walked for */site-packages/nvidia
    (walk_site_packages). Of the installations found the one holding torch is chosen (PyTorch's
    own NCCL, the one its wheels were tested with), else the one with the newest NCCL (from file
    and wheel names, else nccl_version(dirs), the bundle's probe); never a union, whose order
    could put an older NCCL first. All within `budget_s` seconds. Returns a dict: dirs (the
    chosen library folders, in load order), wheels (their versions), python (the interpreter for
    the anchor: the chosen one, else one holding torch, else None), chosen (which and why) and
    trees (every installation considered), log (what was asked)."""
    deadline = time.monotonic() + budget_s
    log, trees, pythons_with_torch = [], [], []
    seen = set()

    def add(tree):
        key = tuple(os.path.realpath(x) for x in tree["locations"])
        if tree["dirs"] and key not in seen:
            seen.add(key)
            trees.append(tree)

    asked = []
    if python:
        asked.append((python, "given (--python or LOCKSTEP_PYTHON)"))
    asked += [(p, "interpreter") for p in python_candidates(root) if p != python]
    prefixes = set()
    for p, how in asked:
        left = deadline - time.monotonic()
        if left <= 0:
            log.append("search budget of %.0fs spent: %s and later not asked" % (budget_s, p))
            break
        answer = ask_python(p, min(10.0, left))
        log.append("%s: %s" % (p, json.dumps(answer) if answer else "no answer"))
        if answer is None:
            continue
        if answer.get("prefix") in prefixes:  # e.g. python and python3 of one environment
            continue
        prefixes.add(answer.get("prefix"))
        if answer.get("torch"):
            pythons_with_torch.append(p)
        add(wheel_tree([x for x in answer.get("nvidia") or [] if os.path.isdir(x)], p,
                       answer.get("torch"), how))
        if python and p == python and trees and trees[-1]["python"] == python:
            break  # the given interpreter holds the wheels: nothing else is asked
    given = python is not None and any(t["python"] == python for t in trees)
    if not given and (not trees or not any(t["torch"] for t in trees)):
        for site in walk_site_packages(root, deadline):
            torch = os.path.join(site, "torch")
            torch = torch if os.path.isdir(torch) else None
            add(wheel_tree([os.path.join(site, "nvidia")], site_python(site) if torch else None,
                           torch, "walk"))
        log.append("walked %s for */site-packages/nvidia: %d installations in all" % (
            root, len(trees)))
    if nccl_version is not None and len(trees) > 1:
        for t in trees:
            if t["nccl"] is None and time.monotonic() < deadline:
                t["nccl"] = nccl_version(t["dirs"])
    chosen, why = None, "no NVIDIA wheels found"
    if given:
        chosen = next(t for t in trees if t["python"] == python)
        why = "the interpreter given (--python or LOCKSTEP_PYTHON)"
    elif trees:
        order = {id(t): i for i, t in enumerate(trees)}
        chosen = max(trees, key=lambda t: (t["torch"] is not None, t["nccl"] or (), -order[id(t)]))
        with_torch = sum(1 for t in trees if t["torch"])
        why = ("it holds torch" + (" and the newest NCCL of the %d that do" % with_torch
                                   if with_torch > 1 else "")
               if chosen["torch"] else "none holds torch; it has the newest NCCL")
    anchor = python if python in pythons_with_torch else (
        chosen["python"] if chosen and chosen["torch"] else
        (pythons_with_torch[0] if pythons_with_torch else python))

    def describe(t):
        return "%s (%s; NCCL %s%s)" % (t["python"] or t["locations"][0], t["how"],
                                       ".".join(map(str, t["nccl"])) if t["nccl"] else "?",
                                       "; torch " + t["torch"] if t["torch"] else "")

    text = "%s: %s, of %d installations" % (describe(chosen), why, len(trees)) if chosen else why
    return {"dirs": chosen["dirs"] if chosen else [], "wheels": chosen["wheels"] if chosen else {},
            "python": anchor, "chosen": text, "log": log,
            "trees": [dict(t, nccl=".".join(map(str, t["nccl"])) if t["nccl"] else None)
                      for t in trees]}


class runner:
    def __init__(self, a):
        self.a = a
        self.start = time.monotonic()
        self.out = os.path.abspath(a.outdir)
        os.makedirs(self.out, exist_ok=True)
        self.root = os.path.abspath(a.bundle)
        self.work = tempfile.mkdtemp(prefix="gpu-check-")
        self.results_dir = os.path.join(self.work, "results")
        os.makedirs(os.path.join(self.results_dir, "logs"))
        with open(os.path.join(self.root, "manifest.json")) as f:
            self.manifest = json.load(f)
        with open(os.path.join(self.root, "build_info.json")) as f:
            self.build_info = json.load(f)
        for name in ("manifest.json", "build_info.json"):
            shutil.copy2(os.path.join(self.root, name), self.results_dir)
        self.results = []
        self.env_info = {}
        self.no_gpu = None  # the reason there is no GPU, or None
        self.refused = {}  # executable -> why it cannot run here (a library)
        self.torch_python = None  # the interpreter holding torch (find_libraries)
        self.nccl_answer = None
        self.current = None  # (stage, start) of the stage running now, for a run killed outside
        self.previous = load_previous(a.rerun_failed) if a.rerun_failed else None
        self.env = dict(os.environ)
        if a.lockstep_timeout is not None:  # given: it overrides the tests' CTest values too
            self.env["LOCKSTEP_TIMEOUT"] = str(a.lockstep_timeout)
        else:
            self.env.setdefault("LOCKSTEP_TIMEOUT", "60")
        self.env["LOCKSTEP_SOURCE_DIR"] = os.path.join(self.root, "src")

    def remaining(self):
        return self.a.budget - (time.monotonic() - self.start)

    # -- recording: every stage appends a line and refreshes the summary and the archive -------
    def record(self, stage, status, reason="", seconds=0.0, exit_code=None, log=None, **extra):
        r = {"stage": stage, "status": status, "reason": reason, "seconds": round(seconds, 1),
             "exit": exit_code, "log": log}
        r.update(extra)
        self.current = None
        self.results.append(r)
        with open(os.path.join(self.results_dir, RESULTS), "a") as f:
            f.write(json.dumps(r) + "\n")
        print("[%6.1fs] %-40s %-8s %s" % (time.monotonic() - self.start, stage, status, reason),
              flush=True)
        self.publish()

    def publish(self):
        text = self.summary()
        with open(os.path.join(self.results_dir, SUMMARY), "w") as f:
            f.write(text)
        tmp = os.path.join(self.out, "." + SUMMARY + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(self.out, SUMMARY))
        shutil.copy2(os.path.join(self.results_dir, RESULTS), os.path.join(self.out, RESULTS))
        tmp = os.path.join(self.out, "." + ARCHIVE + ".tmp")
        with tarfile.open(tmp, "w:gz", compresslevel=1) as tar:  # rewritten after every stage
            tar.add(self.results_dir, arcname="gpu-check-results")
        os.replace(tmp, os.path.join(self.out, ARCHIVE))

    def summary(self):
        g = self.build_info.get("git", {})
        h = self.build_info.get("headers", {})
        e = self.env_info
        counts = {}
        for r in self.results:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        lines = [
            "# GPU check",
            "",
            "- device: %s" % (e.get("device") or self.no_gpu or "not probed yet"),
            "- driver %s, CUDA runtime %s; NCCL %s (headers %s), cuDNN %s (headers %s), "
            "cuBLAS %s (headers %s)" % (
                e.get("driver", "?"), e.get("cuda_runtime", "?"), e.get("nccl", "?"),
                (h.get("nccl") or {}).get("version", "?"), e.get("cudnn", "?"),
                (h.get("cudnn") or {}).get("version", "?"), e.get("cublas", "?"),
                (h.get("cublas") or {}).get("version", "?")),
            "- commit %s%s, built %s for sm_%s%s" % (
                g.get("commit", "?")[:12], " (dirty: %d files changed, %d untracked)" % (
                    g.get("changed_files", 0), g.get("untracked_files", 0))
                if g.get("dirty") else "", self.build_info.get("built", "?"),
                h.get("cuda_architectures", "?"),
                ", %d build steps out of date when packed" % self.build_info["stale_steps"]
                if self.build_info.get("stale_steps") else ""),
            "- budget %ds, used %.0fs%s; %s" % (
                self.a.budget, time.monotonic() - self.start,
                "; rerun of the failed stages of " + self.a.rerun_failed
                if self.a.rerun_failed else "",
                ", ".join("%d %s" % (n, s) for s, n in sorted(counts.items()))),
            "- NVIDIA wheels: %s" % e.get("wheel_tree", "not searched"),
            "- libraries loaded: %s" % (", ".join(
                "%s %s" % (k, v) for k, v in sorted(e.get("loaded", {}).items())) or "?"),
            "",
            "| stage | result | seconds | reason |",
            "| --- | --- | ---: | --- |",
        ]
        for r in self.results:
            reason = (r.get("reason") or "").replace("|", "/").replace("\n", " ")
            lines.append("| %s | %s | %s | %s |" % (r["stage"], r["status"], r["seconds"],
                                                    reason[:160]))
        if self.current:
            lines.append("| %s | running (for %.0fs when this was written) | | |" % (
                self.current[0], time.monotonic() - self.current[1]))
        lines += ["", "In %s: the logs, results.jsonl, env.json, gpu_bench.txt and .csv, "
                  "torch_bn.csv, bn_compare.csv, ncu_<case>.csv." % ARCHIVE, ""]
        return "\n".join(lines)

    def log_path(self, stage):
        return os.path.join("logs", re.sub(r"[^A-Za-z0-9_.-]", "_", stage) + ".log")

    # -- one process under its own timeout; its whole process group ends with it ---------------
    def execute(self, stage, argv, timeout, cwd=None, env=None, log_name=None):
        log_rel = log_name or self.log_path(stage)
        log_file = os.path.join(self.results_dir, log_rel)
        t0 = time.monotonic()
        timed_out = False
        self.current = (stage, t0)
        self.publish()
        with open(log_file, "wb") as log:
            log.write(("$ %s\n" % " ".join(argv)).encode())
            log.flush()
            try:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=cwd or self.work,
                                        env=env or self.env, start_new_session=True)
            except OSError as err:
                log.write(("cannot start: %s\n" % err).encode())
                return 127, False, time.monotonic() - t0, log_rel
            try:
                code = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                timed_out = True
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=5)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                code = proc.returncode
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # helpers left behind (e.g. NCCL ranks)
            except (ProcessLookupError, PermissionError):
                pass
            seconds = time.monotonic() - t0
            log.write(("\n# exit %s after %.1fs%s\n" % (
                code, seconds, " (killed: timeout %.0fs)" % timeout if timed_out else "")).encode())
        trim_log(log_file)
        return code, timed_out, seconds, log_rel

    def tail(self, log_rel, lines=3):
        try:
            with open(os.path.join(self.results_dir, log_rel), errors="replace") as f:
                text = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return ""
        text = [ln for ln in text if not ln.startswith(("# exit", "$ "))]
        return " / ".join(text[-lines:])

    # -- the stages ----------------------------------------------------------------------------
    def skip_reason(self, stage, min_seconds, exe=None, rerun=True):
        """Why `stage` (running executable `exe`) does not run now, or None. rerun=False: run
        it in a rerun whatever it did before (a stage the repeated stages depend on)."""
        if self.no_gpu:
            return "no GPU: " + self.no_gpu
        if rerun and self.previous is not None and not self.previous.wants(stage):
            return "not rerun: %s in %s" % (self.previous.status(stage) or "not in",
                                            self.previous.source)
        if exe in self.refused:
            return self.refused[exe]
        left = self.remaining()
        if left < min_seconds:
            return "budget: %.0fs left, the stage needs at least %ds" % (max(left, 0), min_seconds)
        return None

    def stage_env(self):
        t0 = time.monotonic()
        info = self.env_info
        log = []
        if self.a.no_gpu:
            self.no_gpu = "--no-gpu given"
        elif self.a.pretend_gpu:
            info["device"] = "none: --pretend-gpu (the selftest's fake bundle)"
        elif shutil.which("nvidia-smi") is None:
            log.append("nvidia-smi not found: the CUDA runtime's device count decides")
        else:
            code, text = quick(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                                "compute_cap", "--format=csv,noheader"])
            log.append("$ nvidia-smi\n" + text)
            rows = [ln for ln in text.splitlines() if ln.strip()]
            if code != 0 or not rows:
                self.no_gpu = "nvidia-smi lists no device (%s)" % text.strip()[:120]
            else:
                info["device"] = "; ".join(rows)
                info["driver"] = rows[0].split(",")[1].strip() if "," in rows[0] else "?"
        probe = self.executable("gpu_check_probe")
        if not self.no_gpu:
            self.find_libraries(info, log, probe)
        if probe and not self.no_gpu:
            code, text = quick([probe, "versions"], self.env)
            log.append("$ gpu_check_probe versions\n" + text)
            vals = dict(ln.split(None, 1) for ln in text.splitlines() if len(ln.split()) == 2)
            if code == 0 and vals.get("nccl", "").isdigit():
                info["cuda_runtime"] = vals.get("cuda_runtime")
                info["nccl"] = nccl_code_to_version(vals["nccl"])
                if vals.get("devices") == "0" and not self.a.pretend_gpu:
                    self.no_gpu = "the CUDA runtime counts no device (driver %s)" % vals.get(
                        "cuda_driver")
                elif "device" not in info:  # no nvidia-smi
                    info["device"] = "%s CUDA device(s) (nvidia-smi not found)" % vals.get(
                        "devices", "?")
        if not self.no_gpu and "device" not in info:
            self.no_gpu = "nvidia-smi not found and %s" % (
                "the probe could not count the devices" if probe else "no probe in the bundle")
        # What the loader finds for each executable (ldd), and the NCCL version check.
        missing = {}
        for name in sorted(self.manifest["executables"]):
            path = self.executable(name)
            if not path or shutil.which("ldd") is None:
                continue
            code, text = quick(["ldd", path], self.env)
            log.append("$ ldd %s\n%s" % (name, text))
            libs = re.findall(r"^\s*(\S+) => not found", text, re.M)
            for lib, where in re.findall(r"^\s*(lib(?:nccl|cudnn|cublas|cudart)\S*) => (/\S+)",
                                         text, re.M):
                info.setdefault("loaded", {})[lib] = where
            if libs:
                missing[name] = libs
                self.refused[name] = "%s not found (LD_LIBRARY_PATH: %s)" % (
                    ", ".join(libs), "env.json")
        built = version_tuple((self.build_info["headers"].get("nccl") or {}).get("version"))
        runtime = version_tuple(info.get("nccl", "").split(" ")[0])
        status, reason = "ran", ""
        if built and runtime and runtime < built:
            why = "NCCL %s is older than the headers %s the build used" % (
                info["nccl"], ".".join(map(str, built)))
            for name in self.manifest["executables"]:
                if any(lib.startswith("libnccl") for lib in self.needs(name)):
                    self.refused.setdefault(name, why)
            status, reason = "failed", why
        elif missing:
            status = "failed"
            reason = "; ".join("%s: %s not found" % (k, ", ".join(v))
                               for k, v in sorted(missing.items()))
        if self.no_gpu:
            status, reason = "skipped", "no GPU: " + self.no_gpu
        info["refused"] = self.refused
        info["no_gpu"] = self.no_gpu
        with open(os.path.join(self.results_dir, "env.json"), "w") as f:
            json.dump(info, f, indent=1)
        log_rel = self.log_path("env")
        with open(os.path.join(self.results_dir, log_rel), "w") as f:
            f.write("\n".join(log))
        if not reason:
            reason = "%s; NCCL %s, cuDNN %s, cuBLAS %s" % (
                info.get("device", "?"), info.get("nccl", "?"), info.get("cudnn", "?"),
                info.get("cublas", "?"))
        self.record("env", status, reason, time.monotonic() - t0, log=log_rel)

    def find_libraries(self, info, log, probe):
        """Puts ONE installation's NVIDIA wheels (wheel_library_dirs: --python or
        LOCKSTEP_PYTHON first; LOCKSTEP_WHEEL_SEARCH_ROOT, a folder standing in for / and its
        home/ for ~, is the selftest's) on LD_LIBRARY_PATH, before the CUDA toolkit's and the
        bundle's lib/, and records which and why (env.json, the summary). The search takes at
        most a tenth of the budget left (2 to 30 s)."""
        def probe_nccl(dirs):  # an installation's NCCL as the bundle's probe loads it
            env = dict(self.env, LD_LIBRARY_PATH=":".join(dirs + [os.path.join(self.root, "lib")]))
            code, text = quick([probe, "versions"], env, timeout=10)
            m = re.search(r"^nccl (\d+)$", text, re.M)
            return version_tuple(nccl_code_to_version(m.group(1))) if code == 0 and m else None

        found = wheel_library_dirs(
            self.a.python or os.environ.get("LOCKSTEP_PYTHON") or None,
            os.environ.get("LOCKSTEP_WHEEL_SEARCH_ROOT") or "/",
            min(30.0, max(2.0, self.remaining() / 10)), probe_nccl if probe else None)
        self.torch_python = found["python"]
        log.append("$ wheel search\n" + "\n".join(found["log"]) + "\nchosen: " + found["chosen"])
        info["wheels"] = found["wheels"]
        info["wheel_tree"] = found["chosen"]
        info["wheel_trees"] = found["trees"]
        info["torch_python"] = found["python"]
        path = list(found["dirs"])
        for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/lib"):
            if os.path.isdir(d):
                path.append(d)
        path.append(os.path.join(self.root, "lib"))
        if self.env.get("LD_LIBRARY_PATH"):
            path.append(self.env["LD_LIBRARY_PATH"])
        self.env["LD_LIBRARY_PATH"] = ":".join(path)
        info["LD_LIBRARY_PATH"] = self.env["LD_LIBRARY_PATH"]
        for lib, prefix in (("cudnn", "nvidia-cudnn"), ("cublas", "nvidia-cublas"),
                            ("nccl", "nvidia-nccl")):
            versions = [v for k, v in found["wheels"].items() if k.startswith(prefix)]
            if versions:
                info[lib] = versions[0] + " (wheel)"

    def executable(self, name):
        e = self.manifest["executables"].get(name)
        if not e or not e.get("path"):
            return None
        path = os.path.join(self.root, e["path"])
        return path if os.path.exists(path) else None

    def needs(self, name):
        return (self.manifest["executables"].get(name) or {}).get("needs", [])

    def stage_nccl_probe(self, needed_by_rerun):
        stage = "nccl_probe"
        probe = self.executable("gpu_check_probe")
        why = self.skip_reason(stage, 20, "gpu_check_probe", not needed_by_rerun)
        if why is None and probe is None:
            why = "gpu_check_probe is not in the bundle"
        if why:
            self.nccl_answer = why
            self.record(stage, "skipped", why)
            return
        env = dict(self.env)
        env.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reason into the log when it fails
        code, timed_out, secs, log = self.execute(stage, [probe, "nccl", "--ranks", "2"],
                                                  min(90, self.remaining()), env=env)
        if code == 0:
            self.record(stage, "passed", "2 ranks, one all_reduce", secs, code, log)
        elif code == 77 and not timed_out:
            self.nccl_answer = "the probe found no CUDA device"
            self.record(stage, "skipped", self.nccl_answer, secs, code, log)
        else:
            self.nccl_answer = "timed out" if timed_out else self.tail(log, 2)
            self.record(stage, "failed", "NCCL: " + self.nccl_answer, secs, code, log)

    def run_test(self, t):
        stage = t["kind"] + ":" + t["name"]
        if t.get("excluded"):
            self.record(stage, "skipped", t["excluded"])
            return
        exe = self.executable(t["executable"])
        last = LAST_SECONDS.get(stage)
        min_seconds = self.a.test_min_seconds if last is None else max(
            self.a.test_min_seconds, int(1.5 * last + 0.999))
        why = self.skip_reason(stage, min_seconds, t["executable"])
        if why is None and exe is None:
            why = "%s is not in the bundle (not built)" % t["executable"]
        if why is None and t["kind"] == "multi_rank" and self.nccl_answer is not None:
            why = "stage 0 (2-rank NCCL probe) did not pass: " + self.nccl_answer
        if why:
            self.record(stage, "skipped", why)
            return
        args = [x.replace("{root}", self.root) for x in t["args"]]
        if t["executable"].startswith("test_") and "-d" not in args:
            args += ["-d", "yes"]  # Catch2: each case's duration in the log
        env = dict(self.env)
        # The flight recorder's files (a timeout or disagreement) come back in the archive.
        env["LOCKSTEP_TRACE_DIR"] = os.path.join(self.results_dir, "traces", t["name"])
        os.makedirs(env["LOCKSTEP_TRACE_DIR"], exist_ok=True)
        for kv in t.get("environment", []):
            k, _, v = kv.partition("=")
            if not (k == "LOCKSTEP_TIMEOUT" and self.a.lockstep_timeout is not None):
                env[k] = v
        modify_environment(env, t.get("environment_modification", []), self.env)
        cwd = os.path.join(self.work, "cwd", t["name"])
        os.makedirs(cwd, exist_ok=True)
        own = test_cap(last, t["timeout"], env.get("LOCKSTEP_TIMEOUT"))
        timeout = min(own, self.remaining())
        code, timed_out, secs, log = self.execute(stage, [exe] + args, timeout, cwd, env)
        cut = self.cut_by_budget(stage, own, secs, timed_out, log)
        extra = {}
        if t["kind"] == "digits":
            m = re.findall(r"accuracy[^0-9]*([0-9.]+)", open(
                os.path.join(self.results_dir, log), errors="replace").read())
            if m:
                extra["accuracy"] = float(m[-1])
        if cut:
            return
        if timed_out:
            self.record(stage, "failed", "timed out after %.0fs%s" % (
                timeout, " (the cap from its %.1fs in the last GPU run, LAST_SECONDS)" % last
                if own < t["timeout"] and timeout >= own else ""), secs, code, log, **extra)
        elif code == 0:
            self.record(stage, "passed", "accuracy %s" % extra["accuracy"]
                        if "accuracy" in extra else "", secs, code, log, **extra)
        elif t.get("skip_code") is not None and code == t["skip_code"]:
            self.record(stage, "skipped", "the test reported skip (exit %d): %s" % (
                code, self.tail(log, 1)), secs, code, log, **extra)
        else:
            self.record(stage, "failed", "exit %s: %s" % (code, self.tail(log)), secs, code, log,
                        **extra)

    def run_gpu_bench(self, stage, args, min_seconds, timeout, log_name, describe):
        """gpu_bench as `stage`: with args(exe) under `timeout` seconds (when `min_seconds` are
        left), its output in `log_name`; describe(output) is what a pass records."""
        exe = self.executable("gpu_bench")
        why = self.skip_reason(stage, min_seconds, "gpu_bench")
        if why is None and exe is None:
            why = "gpu_bench is not in the bundle (not built: cuDNN missing at build time?)"
        if why:
            self.record(stage, "skipped", why)
            return
        code, timed_out, secs, log = self.execute(stage, [exe] + args(exe),
                                                  min(timeout, self.remaining()),
                                                  log_name=log_name)
        if self.cut_by_budget(stage, timeout, secs, timed_out, log):
            return
        what = describe(open(os.path.join(self.results_dir, log), errors="replace").read())
        if timed_out:
            self.record(stage, "failed", "timed out", secs, code, log)
        elif code == 0:
            self.record(stage, "passed", what, secs, code, log)
        elif code == 77:
            self.record(stage, "skipped", "gpu_bench reported skip: " + self.tail(log, 1), secs,
                        code, log)
        else:
            self.record(stage, "failed", "exit %s: %s" % (code, self.tail(log)), secs, code, log)

    def stage_bench(self):
        def args(exe):
            if "--csv" in quick([exe, "--help"], self.env)[1]:
                return ["--csv", os.path.join(self.results_dir, "gpu_bench.csv")]
            return []

        def describe(text):
            device = re.search(r"^device 0: ([^,]*, [^,]*)", text, re.M)
            cudnn = re.search(r"^cuDNN (\d+)", text, re.M)
            if cudnn:
                self.env_info["cudnn_runtime"] = cudnn.group(1)
            return "%s; cuDNN %s" % (device.group(1) if device else "?",
                                     cudnn.group(1) if cudnn else "?")

        self.run_gpu_bench("gpu_bench", args, 30, 180, "gpu_bench.txt", describe)

    def stage_bench_odd(self):
        """gpu_bench on one shape beside the issue's: 32x288x35x35 (an Inception-v3 block),
        whose odd planes (too wide for the channel tiles) the reductions read in the vectors
        inside each plane and its edges by value."""
        self.run_gpu_bench("gpu_bench_odd", lambda exe: ["--shape", ODD_PLANES_SHAPE], 20, 60,
                           "gpu_bench_odd.txt", lambda text: ODD_PLANES_SHAPE)

    def stage_torch_anchor(self):
        """PyTorch's batch norm on gpu_bench's shapes (bench/torch_batch_norm.py), joined with
        gpu_bench.csv: the anchor the bench's figures are read against."""
        stage = "gpu_bench_torch"
        script = os.path.join(self.root, "src", "bench", "torch_batch_norm.py")
        why = self.skip_reason(stage, 30)
        if why is None and not os.path.isfile(script):
            why = "bench/torch_batch_norm.py is not in the bundle"
        if why:
            self.record(stage, "skipped", why)
            return
        torch_csv = os.path.join(self.results_dir, "torch_bn.csv")
        python = self.torch_python or sys.executable  # the interpreter holding torch
        code, timed_out, secs, log = self.execute(
            stage, [python, script, "--csv", torch_csv], min(150, self.remaining()))
        if self.cut_by_budget(stage, 150, secs, timed_out, log):
            return
        bench_csv = os.path.join(self.results_dir, "gpu_bench.csv")
        joined = ""
        if code == 0 and os.path.isfile(bench_csv):
            c2, joined = quick([python, script, "--torch-csv", torch_csv, "--compare",
                                bench_csv, "--combined",
                                os.path.join(self.results_dir, "bn_compare.csv")], self.env)
            with open(os.path.join(self.results_dir, "bn_compare.txt"), "w") as f:
                f.write(joined)
            joined = "; joined with gpu_bench.csv: bn_compare.csv" if c2 == 0 else (
                "; the join failed (exit %d): bn_compare.txt" % c2)
        if timed_out:
            self.record(stage, "failed", "timed out", secs, code, log)
        elif code == 0:
            self.record(stage, "passed", "torch_bn.csv" + joined, secs, code, log)
        elif code == 77:
            self.record(stage, "skipped", "no PyTorch or no device: " + self.tail(log, 1), secs,
                        code, log)
        else:
            self.record(stage, "failed", "exit %s: %s" % (code, self.tail(log)), secs, code, log)

    def stage_ncu(self):
        stage = "ncu"
        bench = self.executable("gpu_bench")
        probe = self.executable("gpu_check_probe")
        ncu = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",)
                                           if os.path.exists(p)), None)
        why = self.skip_reason(stage, 60, "gpu_bench")
        if why is None and self.a.pretend_gpu:
            why = "not under --pretend-gpu"
        if why is None and ncu is None:
            why = "ncu not found"
        if why is None and (bench is None or probe is None):
            why = "gpu_bench or gpu_check_probe is not in the bundle"
        if why:
            self.record(stage, "skipped", why)
            return
        # Whether ncu may read the counters here: one kernel of the probe, one metric.
        code, timed_out, secs, log = self.execute(
            "ncu_probe", [ncu, "--metrics", "gpu__time_duration.sum", "--csv", probe, "kernel"],
            min(60, self.remaining()))
        text = open(os.path.join(self.results_dir, log), errors="replace").read()
        if code != 0 or timed_out or "gpu__time_duration" not in text or "ERR_NVGPUCTRPERM" in text:
            answer = "timed out" if timed_out else (
                "ERR_NVGPUCTRPERM: no permission to read the GPU counters"
                if "ERR_NVGPUCTRPERM" in text else "exit %s: %s" % (code, self.tail(log, 2)))
            self.record(stage, "skipped", "ncu cannot profile here: " + answer, secs, code, log)
            return
        # One gpu_bench call per case, without cuDNN, one timed call of each pass (explicit: the
        # bench's own profiler detection is not relied on), into ncu_<case>.csv.
        secs2, failures, profiled, log = 0.0, [], [], None
        for name, args in NCU_CASES:
            if self.remaining() < 20:
                self.record(stage, "skipped", "budget: %.0fs left before %s; profiled: %s" % (
                    max(self.remaining(), 0), name, ", ".join(profiled) or "none"), secs + secs2,
                    None, log)
                return
            csv_rel = "ncu_%s.csv" % name
            code, timed_out, t, log = self.execute(
                stage, [ncu, "--csv", "--page", "raw", "--kernel-name-base", "demangled",
                        "--kernel-name", "regex:lockstep::kernels", "--launch-count",
                        str(self.a.ncu_kernels), "--metrics", ",".join(NCU_METRICS),
                        "--log-file", os.path.join(self.results_dir, csv_rel), bench,
                        "--warmup", "0", "--iterations", "1", "--no-cudnn"] + args,
                min(120, self.remaining()),
                log_name=os.path.join("logs", "ncu_%s.log" % name))
            secs2 += t
            if self.cut_by_budget(stage, 120, t, timed_out, log):
                return
            rows = count_csv_rows(os.path.join(self.results_dir, csv_rel))
            if code == 0 and not timed_out and rows > 0:
                profiled.append("%s %d" % (csv_rel, rows))
            else:
                failures.append("%s: %s" % (name, "timed out" if timed_out else "exit %s, %d rows: %s"
                                            % (code, rows, self.tail(log, 2))))
        if not failures:
            self.record(stage, "passed", "kernel launches profiled: " + ", ".join(profiled),
                        secs + secs2, 0, log)
        else:
            self.record(stage, "failed", "profiled: %s; failed: %s" % (
                ", ".join(profiled) or "none", "; ".join(failures)), secs + secs2, 1, log)

    def cut_by_budget(self, stage, own_timeout, secs, timed_out, log):
        """Records `stage` as failed when the end of the budget, not its own timeout, stopped
        it: it was still running, it may hang (a rerun repeats it); True then."""
        if not timed_out or secs + 6 >= own_timeout:  # 5 s: the grace after SIGTERM
            return False
        self.record(stage, "failed", "still running when the budget of %ds ran out, after %.0fs "
                    "(its own timeout: %.0fs): it may hang" % (self.a.budget, secs, own_timeout),
                    secs, None, log)
        return True

    def guarded(self, stage, fn, *args):
        """A stage whose runner code fails is recorded as failed; the next stage still runs."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 (a runner defect must not lose the other stages)
            self.record(stage, "failed", "runner error: %s: %s" % (type(err).__name__, err))

    def run(self):
        self.guarded("env", self.stage_env)
        tests = self.manifest["tests"]
        # A rerun repeats the probe when a multi-rank test it repeats needs it.
        self.guarded("nccl_probe", self.stage_nccl_probe, self.previous is not None and any(
            t["kind"] == "multi_rank" and self.previous.wants("multi_rank:" + t["name"])
            for t in tests))
        first = [t for t in tests if t["kind"] == "single" and t["name"] in FIRST_SINGLE_TESTS]

        def run_tests(selected):
            for t in selected:
                self.guarded(t["kind"] + ":" + t["name"], self.run_test, t)

        run_tests([t for t in tests if t["kind"] == "multi_rank"] + first +
                  [t for t in tests if t["kind"] == "digits"])
        self.guarded("gpu_bench", self.stage_bench)
        self.guarded("gpu_bench_torch", self.stage_torch_anchor)
        self.guarded("ncu", self.stage_ncu)
        self.guarded("gpu_bench_odd", self.stage_bench_odd)
        run_tests([t for t in tests if t["kind"] == "single" and t not in first] +
                  [t for t in tests if t["kind"] == "excluded"])
        shutil.rmtree(self.work, ignore_errors=True)
        failed = [r["stage"] for r in self.results if r["status"] == "failed"]
        print("gpu_run.py: %d stages, %d failed%s; %s and %s in %s" % (
            len(self.results), len(failed), " (%s)" % ", ".join(failed) if failed else "",
            SUMMARY, ARCHIVE, self.out))
        return 1 if failed else 0


def test_cap(last, ctest_timeout, lockstep_timeout):
    """The timeout of a test that took `last` seconds in the last GPU run (None: unknown) under
    CTest's `ctest_timeout`, its LOCKSTEP_TIMEOUT (text, or None: 60 s): the longest of 4x
    `last`, 60 s and LOCKSTEP_TIMEOUT + 30 s, at most `ctest_timeout`."""
    if last is None:
        return ctest_timeout
    try:
        lockstep = float(lockstep_timeout or 60)
    except ValueError:  # the test refuses it itself
        lockstep = 60.0
    return min(ctest_timeout, max(60.0, 4 * last, lockstep + 30.0))


def modify_environment(env, modifications, original):
    """Applies CTest's ENVIRONMENT_MODIFICATION entries ("NAME=op:value", in order) to env:
    reset (to `original`'s value), set, unset, string_append/prepend and
    path_list_append/prepend (":"-separated) and cmake_list_append/prepend (";")."""
    for m in modifications:
        name, _, rest = m.partition("=")
        op, _, value = rest.partition(":")
        old = env.get(name)
        if op == "reset":
            if name in original:
                env[name] = original[name]
            else:
                env.pop(name, None)
        elif op == "set":
            env[name] = value
        elif op == "unset":
            env.pop(name, None)
        elif op in ("string_append", "string_prepend"):
            env[name] = (old or "") + value if op == "string_append" else value + (old or "")
        elif op.endswith(("list_append", "list_prepend")):
            sep = ";" if op.startswith("cmake") else ":"
            if not old:
                env[name] = value
            elif op.endswith("append"):
                env[name] = old + sep + value
            else:
                env[name] = value + sep + old
        else:
            raise ValueError("ENVIRONMENT_MODIFICATION %r: unknown operation %r" % (m, op))


def quick(argv, env=None, timeout=60):
    """(exit code, stdout + stderr) of a short command; never raises."""
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                           stdin=subprocess.DEVNULL, universal_newlines=True, errors="replace",
                           timeout=timeout)
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired:
        return 124, "timed out after %ds" % timeout
    except OSError as err:
        return 127, str(err)


def trim_log(path):
    size = os.path.getsize(path)
    if size <= LOG_LIMIT:
        return
    with open(path, "rb") as f:
        head = f.read(LOG_LIMIT // 2)
        f.seek(size - LOG_LIMIT // 2)
        tail = f.read()
    with open(path, "wb") as f:
        f.write(head + b"\n... (%d bytes cut) ...\n" % (size - LOG_LIMIT) + tail)


def count_csv_rows(path):
    """Kernel launches in ncu's --csv --page raw output (one row each, after the header)."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln for ln in f if ln.startswith('"')]
    except OSError:
        return 0
    rows = list(csv.reader(io.StringIO("".join(lines))))
    return sum(1 for r in rows if r and r[0].strip().isdigit())  # the "ID" column


class load_previous:
    """The results of an earlier run (its output folder, summary.md or results.jsonl): the
    stages that failed there, or that the runner skipped for a reason a rerun may remove
    (RERUN_SKIP: the budget, the NCCL probe, a missing library), are the ones a rerun repeats."""

    def __init__(self, source):
        self.source = source
        self.statuses = {}
        rerunnable = set()
        path = source
        if os.path.isdir(path):
            path = os.path.join(source, RESULTS)
            if not os.path.exists(path):
                path = os.path.join(source, SUMMARY)
        with open(path) as f:
            text = f.read()
        if path.endswith(".md"):
            row = r"^\|\s*([^|]+?)\s*\|\s*(passed|failed|skipped|ran)\s*\|[^|]*\|([^|]*)\|"
            for m in re.finditer(row, text, re.M):
                self.statuses[m.group(1)] = m.group(2)
                if m.group(2) == "skipped" and RERUN_SKIP.search(m.group(3).strip()):
                    rerunnable.add(m.group(1))
        else:
            for line in text.splitlines():
                if line.strip():
                    r = json.loads(line)
                    self.statuses[r["stage"]] = r["status"]
                    if r["status"] == "skipped" and RERUN_SKIP.search(r.get("reason") or ""):
                        rerunnable.add(r["stage"])
        self.failed = {s for s, st in self.statuses.items() if st == "failed"}
        self.failed |= rerunnable
        if not self.statuses:
            raise SystemExit("gpu_run.py: no stage results in %s" % source)

    def status(self, stage):
        return self.statuses.get(stage)

    def wants(self, stage):
        if stage == "ncu":  # its probe is part of the stage
            return "ncu" in self.failed or "ncu_probe" in self.failed
        return stage in self.failed


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd")
    s = sub.add_parser("stage", help="lay out a bundle tree from a CUDA build directory")
    s.add_argument("--build-dir", required=True)
    s.add_argument("--source-dir", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--link", action="store_true",
                   help="symlink the executables instead of stripped copies (the skip test)")
    s.add_argument("--stale-steps", type=int, default=0,
                   help="build steps that were out of date when packed (recorded)")
    s.add_argument("--allow-missing", action="store_true",
                   help="record executables that are not built instead of failing")
    r = sub.add_parser("run", help="run an unpacked bundle's stages")
    r.add_argument("bundle", help="the unpacked bundle folder")
    r.add_argument("outdir")
    r.add_argument("--budget", type=int, default=300, help="seconds for the whole run")
    r.add_argument("--rerun-failed", metavar="PREVIOUS",
                   help="an earlier run's output folder, summary.md or results.jsonl")
    r.add_argument("--no-gpu", action="store_true", help="skip every stage as without a GPU")
    r.add_argument("--python", metavar="PATH",
                   help="the interpreter holding PyTorch and its NVIDIA wheels (default: "
                   "LOCKSTEP_PYTHON, else the one of those found that holds torch)")
    r.add_argument("--pretend-gpu", action="store_true", help=argparse.SUPPRESS)
    # The budget a test needs left to start; the selftest lowers it to end a budget in seconds.
    r.add_argument("--test-min-seconds", type=int, default=15, help=argparse.SUPPRESS)
    r.add_argument("--lockstep-timeout", type=int, default=None,
                   help="LOCKSTEP_TIMEOUT for every stage, the tests' own CTest values "
                   "overridden (seconds; without it: 60, or a test's CTest value)")
    r.add_argument("--ncu-kernels", type=int, default=8,
                   help="batch-norm kernel launches ncu profiles per case (NCU_CASES)")
    a = parser.parse_args()
    if a.cmd == "stage":
        stage_bundle(a)
        return 0
    if a.cmd == "run":
        return runner(a).run()
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
