"""The allocation trace of a training step: every storage allocated and freed, in order.

:class:`StorageTrace` is a dispatch mode (``torch.utils._python_dispatch.TorchDispatchMode``): each
operator's outputs are looked at after it runs; a storage not seen before is an allocation, and a
finaliser on the storage records its free when the last tensor (or autograd's saved copy) lets it
go. Under ``FakeTensorMode`` nothing is computed, so the trace of a 70B model costs what its
operators' bookkeeping costs; over real tensors the same trace is what the real step allocated.

Each event carries the phase it happened in and a *block tag*: which of the model's repeated blocks
was running (``-1``: none), so that :mod:`headroom.blocks` can repeat a block's events to the full
depth. The tag comes from :meth:`StorageTrace.set_block` (forward and backward hooks) or, in the
optimizer and ``zero_grad`` phases, from the parameter an operator works on.

What a kernel allocates inside itself and frees before returning (a cpu kernel's scratch) is not a
storage any operator returns, so it is not in the trace.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PHASES = ("idle", "data", "forward", "backward", "optimizer", "zero_grad")
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}
_ATTR = "_headroom_trace_id"

MIXED = -3  # the tag after a foreach operator, which reads every block's tensors at once

# An event: (storage id, bytes, allocated, phase index, block tag).
Event = Tuple[int, int, bool, int, int]


class _Storage:
    __slots__ = ("sid", "nbytes", "owner", "op", "phase", "alive")

    def __init__(self, sid: int, nbytes: int, owner: int, op: str, phase: str):
        self.sid, self.nbytes, self.owner, self.op, self.phase, self.alive = sid, nbytes, owner, op, phase, True


class StorageTrace(TorchDispatchMode):
    """Records the storages the operators under it allocate, and their frees."""

    def __init__(self) -> None:
        super().__init__()
        self.events: List[Event] = []
        self.storages: Dict[int, _Storage] = {}
        self.phase = "idle"
        self.block = -1  # the block running now (markers), -1 for none
        self.by_param = False  # optimizer/zero_grad: the tag is the block of the tensors an operator reads
        self.block_of: Dict[int, int] = {}  # storage id -> block, for by_param tagging
        self.ops_in_phase = 0
        self.weight_ids: set = set()  # storages of parameters: a copy of one is a weight copy (autocast)
        self._next = 1

    # --- what the step runner tells it ---------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.ops_in_phase = 0
        self.by_param = phase in ("optimizer", "zero_grad")
        self.block = -1

    def set_block(self, block: int) -> None:
        self.block = block

    def add(self, tensor: torch.Tensor, op: str, block: int = -1) -> int:
        """Records ``tensor``'s storage as allocated now (weights and inputs, before the step)."""
        st = tensor.untyped_storage()
        sid = getattr(st, _ATTR, None)
        if sid is not None:
            return sid
        return self._allocate(st, op, block)

    def storage_id(self, tensor: torch.Tensor) -> Optional[int]:
        sid = getattr(tensor.untyped_storage(), _ATTR, None)
        return sid if sid else None

    # --- the recording ------------------------------------------------------------------------
    def _allocate(self, st, op: str, tag: int) -> int:
        sid = self._next
        self._next += 1
        nbytes = int(st.nbytes())
        setattr(st, _ATTR, sid)
        self.storages[sid] = _Storage(sid, nbytes, tag, op, self.phase)
        self.events.append((sid, nbytes, True, _PHASE_INDEX[self.phase], tag))
        weakref.finalize(st, self._free, sid)
        return sid

    def _free(self, sid: int) -> None:
        s = self.storages.get(sid)
        if s is None or not s.alive:
            return
        s.alive = False
        tag = self.block
        if self.by_param and (self.ops_in_phase == 0 or tag == MIXED):
            # zero_grad(set_to_none) frees without any operator between them, and a foreach
            # operator's outputs belong to every block at once: each free goes with its storage's block.
            tag = s.owner
        self.events.append((sid, s.nbytes, False, _PHASE_INDEX[self.phase], tag))

    def _param_tag(self, args, kwargs) -> Optional[int]:
        """The block of the parameters (and their state) an operator reads; None: it reads none
        (the tag stays); -2: several blocks at once (a foreach operator)."""
        tags = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                sid = getattr(t.untyped_storage(), _ATTR, None)
                if sid in self.block_of:
                    tags.add(self.block_of[sid])
        if not tags:
            return None
        return tags.pop() if len(tags) == 1 else -2

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.by_param:
            self.ops_in_phase += 1
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outputs:
            return out
        if self.by_param:
            tag = self._param_tag(args, kwargs)
            if tag is not None:
                self.ops_in_phase += 1  # an operator on the parameters (not the profiler's markers)
                self.block = MIXED if tag == -2 else tag
        fresh = []
        for k, t in enumerate(outputs):
            st = t.untyped_storage()
            if getattr(st, _ATTR, None) is not None:
                continue
            fresh.append((k, t, st))
        if not fresh:
            return out
        inputs = None
        name = str(func).replace("aten.", "").replace(".default", "")
        for k, t, st in fresh:
            if inputs is None:
                inputs = [a.untyped_storage() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            if any(st is s for s in inputs):
                # A view of, or a write into, a tensor made before the trace: not an allocation.
                setattr(st, _ATTR, 0)
                continue
            tag = -1 if self.block == MIXED else self.block
            if self.by_param and isinstance(args[0] if args else None, (list, tuple)):
                # A foreach operator's k-th output belongs to the k-th tensor of its first list.
                first = args[0]
                if k < len(first) and isinstance(first[k], torch.Tensor):
                    tag = self.block_of.get(getattr(first[k].untyped_storage(), _ATTR, None), -1)
            op = name
            if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and \
                    getattr(args[0].untyped_storage(), _ATTR, None) in self.weight_ids:
                op = "weight copy"
            sid = self._allocate(st, op, tag)
            if self.by_param:
                self.block_of[sid] = tag
        return out

    # --- afterwards ---------------------------------------------------------------------------
    def live_ids(self) -> List[int]:
        return [s.sid for s in self.storages.values() if s.alive]
