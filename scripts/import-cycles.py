#!/usr/bin/env python3
"""Reports import circles between the files of src/: file A uses an item of file B, and B (or
a file B reaches) uses one of A's.

A file's module path comes from where it lies (src/a/b.rs and src/a/b/mod.rs are `crate::a::b`,
src/lib.rs is `crate`; each src/bin/*.rs is a crate root of its own). A file uses another where
its code (comments and string literals removed) names a path that starts with `crate::`,
`super::` or `self::`, in a `use` declaration or inline (`crate::x::y(...)`); `super::` and
`self::` count from the inline module they are written in (`mod tests { use super::*; }` is the
file itself). A path goes to the deepest module of its prefixes that is a file of its own:
`crate::backend::kernels::of` is src/backend/kernels.rs. Paths relative to a child module
(`plan::CastPlan` in a mod.rs) are not followed.

It also reports the pairs of folders of src/ (its first-level modules: src/x.rs and src/x/**
are the folder `x`) that import each other, counting a `crate::Name` re-exported by lib.rs as a
use of the folder that defines it; every such pair is listed with the number of uses each way
and one place of each.

Usage: scripts/import-cycles.py [--edges] [SRC_DIR]   (SRC_DIR defaults to src/ beside scripts/)
Exits 1 if there is any circle, printing each group of files that reach one another and, for
every use between two of them, where it is written; or if a pair of folders imports each other
that is not in KNOWN_FOLDER_PAIRS (the pairs main still has), or a known pair no longer does.
"""

import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_code(text):
    """The text with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        raw = re.match(r'b?r(#*)"', text[i:i + 260])
        if raw and (i == 0 or not re.match(r"[A-Za-z0-9_]", text[i - 1])):
            end = '"' + raw.group(1)
            j = text.find(end, i + raw.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
            continue
        if c == "'":
            # A char literal ('a', '\n', '\u{1F600}'), not a lifetime ('a).
            lit = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:i + 12])
            if lit:
                out.append(" " * lit.end())
                i += lit.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def module_files(src):
    """{module path tuple: file} for every crate, keyed by (crate root file, path)."""
    files = {}
    for dirpath, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                files[os.path.relpath(os.path.join(dirpath, name), src)] = None
    modules = {}
    for rel in files:
        parts = rel[:-3].split(os.sep)
        if parts[0] == "bin":
            # src/bin/x.rs (or src/bin/x/main.rs) roots a binary crate of its own.
            root = os.path.join("bin", parts[1] + ".rs") if len(parts) == 2 else os.path.join("bin", parts[1], "main.rs")
            inner = parts[2:] if len(parts) > 2 else []
            if inner == ["main"]:
                inner = []
        elif parts in (["lib"], ["main"]):
            root, inner = rel, []
        else:
            root, inner = "lib.rs", parts
        if inner and inner[-1] == "mod":
            inner = inner[:-1]
        modules[(root, tuple(inner))] = rel
    return modules


USE = re.compile(r"\buse\s+((?:::)?[^;]*);", re.S)
INLINE = re.compile(r"(?<![A-Za-z0-9_$:])((?:crate|super|self)(?:\s*::\s*(?:%s|\*|\{))+)" % IDENT)
MOD_BLOCK = re.compile(r"\bmod\s+(%s)\s*\{" % IDENT)


def expand_use_tree(tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (each as a list of segments)."""
    tree = re.sub(r"\s+as\s+%s" % IDENT, "", tree)
    tree = re.sub(r"\s+", "", tree)

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        return parts

    def walk(prefix, s):
        brace = s.find("{")
        if brace < 0:
            segs = [x for x in s.split("::") if x]
            return [prefix + segs]
        head = [x for x in s[:brace].split("::") if x]
        inner = s[brace + 1:s.rfind("}")]
        out = []
        for part in split_top(inner):
            out.extend(walk(prefix + head, part))
        return out

    return walk([], tree)


def resolve(segments, module, root, modules):
    """The file a path names (deepest module prefix that is a file), or None if external."""
    if not segments:
        return None
    head = segments[0]
    if head == "crate":
        base, rest = [], segments[1:]
    elif head in ("super", "self"):
        base, rest = list(module), segments
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                if not base:
                    return None
                base = base[:-1]
            rest = rest[1:]
    else:
        return None
    path = base + [s for s in rest if s not in ("*", "self")]
    for k in range(len(path), -1, -1):
        rel = modules.get((root, tuple(path[:k])))
        if rel is not None:
            return rel
    return None


def file_module(rel, modules):
    for (root, path), f in modules.items():
        if f == rel:
            return root, list(path)
    raise KeyError(rel)


def uses_of(rel, src, modules):
    """[(target file, line, path text)] for the crate-internal paths of `rel`."""
    text = strip_code(open(os.path.join(src, rel), encoding="utf-8").read())
    root, file_mod = file_module(rel, modules)
    # Inline modules: (start offset, end offset, module path) by brace matching.
    spans = []
    for m in MOD_BLOCK.finditer(text):
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        spans.append((m.start(), j, m.group(1)))

    def module_at(pos):
        inner = [name for start, end, name in spans if start <= pos < end]
        return file_mod + inner

    def line_of(pos):
        return text.count("\n", 0, pos) + 1

    found = []
    use_ranges = []
    for m in USE.finditer(text):
        use_ranges.append((m.start(), m.end()))
        for segments in expand_use_tree(m.group(1)):
            segments = [s for s in segments if s]
            if segments and segments[0] in ("crate", "super", "self"):
                target = resolve(segments, module_at(m.start()), root, modules)
                shown = segments[:-1] if segments[-1] == "self" else segments
                found.append((target, line_of(m.start()), "use " + "::".join(shown), absolute(segments, module_at(m.start()))))
    for m in INLINE.finditer(text):
        if any(start <= m.start() < end for start, end in use_ranges):
            continue
        segments = [s.strip() for s in m.group(1).split("::")]
        segments = [s for s in segments if s and s not in ("{", "*")]
        target = resolve(segments, module_at(m.start()), root, modules)
        found.append((target, line_of(m.start()), "::".join(segments), absolute(segments, module_at(m.start()))))
    return [(t, line, p, a) for t, line, p, a in found if t is not None and t != rel]


