#!/usr/bin/env python3
# tests/docs/check_links.py: every relative link of README.md, docs/*.md and examples/*/README.md
# resolves to a file or folder of the repository, and every #anchor to a heading of its target
# (GitHub's anchor rules). External (http) links are not fetched. SPDX-License-Identifier: Apache-2.0
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1]).resolve()
files = [root / "README.md", *sorted((root / "docs").glob("*.md")),
         *sorted((root / "examples").glob("*/README.md"))]
link = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path):
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        base, n = slug, 1
        while slug in out:
            slug, n = f"{base}-{n}", n + 1
        out.add(slug)
    return out


errors = []
for md in files:
    fenced = False
    for number, line in enumerate(md.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for m in link.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(root)}:{number}: {target}"
            if root not in dest.parents and dest != root:
                errors.append(f"{where}: points outside the repository")
            elif not dest.exists():
                errors.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                errors.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
print(f"checked the links of {len(files)} files")
for e in errors:
    print(e)
sys.exit(1 if errors else 0)
