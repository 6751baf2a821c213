"""The activation-offload lever in your own loop: what autograd saves goes to host memory.

``with headroom.offload_activations(): loss = model(**batch).loss`` — every tensor autograd saves
for backward inside the block is copied to host memory as it is saved, and copied back when
backward needs it (``torch.autograd.graph.saved_tensors_hooks``). Parameters stay where they are.
Wrap the layers' forward (or all of it) and call backward outside the block.

On cuda the host copies are pinned. On the cpu, under headroom's counting allocator, they are made
in its host pool: counted apart from the budgeted device (``cpu_budget``), in
``_core.cpu_host_peak_bytes()``, so that the saving shows as it would on a card; ``headroom.estimate``
and ``headroom.measure`` of a model that uses it leave the host copies out of the device's peak.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import _core, trace

__all__ = ["offload_activations"]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    # headroom's own traces (estimate, measure) leave host memory out of the device's bytes.
    with trace.host_memory():
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        else:
            _core.set_cpu_host_pool(True)
            try:
                host = torch.empty(t.shape, dtype=t.dtype)
            finally:
                _core.set_cpu_host_pool(False)
        host.copy_(t)
    return host


@contextlib.contextmanager
def offload_activations() -> Iterator[None]:
    """While the block runs, saved tensors other than parameters (leaves that require grad) move to
    host memory; backward brings each back to its device for the node that needs it."""

    def pack(t: torch.Tensor):
        if t.is_leaf and t.requires_grad or t.numel() == 0:
            return t
        return (t.device, _host_copy(t))

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device) if device.type != "cpu" else host.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
