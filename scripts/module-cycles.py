#!/usr/bin/env python3
"""Import cycles between the modules of each workspace crate (issue 42; `make lint` runs it).

A module is a source file (`foo.rs` or `foo/mod.rs`). An edge a -> b is a path in a's code that
names b: `crate::b::…`, `super::…` resolved from a, or `self::…`. The declaring `mod b;` line is not an
edge, and neither is a child naming its own ancestor (a child module sees its parent's items by
design: that is nesting, not a cycle) nor test code (`*_tests.rs`, `tests/`, `mod tests` blocks).
Exit 1 and print every strongly connected component of more than one module when any exists.
"""
import os
import re
import subprocess
import sys

ROOT = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                      check=True).stdout.strip()


def crates():
    for line in open(os.path.join(ROOT, "Cargo.toml")):
        if line.startswith("members"):
            return re.findall(r'"([^"]+)"', line)
    return []


def module_files(src):
    """Map module path tuple -> file, for every module file below src (lib.rs / main.rs roots)."""
    mods = {}
    for dirpath, _, files in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        parts = [] if rel == "." else rel.split(os.sep)
        if "bin" in parts or "tests" in parts:
            continue
        for f in files:
            if not f.endswith(".rs") or f.endswith("_tests.rs") or f == "tests.rs":
                continue
            name = f[:-3]
            if not parts and name in ("lib", "main"):
                key = ()
            elif name == "mod":
                key = tuple(parts)
            else:
                key = tuple(parts + [name])
            mods.setdefault(key, os.path.join(dirpath, f))
    return mods


TEST_BLOCK = re.compile(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", re.S)
PATH = re.compile(r"\b(crate|super|self)((?:::\s*\w+)+)")


def strip_tests(text):
    out, i = [], 0
    for m in TEST_BLOCK.finditer(text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    text = "".join(out)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"^\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*;", "", text, flags=re.M)


def resolve(mods, start, segs):
    path = list(start)
    best = None
    for s in segs:
        path.append(s)
        if tuple(path) in mods:
            best = tuple(path)
    return best


def edges(mods):
    out = {m: set() for m in mods}
    for mod, f in mods.items():
        text = strip_tests(open(f, encoding="utf-8").read())
        # `use a::{b, c::{d}}` groups: expand the braces into separate paths, innermost first.
        group = re.compile(r"([\w:]+)::\s*\{([^{}]*)\}")
        while True:
            expanded = group.sub(
                lambda m: ", ".join(
                    f"{m.group(1)}::{item.strip()}" for item in m.group(2).split(",") if item.strip()
                ),
                text,
            )
            if expanded == text:
                break
            text = expanded
        for m in PATH.finditer(text):
            kind = m.group(1)
            segs = [s.strip() for s in m.group(2).split("::") if s.strip()]
            if kind == "crate":
                base = []
            elif kind == "self":
                base = list(mod)
            else:
                ups = 1
                while segs and segs[0] == "super":
                    segs.pop(0)
                    ups += 1
                base = list(mod[: max(len(mod) - ups, 0)])
            target = resolve(mods, tuple(base), segs) or (tuple(base) if tuple(base) in mods else None)
            if target is None or target == mod:
                continue
            if mod[: len(target)] == target:  # a child naming its ancestor
                continue
            out[mod].add(target)
        # A path may also start with a child module's bare name (`pick::best(..)`).
        for child in (m for m in mods if len(m) == len(mod) + 1 and m[: len(mod)] == mod):
            if re.search(r"(?<![\w:])" + re.escape(child[-1]) + r"\s*::", text):
                out[mod].add(child)
    return out


def sccs(graph):
    index, low, stack, on, res, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            res.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return [c for c in res if len(c) > 1]


def main():
    found = 0
    for crate in crates():
        src = os.path.join(ROOT, crate, "src")
        if not os.path.isdir(src):
            continue
        graph = edges(module_files(src))
        for comp in sccs(graph):
            found += 1
            names = sorted("::".join(m) or "<root>" for m in comp)
            print(f"{crate}: cycle among {', '.join(names)}")
            for m in sorted(comp):
                for t in sorted(graph[m] & set(comp)):
                    print(f"    {'::'.join(m) or '<root>'} -> {'::'.join(t) or '<root>'}")
    if found:
        sys.exit(1)
    print("no import cycles")


if __name__ == "__main__":
    main()
