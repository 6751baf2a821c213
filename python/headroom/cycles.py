"""Python's cycle collector around a trace (anymodel.py): paused, and run only where the trace
says, over the trace's own objects."""
import contextlib
import gc
from typing import Callable

from .trace import StorageTrace


@contextlib.contextmanager
def earlier_objects_frozen():
    """What existed before the trace (the user's modules, transformers' and torch's own objects,
    hundreds of thousands with transformers imported) moved out of the cycle collector's way, so
    that collecting the trace's cycles as each phase begins scans the trace's objects alone: a full
    collection each time took more than half of a small model's trace. Not where the process has
    frozen objects of its own, which unfreezing would release."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


def collected_at_phases(trace: StorageTrace) -> Callable[[str], None]:
    """Python's cycle collector runs when it likes, and what it frees (a checkpoint's reference
    cycles) would land anywhere in the trace: with it paused, cycles are collected as each phase
    begins, outside any block, the same way in every block and every run."""
    def phase(name: str) -> None:
        trace.set_block(-1)
        gc.collect()
        trace.set_phase(name)

    return phase
