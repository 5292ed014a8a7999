#!/usr/bin/env python3
# tests/docs/check_device_bits.py: docs/architecture.md's rule that functors shared by the host
# and the device take bit counts from core/leading_zeros.hpp, never from <bit>. In a kernel, nvcc
# 13.0 with libstdc++ folds std::countl_zero(std::uint64_t) to 64, std::countr_zero to 64 and
# std::bit_width to 0, without a diagnostic. Those functions may appear only in
# core/leading_zeros.hpp (its host branch) and in host-only headers, named *_host*.hpp.
# SPDX-License-Identifier: Apache-2.0
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1]).resolve()
inc = root / "include" / "lockstep"
pattern = re.compile(r"\bstd::(countl_zero|countr_zero|countl_one|countr_one|bit_width|"
                     r"popcount|bit_floor|bit_ceil|has_single_bit|rotl|rotr)\b")
headers = sorted(p for p in inc.rglob("*") if p.suffix in (".hpp", ".cuh"))
if not headers:
    sys.exit(f"no headers under {inc}")
found = []
for h in headers:
    rel = h.relative_to(inc).as_posix()
    if rel == "core/leading_zeros.hpp" or "_host" in h.stem:
        continue
    for n, line in enumerate(h.read_text().splitlines(), 1):
        code = line.split("//", 1)[0]
        m = pattern.search(code)
        if m:
            found.append(f"include/lockstep/{rel}:{n}: std::{m.group(1)} in a header device code "
                         "may include (use lockstep::countl_zero64, core/leading_zeros.hpp)")
for f in found:
    print(f)
if found:
    sys.exit(1)
print(f"no <bit> counting function in the {len(headers)} headers device code may include")
