#!/usr/bin/env python3
# tests/docs/check_header_map.py: every header of include/lockstep (.hpp and .cuh, detail/ too)
# is named in docs/architecture.md's layer map as `<layer>/<path>`, and every header the map
# names exists, so the map follows the code. SPDX-License-Identifier: Apache-2.0
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1]).resolve()
inc = root / "include" / "lockstep"
doc = (root / "docs" / "architecture.md").read_text()
headers = sorted(p.relative_to(inc).as_posix() for p in inc.rglob("*")
                 if p.suffix in (".hpp", ".cuh") and p.name != "lockstep.hpp")
if not headers:
    sys.exit(f"no headers under {inc}")
named = set(re.findall(r"`((?:core|system|kernels|comm|policy|nn|optim|train)/[\w/]+\.(?:hpp|cuh))`",
                       doc))
missing = [h for h in headers if h not in named]
stale = sorted(n for n in named if not (inc / n).exists())
for h in missing:
    print(f"docs/architecture.md does not name include/lockstep/{h}")
for n in stale:
    print(f"docs/architecture.md names `{n}`, which is not a header of include/lockstep")
if missing or stale:
    sys.exit(1)
print(f"docs/architecture.md names all {len(headers)} headers")
