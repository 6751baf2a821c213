"""A cpu that behaves like a card of a given size (headroom's counting allocator, capped)."""
from __future__ import annotations

from typing import Optional, Union

from . import _core


class cpu_budget:
    """Caps this process's cpu tensor memory at ``size`` bytes, as a card of that size would.

    An allocation that would take the live bytes past it raises ``torch.OutOfMemoryError`` with a
    message in the style of CUDA's, and allocates nothing, so an unchanged training script runs out
    of memory on a laptop where it would on the card. Takes effect at once; as a context manager,
    the previous budget comes back on exit::

        headroom.cpu_budget("8GiB")          # from now on
        with headroom.cpu_budget("512MiB"):  # for a block
            train()

    ``None`` removes the cap. Only tensors allocated since ``import headroom`` count.
    """

    def __init__(self, size: Union[int, str, None]):
        from . import parse_size

        self.bytes: Optional[int] = None if size is None else parse_size(size)
        self._previous = _core.cpu_budget()
        _core.set_cpu_budget(self.bytes)

    def __enter__(self) -> "cpu_budget":
        return self

    def __exit__(self, *exc) -> None:
        _core.set_cpu_budget(self._previous)

    def __repr__(self) -> str:
        return f"cpu_budget({'none' if self.bytes is None else _core.format_bytes(self.bytes)})"


def inject_cpu_oom(nth: int) -> None:
    """Fault injection for tests: the ``nth`` cpu allocation from now raises ``torch.OutOfMemoryError``.

    One-shot, like ``headroom train --inject-oom``; ``inject_cpu_oom(0)`` disarms.
    """
    if nth <= 0:
        _core.disarm_cpu_faults()
    else:
        _core.fail_nth_cpu_allocation(int(nth))
