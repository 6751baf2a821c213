"""The estimate against transformers' own models, the whole grid: every family of
python/tests/test_hf_memory.py (which runs a subset of it) with every setting, as a table.

Each row: the step's peak (the highest phase peak) estimated and measured, and the phase whose
peak the estimate misses most, as a fraction of the measured one. Needs `make build` (the module
in build/python) and transformers in the venv; up to 9 GB of memory, a few minutes on two cores.

    PYTHONPATH=build/python ~/.cache/headroom/venv/bin/python bench/hf_memory.py [PRESET ...]

olmo-2-7b's layer at its real widths, in fp32 with AdamW, needs about 17 GB on its own.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))

import headroom  # noqa: E402,F401  (before any tensor: the counting allocator sees every one)
import torch  # noqa: E402
import test_hf_memory as grid  # noqa: E402


def main():
    torch.set_num_threads(1)
    only = set(sys.argv[1:])  # presets to run (default: all)
    print("| family (depth) | batch × seq, checkpointing | step peak: estimate | transformers | "
          "largest error of a phase's peak |")
    print("| --- | --- | ---: | ---: | ---: |")
    for family in grid.FAMILIES:
        preset, depth = family[0], family[3]
        if only and preset not in only:
            continue
        for row in grid.compare(*family, grid.SETTINGS):
            est, measured = row["estimate"]["phases"], row["measured"]
            errors = {p: (est[p] - measured[p]) / measured[p] for p in grid.PHASES}
            worst = max(errors, key=lambda p: abs(errors[p]))
            shown = f"{100 * errors[worst]:+.3f}% ({worst})" if abs(errors[worst]) >= 5e-6 else "< 0.001%"
            layers = next(iter(depth.values()))
            print(f"| {preset} ({layers} layer{'s' if layers > 1 else ''}) | {row['batch']} × {row['seq']}, "
                  f"{row['checkpointing']} | {max(est[p] for p in grid.PHASES):,} | "
                  f"{max(measured.values()):,} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
