#!/usr/bin/env python3
"""Fail on an import cycle between the modules of a crate: `scripts/check-imports.py [SRC]`
(default `crates/burn-flash/src`).

A module is one file (`kernel/stage.rs`, `kernel/tile/mod.rs` is `kernel::tile`). Module A
depends on B where A's code names a path into B: a `use` (re-exports included) or an inline
`crate::…`, `super::…` or `self::…` path, resolved to the deepest module file the path reaches
(`crate::kernel::config::TileConfig` → `kernel::config`, `crate::kernel::TilePath` → `kernel`).
`mod` declarations and comments are not dependencies. An inline module at the end of a file
(`#[cfg(test)] mod tests`) counts as the file's module. Prints each cycle found and exits 1; prints the module count and
exits 0 when there is none.
"""
import pathlib
import re
import sys

src = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "crates/burn-flash/src")
files = {}
for path in sorted(src.rglob("*.rs")):
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    files[tuple(parts)] = path
modules = set(files)


def resolve(current, segments):
    """The deepest module of `modules` that the path `segments` (from `current`) reaches."""
    head, rest = segments[0], segments[1:]
    if current + (head,) in modules:  # a child module, named from its parent (`use config::X`)
        base, rest = current, segments
    elif head == "crate":
        base = ()
    elif head == "self":
        base = current
    elif head == "super":
        base = current[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    else:
        return None
    best = base if base in modules else None
    for seg in rest:
        base = base + (seg,)
        if base in modules:
            best = base
        else:
            break
    return best


PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
USE = re.compile(r"\buse\s+(\w+(?:::\w+)*)(?:::\{([^;]*)\})?\s*(?:as\s+\w+\s*)?;", re.S)
COMMENT = re.compile(r"//.*?$|/\*.*?\*/", re.S | re.M)

graph = {m: set() for m in modules}
INLINE_MOD = re.compile(r"^\s*(?:pub(?:\([\w:]+\))?\s+)?mod\s+\w+\s*\{", re.M)
for module, path in files.items():
    text = COMMENT.sub("", path.read_text())
    # An inline module at the end of the file (`mod tests { .. }`) is read as the file's own:
    # there `super::` names the file's module.
    inline = INLINE_MOD.search(text)
    if inline:
        text = text[: inline.start()] + re.sub(r"\bsuper::", "self::", text[inline.start() :])
    for match in PATH.finditer(text):
        segments = [match.group(1)] + match.group(2).strip(":").split("::")
        target = resolve(module, segments)
        if target is not None and target != module:
            graph[module].add(target)
    # `use a::b::{c, d::e}`: the group's members extend the prefix; `use child::X` names a
    # child module without `self`.
    for match in USE.finditer(text):
        prefix = match.group(1).split("::")
        target = resolve(module, prefix)
        if target is not None and target != module:
            graph[module].add(target)
        for member in re.split(r",", match.group(2) or ""):
            names = re.findall(r"\w+", member.split(" as ")[0])
            if names and names[0] != "self":
                target = resolve(module, prefix + names)
                if target is not None and target != module:
                    graph[module].add(target)
    # A module is never "below" its own ancestors by `mod` alone; an edge to an ancestor
    # (e.g. `super::Thing` defined in mod.rs) counts like any other.

# Cycles: strongly connected components of more than one module.
index, low, stack, on_stack, sccs, counter = {}, {}, [], set(), [], [0]


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        scc = []
        while True:
            w = stack.pop()
            on_stack.discard(w)
            scc.append(w)
            if w == v:
                break
        if len(scc) > 1:
            sccs.append(sorted(scc))


sys.setrecursionlimit(10000)
for v in sorted(graph):
    if v not in index:
        visit(v)

name = lambda m: "::".join(m) or "crate"
if sccs:
    for scc in sccs:
        members = set(scc)
        print("cycle:", ", ".join(name(m) for m in scc))
        for m in scc:
            inside = sorted(name(t) for t in graph[m] if t in members)
            print(f"  {name(m)} -> {', '.join(inside)}")
    sys.exit(1)
print(f"no import cycle among {len(modules)} modules of {src}")