def absolute(segments, module):
    """The path from the crate root (`crate::` and `super::` resolved), or None if external."""
    if not segments or segments[0] not in ("crate", "super", "self"):
        return None
    if segments[0] == "crate":
        return [s for s in segments[1:] if s not in ("*", "self")]
    base, rest = list(module), segments
    while rest and rest[0] in ("super", "self"):
        if rest[0] == "super":
            if not base:
                return None
            base = base[:-1]
        rest = rest[1:]
    return base + [s for s in rest if s not in ("*", "self")]


def root_reexports(src):
    """{name: module path} for the crate root's `pub use a::b::Name;` (lib.rs's re-exports), so
    that `crate::Name` counts as a use of the folder that defines it."""
    path = os.path.join(src, "lib.rs")
    if not os.path.exists(path):
        return {}
    text = strip_code(open(path, encoding="utf-8").read())
    out = {}
    for m in re.finditer(r"\bpub\s+use\s+([^;]*);", text, re.S):
        for segments in expand_use_tree(m.group(1)):
            segments = [x for x in segments if x]
            if segments and segments[0] == "crate":
                segments = segments[1:]
            if len(segments) >= 2 and segments[-1] not in ("*", "self"):
                out[segments[-1]] = segments[:-1]
    return out


def room(rel):
    """The folder of src/ a file belongs to: its first module (src/x.rs and src/x/** are `x`);
    None for the crate root and the binaries, which are not rooms."""
    parts = rel[:-3].split(os.sep)
    if parts[0] == "bin" or parts in (["lib"], ["main"]):
        return None
    return parts[0]


# Folder pairs that import each other on main, to be undone by issue 46's first part (one
# context value the ops and the step read): listed so that CI fails on any new pair, and on a
# listed pair that is gone (then strike it from this list).
KNOWN_FOLDER_PAIRS = set()


def folder_pairs(src, modules, files):
    """{(a, b): [(file, line, path)]} for every folder a that uses folder b, with `crate::Name`
    followed through the crate root's re-exports."""
    reexports = root_reexports(src)
    uses = {}
    for rel in files:
        a = room(rel)
        if a is None:
            continue
        root, _ = file_module(rel, modules)
        if root != "lib.rs":
            continue
        for target, line, path, absolute_path in uses_of(rel, src, modules):
            b = room(target)
            if b is None and absolute_path and absolute_path[0] in reexports:
                b = reexports[absolute_path[0]][0]
            if b is None or b == a:
                continue
            uses.setdefault((a, b), []).append((rel, line, path))
    return uses


def strongly_connected(graph):
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def report_folders(src, modules, files):
    """Prints the pairs of folders of src/ that import each other, with the uses each way;
    True if one is not in KNOWN_FOLDER_PAIRS or a known one is gone."""
    uses = folder_pairs(src, modules, files)
    pairs = sorted({tuple(sorted(k)) for k in uses if (k[1], k[0]) in uses})
    rooms = {room(f) for f in files} - {None}
    arrows = len(uses)
    print("%d folders of %s, %d folder-to-folder imports, %d pairs importing each other"
          % (len(rooms), src, arrows, len(pairs)))
    failed = False
    for a, b in pairs:
        known = (a, b) in KNOWN_FOLDER_PAIRS
        print("  %s <-> %s: %d uses %s -> %s, %d uses %s -> %s%s"
              % (a, b, len(uses[(a, b)]), a, b, len(uses[(b, a)]), b, a,
                 "" if known else "  (NEW: not in KNOWN_FOLDER_PAIRS)"))
        for key in ((a, b), (b, a)):
            rel, line, path = uses[key][0]
            print("      %s:%d `%s`" % (rel, line, path))
        failed |= not known
    for gone in sorted(KNOWN_FOLDER_PAIRS - set(pairs)):
        print("  %s <-> %s no longer import each other: strike them from KNOWN_FOLDER_PAIRS"
              % gone)
        failed = True
    return failed


def main(argv):
    show_edges = "--edges" in argv
    args = [a for a in argv if a != "--edges"]
    src = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    src = os.path.normpath(src)
    modules = module_files(src)
    files = sorted(set(modules.values()))
    graph, where = {}, {}
    for rel in files:
        graph[rel] = set()
        for target, line, path, _ in uses_of(rel, src, modules):
            graph[rel].add(target)
            where.setdefault((rel, target), []).append((line, path))
    if show_edges:
        for a in files:
            for b in sorted(graph[a]):
                print("%s -> %s" % (a, b))
    circles = [g for g in strongly_connected(graph) if len(g) > 1]
    failed = report_folders(src, modules, files)
    if not circles:
        print("no import cycles among the %d files of %s" % (len(files), src))
        return 1 if failed else 0
    for group in circles:
        print("import cycle among %d files: %s" % (len(group), ", ".join(group)))
        members = set(group)
        for a in group:
            for b in sorted(graph[a] & members):
                first = where[(a, b)][0]
                more = len(where[(a, b)]) - 1
                extra = " (and %d more)" % more if more else ""
                print("  %s:%d -> %s  `%s`%s" % (a, first[0], b, first[1], extra))
    print("%d import cycle(s)" % len(circles))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
