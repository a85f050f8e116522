#!/usr/bin/env python3
"""Finds import circles between the files of each crate: exit status 1 when any file imports a
file that imports it back, directly or around a longer circle.

A file imports another when it names a path into it: `use crate::a::b::…`, `use super::…`,
`use self::…`, or such a path inline (`crate::observe::lag()`). A path resolves to the deepest
module file it reaches (`crate::fleet::applier::Applier` is `src/fleet/applier.rs`); a name
re-exported at a crate's root is `lib.rs`. Declaring a submodule (`mod x;`) is not an import.
Test modules count too: a test that needs a file above its own is a circle all the same.

    scripts/import_cycles.py [crates/<name> ...]
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
INLINE_MOD = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", re.M)
USE_GROUP = re.compile(r"\b(crate|super|self)((?:::\w+)*)::\{([^;]*?)\};", re.S)


def module_of(src: pathlib.Path, file: pathlib.Path) -> list[str]:
    """The module path of `file` below `src` (`lib.rs`: [])."""
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("lib", "main", "mod"):
        parts = parts[:-1]
    return parts


def file_of(src: pathlib.Path, module: list[str]) -> pathlib.Path | None:
    """The file of the deepest existing module along `module`."""
    for depth in range(len(module), -1, -1):
        prefix = module[:depth]
        if not prefix:
            return src / "lib.rs"
        for candidate in (src.joinpath(*prefix).with_suffix(".rs"), src.joinpath(*prefix, "mod.rs")):
            if candidate.exists():
                return candidate
    return None


def strip_comments(text: str) -> str:
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def paths_in(text: str):
    """Every module path the text names, with `use a::{b, c::d}` groups expanded."""
    for group in USE_GROUP.finditer(text):
        head = [group.group(1)] + [p for p in group.group(2).split("::") if p]
        for item in re.split(r",(?![^{]*\})", group.group(3)):
            item = item.strip().split(" as ")[0]
            if item:
                yield head + [p for p in re.split(r"::|\{|\}|,", item) if p.strip()][:3]
    for match in PATH.finditer(text):
        yield [match.group(1)] + [p for p in match.group(2).split("::") if p]


def imports(src: pathlib.Path, file: pathlib.Path) -> set[pathlib.Path]:
    here = module_of(src, file)
    found = set()
    text = strip_comments(file.read_text())
    # Inside an inline module (`mod tests { … }`), `super` is this file's own module.
    inline = INLINE_MOD.search(text)
    outer, inner = (text, "") if inline is None else (text[: inline.start()], text[inline.start() :])
    for nested, part in ((0, outer), (1, inner)):
        for path in paths_in(part):
            target = resolve(src, file, here, path, nested)
            if target is not None and target != file:
                found.add(target)
    return found


def resolve(src, file, here, path, nested):
    """The file `path` (named in `file`, at `nested` inline modules deep) points into."""
    if True:
        head, rest = path[0], [p.strip() for p in path[1:]]
        if head == "crate":
            module = rest
        elif head == "super":
            up = 1
            while rest and rest[0] == "super":
                up, rest = up + 1, rest[1:]
            # `super` of the file module `a/b.rs` (a::b) is `a`; of `a/mod.rs` (a), the root.
            up -= nested
            module = (here[: len(here) - up] if up > 0 else here) + rest
        else:  # self
            module = here + rest
        return file_of(src, module)


def cycles(src: pathlib.Path) -> list[list[pathlib.Path]]:
    files = sorted(src.rglob("*.rs"))
    graph = {f: imports(src, f) for f in files}
    # Tarjan's strongly connected components.
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for f in files:
        if f not in index:
            visit(f)
    return out


def main() -> int:
    crates = [ROOT / c for c in sys.argv[1:]] or sorted((ROOT / "crates").iterdir())
    found = 0
    for crate in crates:
        src = crate / "src"
        if not (src / "lib.rs").exists():
            continue
        for component in cycles(src):
            found += 1
            names = ", ".join(str(f.relative_to(ROOT)) for f in component)
            print(f"import circle: {names}")
    if found:
        print(f"{found} import circle(s)")
        return 1
    print("no import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
