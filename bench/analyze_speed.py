#!/usr/bin/env python3
"""headroom analyze against Python's pickle.load on the same snapshot: time and peak memory.

    analyze_speed.py [--sizes 10MB,100MB,1GB] [--dir DIR] [--keep]

For each size, tools/snapshot_gen.py writes a training-loop snapshot of about that size (the
documented structure, tracebacks shared as PyTorch shares them, ~59 bytes an event), then each of
these runs once, in turn, in a fresh process whose wall time and peak RSS (ru_maxrss) are taken:
  headroom-analyze --json FILE    the analysis, without LibTorch (build/headroom-analyze)
  headroom analyze --json FILE    the same inside the main binary, which loads LibTorch first
  python: pickle.load(FILE)       only loading it, which is what every Python tool does first
Ratios are against pickle.load, from the same run. Needs build/ (make build) and the setup venv.
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("HEADROOM_BUILD", os.path.join(ROOT, "build"))
PYTHON = os.environ.get("HEADROOM_PYTHON", os.path.expanduser("~/.cache/headroom/venv/bin/python"))

# Runs argv[1:] as a child and prints its wall seconds and the child's peak RSS in KiB.
WRAPPER = r"""
import resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)
"""


def measure(argv):
    out = subprocess.run([sys.executable, "-c", WRAPPER, *argv], check=True, capture_output=True, text=True).stdout
    seconds, rss_kib, rc = out.split()
    if rc != "0":
        raise SystemExit(f"{argv} exited with {rc}")
    return float(seconds), int(rss_kib) * 1024


def parse_size(text):
    for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main():
    sizes, folder, keep = ["10MB", "100MB", "1GB"], None, False
    args = sys.argv[1:]
    while args:
        if args[0] == "--sizes":
            sizes, args = args[1].split(","), args[2:]
        elif args[0] == "--dir":
            folder, args = args[1], args[2:]
        elif args[0] == "--keep":
            keep, args = True, args[1:]
        else:
            raise SystemExit(__doc__)
    folder = folder or tempfile.mkdtemp(prefix="headroom-analyze-bench-")
    print(f"{'file':>10} {'events':>10}  {'tool':<22} {'seconds':>8} {'peak RSS':>10}  {'time ratio':>10} {'RSS ratio':>9}")
    for size in sizes:
        path = os.path.join(folder, f"snapshot_{size}.pickle")
        facts = subprocess.run([PYTHON, os.path.join(ROOT, "tools", "snapshot_gen.py"), "large", path, "--bytes", size],
                               check=True, capture_output=True, text=True).stdout
        events = facts.split('"events": ')[1].split("}")[0].split(",")[0]
        mb = os.path.getsize(path) / 1e6
        runs = [
            ("headroom-analyze", [os.path.join(BUILD, "headroom-analyze"), "--json", path]),
            ("headroom analyze", [os.path.join(BUILD, "headroom"), "analyze", "--json", path]),
            ("python pickle.load", [PYTHON, "-c", "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))", path]),
        ]
        results = [(name, *measure(argv)) for name, argv in runs]
        base_s, base_rss = results[-1][1], results[-1][2]
        for name, seconds, rss in results:
            print(f"{mb:>8.0f}MB {events:>10}  {name:<22} {seconds:>8.2f} {rss / 2**20:>8.0f}MiB  {seconds / base_s:>10.2f} "
                  f"{rss / base_rss:>9.2f}", flush=True)
        if not keep:
            os.remove(path)
    if not keep:
        os.rmdir(folder)


if __name__ == "__main__":
    main()
