#!/usr/bin/env python3
"""Medians of scripts/bench_against's CSVs: per benchmark row (its text columns), every numeric
column's median over rounds on the base commit and here, and head / base.
usage: summarize_against.py DIR BASE HEAD"""
import csv
import glob
import os
import re
import statistics
import sys


def number(v):
    try:
        return float(v)
    except ValueError:
        return None


def main():
    out, base, head = sys.argv[1:4]
    data = {}  # (bench, key) -> column -> side -> [values]
    for path in sorted(glob.glob(os.path.join(out, "*.csv"))):
        m = re.match(r"(base|head)-(.+)-(\d+)\.csv$", os.path.basename(path))
        if not m:
            continue
        side, bench = m.group(1), m.group(2)
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = " | ".join(v for v in row.values() if number(v) is None)
                for col, v in row.items():
                    x = number(v)
                    if x is not None:
                        data.setdefault((bench, key), {}).setdefault(col, {}).setdefault(
                            side, []).append(x)
    print(f"medians over rounds: base {base}, head {head}")
    print(f"{'benchmark':22} {'row':58} {'column':20} {'base':>11} {'head':>11} {'head/base':>9}")
    for (bench, key), cols in sorted(data.items()):
        for col, sides in cols.items():
            if col in ("replicas", "collectives") or "base" not in sides or "head" not in sides:
                continue
            b, h = statistics.median(sides["base"]), statistics.median(sides["head"])
            ratio = f"{h / b:9.3f}" if b else "        -"
            print(f"{bench:22} {key[:58]:58} {col[:20]:20} {b:11.4g} {h:11.4g} {ratio} "
                  f"(n={len(sides['head'])})")


if __name__ == "__main__":
    main()
