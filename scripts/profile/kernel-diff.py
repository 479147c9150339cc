#!/usr/bin/env python3
"""Which fused kernels differ between two directories of generated CUDA sources
(`scripts/profile/kernel-sources.sh` or the `kernel_sources` example run on two trees), ignoring what
differs between two runs of the same tree: CubeCL emits shared-memory declarations, vector
structs and local declarations in hash-set order, and numbers its variables by expansion
order. Those lines are dropped and the variables renamed by first use, so a refactor that
leaves every kernel's statements unchanged reports nothing, without a GPU.

    scripts/profile/kernel-diff.py OLD_DIR NEW_DIR [--show N]

Exit status 1 when a kernel differs (its first N differing lines are shown, default 20), 2
when a kernel exists on one side only.
"""
import difflib
import pathlib
import re
import sys

DECLARATION = re.compile(r"^\s*[\w:<>]+\s+l_\w+(\[\d+\])?;\s*$")
VARIABLE = re.compile(r"\b(l_mut_\d+|l_\d+|shared_memory_\d+)\b")


def normalized(path):
    lines, in_struct = [], False
    for line in path.read_text().split("\n"):
        if line.startswith("struct __align__"):
            in_struct = True
        if in_struct:
            in_struct = not line.startswith("};")
            continue
        if "dynamic_shared_mem[" in line or line.startswith("// Shared") or DECLARATION.match(line):
            continue
        lines.append(line)
    names = {}
    rename = lambda m: names.setdefault(m.group(0), f"v{len(names)}")
    return [VARIABLE.sub(rename, line) for line in lines]


def main():
    args = sys.argv[1:]
    show = 20
    if "--show" in args:
        i = args.index("--show")
        show = int(args[i + 1])
        del args[i : i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    old, new = (pathlib.Path(a) for a in args)
    old_files = {p.name for p in old.glob("*.cu")}
    new_files = {p.name for p in new.glob("*.cu")}
    status = 0
    for name in sorted(old_files ^ new_files):
        print(f"only in {'old' if name in old_files else 'new'}: {name}")
        status = 2
    for name in sorted(old_files & new_files):
        diff = [
            line
            for line in difflib.unified_diff(normalized(old / name), normalized(new / name), n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")
        ]
        if diff:
            print(f"differs: {name} ({len(diff)} lines)")
            print("\n".join("    " + line for line in diff[:show]))
            status = status or 1
        else:
            print(f"same: {name}")
    sys.exit(status)


if __name__ == "__main__":
    main()
