#!/usr/bin/env python3
"""How long this machine takes a running thread off its CPU: a loop on each CPU reads the
monotonic clock as fast as it can and reports the longest gap between two reads, and how many
were over 100 µs and over 1 ms. A query's max latency in a benchmark cannot be below what this
shows for an idle loop on the same machine (bench/peer/README.md, "Query max and this machine").

    scripts/hiccups.py [--seconds 10] [--cpus 0,1]

Only the Python standard library; a loop iteration is well under a microsecond, so gaps of
100 µs and more are the machine's, not the loop's.
"""
import argparse
import multiprocessing
import os
import time


def spin(cpu, seconds, out):
    os.sched_setaffinity(0, {cpu})
    clock = time.perf_counter_ns
    end = clock() + int(seconds * 1e9)
    last = clock()
    longest = over_100us = over_1ms = 0
    while last < end:
        now = clock()
        gap = now - last
        if gap > 100_000:
            over_100us += 1
            over_1ms += gap > 1_000_000
            longest = max(longest, gap)
        last = now
    out.put((cpu, longest / 1e3, over_100us, over_1ms))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--cpus", default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    args = ap.parse_args()
    out = multiprocessing.Queue()
    cpus = [int(c) for c in args.cpus.split(",")]
    procs = [multiprocessing.Process(target=spin, args=(c, args.seconds, out)) for c in cpus]
    for p in procs:
        p.start()
    results = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    for cpu, longest, over_100us, over_1ms in results:
        print(f"cpu {cpu}: longest gap {longest:.0f} µs; gaps over 100 µs {over_100us}, "
              f"over 1 ms {over_1ms} in {args.seconds:.0f} s")


if __name__ == "__main__":
    main()
