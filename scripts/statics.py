#!/usr/bin/env python3
"""Keeps the crate's statics few and accounted for (issue 46).

Counts the statics of src/ as the crate's docs do (`grep -rn "^\\s*static [A-Z_0-9]*\\s*:" src`)
and fails
- above MAX_STATICS: a new one must replace one, or be folded into an owner that exists
  (the context, the probe state, the hook registry, the one-time warnings);
- where one is not named in the table of src/context.rs's module docs ("What the process
  holds"), which says of each why it is process-wide or per thread;
- where the count those docs state ("<n> in `src/`") is not the count found.

Usage: scripts/statics.py   (from anywhere; reads src/ beside scripts/)
"""

import os
import re
import subprocess
import sys

MAX_STATICS = 20
PATTERN = r"^\s*static [A-Z_0-9]*\s*:"


def statics(root):
    """(name, 'file:line') of every static the docs' grep finds, in grep's order."""
    out = subprocess.run(
        ["grep", "-rn", PATTERN, "src"], cwd=root, capture_output=True, text=True, check=False
    )
    if out.returncode not in (0, 1):
        sys.exit("grep failed: %s" % out.stderr.strip())
    found = []
    for line in out.stdout.splitlines():
        path, number, code = line.split(":", 2)
        name = re.match(r"\s*static ([A-Z_0-9]*)", code).group(1)
        found.append((name, "%s:%s" % (path, number)))
    return found


def documented(root):
    """The names in the table's first column, and the count the docs state."""
    with open(os.path.join(root, "src", "context.rs"), encoding="utf-8") as f:
        docs = [line[3:].strip() for line in f if line.startswith("//!")]
    names = set()
    for line in docs:
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Z_0-9]+)`", line.split("|")[1]))
    stated = re.search(r"(\d+) in `src/`", " ".join(docs))
    return names, int(stated.group(1)) if stated else None


def main():
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    found = statics(root)
    names, stated = documented(root)
    failed = False
    if len(found) > MAX_STATICS:
        print("%d statics in src/, more than %d:" % (len(found), MAX_STATICS))
        for name, where in found:
            print("  %s  %s" % (where, name))
        print("fold the new one into an owner that exists (see src/context.rs's module docs)")
        failed = True
    missing = [(name, where) for name, where in found if name not in names]
    for name, where in missing:
        print("%s: static %s is not in the table of src/context.rs's module docs" % (where, name))
        failed = True
    if stated != len(found):
        print(
            "src/context.rs's module docs say %s statics in `src/`; grep finds %d"
            % (stated, len(found))
        )
        failed = True
    if not failed:
        print("%d statics in src/ (at most %d), each in src/context.rs's table" % (len(found), MAX_STATICS))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
