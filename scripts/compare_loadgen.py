#!/usr/bin/env python3
"""Side by side: the JSON lines of `kv-indexer-loadgen --json-out` (or scripts/overload.py
--json-out) for runs against two or more servers, one after the other.

Runs are grouped by label. A label "NAME/PHASE" (as overload.py writes them) puts NAME in a
column and PHASE in a table of its own, so `old/overload` and `new/overload` are compared.
Repeated runs of a label are reduced to their median (n says how many). The ratio columns
divide each label by the first one (in order of appearance, or as --labels gives them).

    scripts/compare_loadgen.py runs.jsonl [more.jsonl …] [--labels old,new]
"""

import argparse
import json
import statistics
import sys

# (row name, field, scale): latencies are in µs in the lines, shown in ms.
ROWS = [
    ("sent/s", "sent_per_s", 1),
    ("answered/s", "answered_per_s", 1),
    ("answered p50 ms", "answered_p50_us", 1e-3),
    ("answered p90 ms", "answered_p90_us", 1e-3),
    ("answered p99 ms", "answered_p99_us", 1e-3),
    ("answered p999 ms", "answered_p999_us", 1e-3),
    ("failed/s", "failed_per_s", 1),
    ("refused p50 ms", "refused_p50_us", 1e-3),
    ("refused p99 ms", "refused_p99_us", 1e-3),
    ("applies/s", "applies_per_s", 1),
    ("apply p50 ms", "apply_p50_us", 1e-3),
    ("apply p99 ms", "apply_p99_us", 1e-3),
    ("CPU 0 others s", "cpu0_others_s", 1),
]


def load(paths):
    """{(phase, name): [run, …]} and the names in order of first appearance."""
    runs, names = {}, []
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    run = json.loads(line)
                except json.JSONDecodeError as error:
                    sys.exit(f"{path}:{number}: not a JSON line ({error})")
                name, _, phase = run.get("label", "").partition("/")
                runs.setdefault((phase, name), []).append(run)
                if name not in names:
                    names.append(name)
    return runs, names


def median(runs, field):
    values = [r[field] for r in runs if isinstance(r.get(field), (int, float))]
    return statistics.median(values) if values else None


def table(phase, names, runs):
    present = [n for n in names if (phase, n) in runs]
    header = [f"{n or '(no label)'} (n={len(runs[phase, n])})" for n in present]
    header += [f"{n}/{present[0]}" for n in present[1:]]
    widths = [max(12, len(h) + 2) for h in header]
    print(f"\n{'phase ' + phase if phase else 'runs':<18}" + "".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for row, field, scale in ROWS:
        values = [median(runs[phase, n], field) for n in present]
        if all(v is None for v in values):
            continue
        cells = ["-" if v is None else f"{v * scale:.2f}" for v in values]
        base = values[0]
        for v in values[1:]:
            cells.append("-" if not base or v is None else f"{v / base:.2f}")
        print(f"{row:<18}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    for n in present:
        codes = {}
        for r in runs[phase, n]:
            for code, count in r.get("failed_by_code", {}).items():
                codes[code] = codes.get(code, 0) + count
        if codes:
            print(f"  {n or '(no label)'}: failed calls by code, all runs: {codes}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--labels", help="comma-separated names, in column order (the first is the base)")
    args = ap.parse_args()
    runs, names = load(args.files)
    if args.labels:
        names = args.labels.split(",")
        missing = [n for n in names if not any(name == n for _, name in runs)]
        if missing:
            sys.exit(f"no runs labelled {missing}")
    phases = []
    for phase, _ in runs:
        if phase not in phases:
            phases.append(phase)
    for phase in phases:
        table(phase, names, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
