#!/usr/bin/env python3
"""Lists production Rust functions longer than a bound (default 80 lines).

Production means `crates/*/src/**.rs` outside `#[cfg(test)]` modules; a function's length runs
from its `fn` line to its closing brace. Brace counting ignores strings and comments well enough
for this tree (rustfmt-formatted code). Exit status 1 when any function is over the bound.

    scripts/long_functions.py [--max 80]
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")


def strip(line: str) -> str:
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split("//", 1)[0]


def functions(path: pathlib.Path):
    lines = path.read_text().splitlines()
    i = 0
    in_test = False
    test_depth = 0
    depth = 0
    while i < len(lines):
        text = strip(lines[i])
        if re.match(r"^\s*#\[cfg\(test\)\]", lines[i]):
            in_test = True
            test_depth = depth
        match = FN.match(text)
        if match and not in_test and not text.rstrip().endswith(";"):
            start = i
            fn_depth = depth
            opened = False
            while i < len(lines):
                t = strip(lines[i])
                depth += t.count("{") - t.count("}")
                if "{" in t:
                    opened = True
                if opened and depth <= fn_depth:
                    break
                if not opened and t.rstrip().endswith(";"):
                    break
                i += 1
            yield match.group(6), start + 1, i - start + 1
            i += 1
            continue
        depth += text.count("{") - text.count("}")
        if in_test and depth <= test_depth and "}" in text:
            in_test = False
        i += 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max", type=int, default=80)
    args = parser.parse_args()
    over = []
    for path in sorted(ROOT.glob("crates/*/src/**/*.rs")):
        for name, line, length in functions(path):
            if length > args.max:
                over.append((length, f"{path.relative_to(ROOT)}:{line}", name))
    for length, where, name in sorted(over, reverse=True):
        print(f"{length:5} {where} {name}")
    print(f"{len(over)} production functions over {args.max} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
