#!/usr/bin/env python3
# scripts/trace_merge.py: merges lockstep flight recorder files (one per replica) and prints
# where the replicas diverged and who is missing. SPDX-License-Identifier: Apache-2.0
"""Merge lockstep flight recorder files and say where the replicas diverged.

Usage: trace_merge.py [--timeline] PATH...

Each PATH is a lockstep-trace.*.jsonl file or a directory holding them (LOCKSTEP_TRACE_DIR).
Files are grouped by backend label, group (a split's files apart from its parent's, where
the backend names the group) and size; for each group this prints every
replica's last operation, the first sequence number at which the replicas' operations
disagree (different collective, element type, count or root) with the odd ones out, the
replicas that wrote no file, stopped behind the others, or came late (the others' timeouts
name them missing), and a one-line verdict:
"culprit: replica R at #S (...)". Exit status: 0 after a report, 2 on unreadable input.
Python 3 standard library only.
"""

import glob
import json
import os
import re
import sys

P2P = {"send", "recv", "recv_any"}


def load(path):
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "lockstep_trace" not in lines[0]:
        raise ValueError(f"{path}: not a lockstep flight recorder file")
    head, ops = lines[0], lines[1:]
    head["path"] = path
    head["ops"] = ops
    return head


def signature(op):
    """What must agree across replicas for one sequence number."""
    if op["op"] in P2P:
        return ("point-to-point",)
    return (op["op"], op["type"], op["count"], op["peer"])


def describe(op):
    text = f'{op["op"]} #{op["seq"]} ({op["count"]} {op["type"]}'
    if op["peer"] >= 0:
        text += f', {"peer" if op["op"] in P2P else "root"} {op["peer"]}'
    return text + f', {op["state"]})'


def names(replicas):
    replicas = sorted(replicas)
    word = "replica" if len(replicas) == 1 else "replicas"
    return word + " " + ", ".join(str(r) for r in replicas)


def report_group(label, group, size, traces, timeline):
    name = f"{label} {group}" if group else label
    out = [f"== {name} group of {size} replicas: {len(traces)} trace file(s)"]
    by_replica = {t["replica"]: t for t in traces}
    for r in sorted(by_replica):
        t = by_replica[r]
        last = describe(t["ops"][-1]) if t["ops"] else "no operations"
        out.append(f'replica {r}: {len(t["ops"])} op(s), last {last}; {t["path"]}')
    missing = [r for r in range(size) if r not in by_replica]
    for r in missing:
        out.append(f"replica {r}: no trace file (it never saw an error: stalled in its own "
                   "code, exited or was killed)")

    seqs = {r: {op["seq"]: op for op in t["ops"]} for r, t in by_replica.items()}
    nonempty = {r: s for r, s in seqs.items() if s}
    divergence = None
    if nonempty:
        lo = max(min(s) for s in nonempty.values())
        hi = min(max(s) for s in nonempty.values())
        for seq in range(lo, hi + 1):
            groups = {}
            for r, s in nonempty.items():
                if seq in s:
                    groups.setdefault(signature(s[seq]), []).append(r)
            if len(groups) > 1:
                divergence = (seq, groups)
                break

    culprits, verdict = [], None
    if divergence is not None:
        seq, groups = divergence
        ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
        majority = ranked[0][1]
        tie = len(ranked) > 1 and len(ranked[1][1]) == len(majority)
        parts = []
        for _, reps in ranked:
            parts.append(f"{names(reps)} called {describe(nonempty[reps[0]][seq])}")
        out.append(f"first divergence at #{seq}: " + "; ".join(parts))
        if tie:
            culprits = sorted(r for _, reps in ranked for r in reps)
            verdict = (f"culprit: one of {names(culprits)} at #{seq} (no majority: the "
                       "replicas split evenly)")
        else:
            culprits = sorted(r for _, reps in ranked[1:] for r in reps)
            verdict = (f"culprit: {names(culprits)} at #{seq} (called a different operation "
                       f"from {names(majority)})")
    else:
        out.append("no divergence: the replicas' recorded operations agree where they overlap")

    lasts = {r: max(s) for r, s in nonempty.items()}
    behind = []
    if lasts:
        front = max(lasts.values())
        behind = sorted(r for r, last in lasts.items() if last < front)
        for r in behind:
            out.append(f"behind: replica {r} stopped at #{lasts[r]} while others reached "
                       f"#{front}")
    if verdict is None and missing:
        front = max(lasts.values()) if lasts else None
        where = f" (the others wait in #{front})" if front is not None else ""
        culprits = missing
        verdict = f"culprit: {names(missing)} (missing{where})"
    if verdict is None and behind:
        culprits = behind
        verdict = (f"culprit: {names(behind)} (behind: did not reach "
                   f"#{max(lasts.values())})")
    if verdict is None:
        # Every replica reached the same operation, but a timeout named who was missing: a
        # replica that arrived late (stalled in its own code past the timeout) and then wrote
        # its file on the error it met.
        late = set()
        for t in traces:
            for m in re.finditer(r"(#\d+): timed out after \d+ ms waiting for replica\(s\) "
                                 r"([\d, ]+) \(missing\)", t.get("reason", "")):
                late.update((m.group(1), int(r)) for r in m.group(2).split(","))
        if late:
            seqs = sorted({seq for seq, _ in late})
            culprits = sorted({r for _, r in late})
            verdict = (f"culprit: {names(culprits)} (late: the others timed out waiting for it "
                       f"in {', '.join(seqs)})")
    if missing and culprits != missing:
        out.append(f"missing: {names(missing)}")
    out.append(verdict or "culprit: none found")

    if timeline:
        events = []
        for r, t in by_replica.items():
            for op in t["ops"]:
                wall = op["start_ns"] + t["wall_offset_ns"]
                events.append((wall, r, op))
        events.sort(key=lambda e: (e[0], e[1]))
        if events:
            t0 = events[0][0]
            out.append("timeline (ms since the first recorded start):")
            for wall, r, op in events:
                out.append(f"  {(wall - t0) / 1e6:10.3f}  replica {r}: {describe(op)}")
    return out


def main(argv):
    args = [a for a in argv if a != "--timeline"]
    timeline = len(args) != len(argv)
    if not args or any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return 0 if args else 2
    files = []
    for a in args:
        if os.path.isdir(a):
            files += sorted(glob.glob(os.path.join(a, "lockstep-trace.*.jsonl")))
        else:
            files.append(a)
    if not files:
        print(f"trace_merge: no lockstep-trace.*.jsonl files in {' '.join(args)}",
              file=sys.stderr)
        return 2
    try:
        traces = [load(f) for f in files]
    except (OSError, ValueError) as e:
        print(f"trace_merge: {e}", file=sys.stderr)
        return 2
    groups = {}
    for t in traces:
        groups.setdefault((t["label"], t.get("group", ""), t["size"]), []).append(t)
    for (label, group, size), members in sorted(groups.items()):
        # One file per replica and group: the newest. Others of the same key come from another
        # communicator the backend does not name (e.g. two MPI splits of one size): say so.
        newest, others = {}, []
        for t in sorted(members, key=lambda t: os.path.getmtime(t["path"])):
            if t["replica"] in newest:
                others.append(newest[t["replica"]])
            newest[t["replica"]] = t
        lines = report_group(label, group, size, list(newest.values()), timeline)
        for t in sorted(others, key=lambda t: (t["replica"], t["path"])):
            lines.append(f'not merged: replica {t["replica"]} also wrote {t["path"]} (another '
                         "communicator of this backend and size: pass its files to "
                         "trace_merge.py alone)")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
