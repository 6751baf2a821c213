"""Any model, the whole zoo: headroom.estimate(model, inputs) against a real training step of each
model of python/tests/test_anymodel.py (which tests a subset of them), with the seconds each took.

    PYTHONPATH=build/python OMP_NUM_THREADS=2 ~/.cache/headroom/venv/bin/python bench/anymodel_zoo.py [NAME ...]

Each row: the estimated and measured step peaks (bytes), the peak's error, the worst phase's error,
what was traced, and the seconds the estimate and the measurement took together. NAME: a part of
a model's name, to run only those.
"""
import contextlib
import io
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import headroom  # noqa: E402,F401  (first: the counting allocator the measurement reads)
import reduced_matmul  # noqa: E402,F401  (as the test runs: bf16 cpu matmuls through float32)
import test_anymodel as zoo  # noqa: E402


def main():
    wanted = sys.argv[1:]
    print("| model | estimated peak (B) | measured peak (B) | peak error | worst phase error | traced | in test | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    worst = 0.0
    for name, *_ in zoo.ZOO:
        if wanted and not any(w in name for w in wanted):
            continue
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the test's own row
            est, meas = zoo.compared(name)
        seconds = time.perf_counter() - start
        peak = max(meas.values())
        errs = [est["phases"][p] / meas[p] - 1 for p in zoo.PHASES if meas[p] > 0]
        phase = max(errs, key=abs)
        worst = max(worst, abs(est["peak_bytes"] / peak - 1))
        print(f"| {name} | {est['peak_bytes']:,} | {peak:,} | {est['peak_bytes'] / peak - 1:+.3%} | {phase:+.3%} | "
              f"{est['traced']['note']} | {'yes' if name in zoo.TESTED else 'no'} | {seconds:.1f} |", flush=True)
    print(f"worst peak error {worst:.4%} (bound {zoo.PEAK_BOUND:.0%})")


if __name__ == "__main__":
    main()
