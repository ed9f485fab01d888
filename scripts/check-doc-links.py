#!/usr/bin/env python3
"""Checks the relative links of the documentation: README.md, docs/*.md, BENCHMARKS.md and
SECURITY.md. Every link that is not a URL must name a file that exists, and a `#fragment` into
a Markdown file must name one of its headings, as GitHub makes anchors of them (lower case,
punctuation but `-` and `_` dropped, spaces as `-`, a repeated heading numbered `-1`, `-2`...).
Links inside code (fenced blocks and `spans`) are not links, and are skipped.

Usage: scripts/check-doc-links.py [ROOT]   (ROOT defaults to the repository beside scripts/)
Exits 1 naming each broken link.
"""
import os
import re
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")


def prose_lines(path):
    """The file's lines outside fenced code blocks, with code spans removed."""
    fenced = False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield re.sub(r"`[^`]*`", "", line)


def slug(heading):
    text = heading.replace("`", "").strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path):
    found, seen, fenced = set(), {}, False
    for line in open(path, encoding="utf-8"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def main():
    docs = os.path.join(ROOT, "docs")
    files = [os.path.join(ROOT, name) for name in ("README.md", "BENCHMARKS.md", "SECURITY.md")]
    if os.path.isdir(docs):
        files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    broken = 0
    for source in files:
        text = "".join(prose_lines(source))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # a URL (https:, mailto:)
                continue
            path, _, fragment = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(source), path)) if path else source
            where = os.path.relpath(source, ROOT)
            if not os.path.exists(dest):
                print(f"{where}: {target}: no such file")
                broken += 1
            elif fragment and dest.endswith(".md") and fragment not in anchors(dest):
                print(f"{where}: {target}: no heading makes the anchor #{fragment}")
                broken += 1
    print(f"{len(files)} files, {broken} broken links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
