"""A model's repeated blocks: found, traced at a shallow depth, and repeated to the full depth.

Transformers are a stack of identical blocks (a ``ModuleList`` of layers of one class and shape).
Their training step allocates the same storages for every block, so a trace of three blocks holds
everything a trace of eighty does: the first block (after the embedding), a middle one (between two
blocks) and the last (before the head). :func:`expand` builds the full-depth event stream from it:
each run of block-tagged events (forward 0,1,2; backward 2,1,0; the optimizer's and ``zero_grad``'s
walk over the parameters 0,1,2) becomes one copy per block — the first and the last from the
traced first and last blocks, the others from the middle one — and a storage a copy refers to is
the copy of the block that made it (its own, or a neighbour's). The result is the trace the full
depth would give, event for event, when the blocks are identical; the test holds it to that.

Blocks that differ (Gemma 3's sliding and global layers, an MoE model with some dense layers) are
traced at their full depth, and the result says so.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .trace import Event, StorageTrace

TRACED_DEPTH = 3  # first, middle, last
_POSITION_ATTRS = {"layer_idx", "layer_id", "idx", "layer_number", "block_idx", "index", "layer_index"}


def _simple(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def signature(block: torch.nn.Module) -> tuple:
    """What makes two blocks allocate alike: class, parameter and buffer shapes, dtypes and
    trainability, and the simple settings of every submodule (a layer's position excepted)."""
    parts = []
    for name, m in block.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in _POSITION_ATTRS and _simple(v)))
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers(recurse=False) if b is not None)
        parts.append((name, type(m).__qualname__, attrs, params, buffers))
    return tuple(parts)


class Blocks:
    """The model's stack: the ``ModuleList`` holding most parameters among those of two or more
    children of one class."""

    def __init__(self, model: torch.nn.Module):
        self.name: Optional[str] = None
        self.modules: Optional[torch.nn.ModuleList] = None
        best = 0
        for name, m in model.named_modules():
            if not isinstance(m, torch.nn.ModuleList) or len(m) < 2:
                continue
            if len({type(c) for c in m}) != 1:
                continue
            size = sum(p.numel() for p in m.parameters())
            if size > best:
                best, self.name, self.modules = size, name, m
        self.depth = len(self.modules) if self.modules is not None else 0
        self.kinds = len({signature(b) for b in self.modules}) if self.modules is not None else 0

    @property
    def identical(self) -> bool:
        return self.modules is not None and self.kinds == 1

    def can_extrapolate(self) -> bool:
        return self.identical and self.depth > TRACED_DEPTH

    def block_of_parameters(self) -> Dict[int, int]:
        """id(parameter) -> its block's index (blocks at the traced depth)."""
        out: Dict[int, int] = {}
        if self.modules is None:
            return out
        for i, b in enumerate(self.modules):
            for p in b.parameters():
                out.setdefault(id(p), i)
        return out

    @contextlib.contextmanager
    def shallow(self, depth: int) -> Iterator[None]:
        """The model with only its first ``depth`` blocks, for the duration."""
        kept = self.modules._modules
        self.modules._modules = type(kept)(list(kept.items())[:depth])
        try:
            yield
        finally:
            self.modules._modules = kept

    @contextlib.contextmanager
    def marked(self, trace: StorageTrace) -> Iterator[None]:
        """Tags the trace with the running block: forward hooks mark each block's forward, and
        hooks on its input's and output's gradients its backward."""
        handles = []

        def first_grad_tensor(values) -> Optional[torch.Tensor]:
            for v in torch.utils._pytree.tree_flatten(values)[0]:
                if isinstance(v, torch.Tensor) and v.requires_grad:
                    return v
            return None

        for i, block in enumerate(self.modules):
            def pre(module, args, kwargs, i=i):
                trace.set_block(i)
                if trace.phase == "forward" and torch.is_grad_enabled():
                    t = first_grad_tensor((args, kwargs))
                    if t is not None:
                        t.register_hook(lambda g, i=i: trace.set_block(i - 1))

            def post(module, args, kwargs, output, i=i):
                if trace.phase != "forward":
                    return  # a recompute in backward (checkpointing): still block i's backward
                if torch.is_grad_enabled():
                    t = first_grad_tensor(output)
                    if t is not None:
                        t.register_hook(lambda g, i=i: trace.set_block(i))
                trace.set_block(-1)

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class CannotExpand(Exception):
    """The trace's block runs are not the 0,1,2 / 2,1,0 pattern identical blocks give."""


def expand(events: Sequence[Event], owner: Dict[int, int], traced: int, depth: int) -> Tuple[List[Event], Dict[int, int]]:
    """The event stream at ``depth`` blocks from one traced at ``traced`` (3) blocks.

    ``owner``: storage id -> the block tag its allocation had (-1: none). Returns the new events and,
    for each new storage id, the traced storage it copies (for its label).
    """
    if traced != TRACED_DEPTH:
        raise CannotExpand(f"traced at {traced} blocks, not {TRACED_DEPTH}")
    last = traced - 1
    # Segments: maximal runs of events with one tag.
    segments: List[Tuple[int, int, int]] = []  # (tag, start, end)
    for i, e in enumerate(events):
        tag = max(e[4], -1)
        if segments and segments[-1][0] == tag:
            segments[-1] = (tag, segments[-1][1], i + 1)
        else:
            segments.append((tag, i, i + 1))
    # What happens between two neighbouring blocks (a free as the loop moves on) goes with the
    # block before: it recurs between every pair.
    merged: List[Tuple[int, int, int]] = []
    for k, seg in enumerate(segments):
        between = (seg[0] < 0 and merged and merged[-1][0] >= 0 and k + 1 < len(segments)
                   and abs(segments[k + 1][0] - merged[-1][0]) == 1)
        if between:
            merged[-1] = (merged[-1][0], merged[-1][1], seg[2])
        else:
            merged.append(seg)
    segments = merged

    # A block's storages correspond to another's by their order: the n-th storage block 0 allocates
    # is what the n-th of block 1 is to block 1 (identical blocks allocate alike, run for run).
    ordinal: Dict[int, int] = {}
    counts = [0] * traced
    for sid, _, allocated, _, tag in events:
        o = owner.get(sid, -1)
        if allocated and o >= 0:
            ordinal[sid] = counts[o]
            counts[o] += 1
    if len(set(counts)) != 1:
        raise CannotExpand(f"the traced blocks allocate {counts} storages")
    by_ordinal: Dict[Tuple[int, int], int] = {}  # (owner, ordinal) -> a traced storage, for labels
    for sid, n in ordinal.items():
        by_ordinal[(owner[sid], n)] = sid

    ids: Dict[Tuple[int, int], int] = {}
    source: Dict[int, int] = {}
    out: List[Event] = []

    after_ascending = [None]  # the direction of the last run of blocks, for the events after it

    def instance(sid: int, template: Optional[int], copy: Optional[int]) -> int:
        o = owner.get(sid, -1)
        if o < 0 or sid not in ordinal:
            key = (-1, sid)
        else:
            if template is None:
                if o == 0:
                    inst = 0
                elif o == last:
                    inst = depth - 1
                elif after_ascending[0] is not None:
                    # After blocks 0,1,2 the middle block is the one before the last; after 2,1,0 the second.
                    inst = depth - 1 - (last - o) if after_ascending[0] else o
                else:
                    raise CannotExpand(f"storage {sid} of block {o} is used outside the blocks")
            else:
                inst = copy + (o - template)
                if not 0 <= inst < depth:
                    raise CannotExpand(f"block {template}'s events use storage {sid} of block {o}")
            key = (inst, ordinal[sid])
        new = ids.get(key)
        if new is None:
            new = ids[key] = len(ids) + 1
            # Labels come from the traced storage of that place: the first block's, the last's, or the middle one's.
            source[new] = sid if key[0] == -1 else by_ordinal[(0 if inst == 0 else last if inst == depth - 1 else 1, key[1])]
        return new

    def emit(start: int, end: int, template: Optional[int], copy: Optional[int]) -> None:
        every = set()
        if template is None:
            # Outside the blocks, a storage of every traced block at once (autocast's weight copies,
            # freed together as it exits) is one of every block at the full depth.
            seen = {(owner.get(e[0], -1), ordinal[e[0]]) for e in events[start:end] if e[0] in ordinal}
            every = {n for (o, n) in seen if o == 1 and all((b, n) in seen for b in range(traced))}
        for sid, nbytes, allocated, phase, _ in events[start:end]:
            if every and sid in ordinal and owner.get(sid) == 1 and ordinal[sid] in every:
                for j in range(1, depth - 1):
                    out.append((instance(sid, 1, j), nbytes, allocated, phase, -1))
                continue
            out.append((instance(sid, template, copy), nbytes, allocated, phase, -1 if copy is None else copy))

    def template_of(j: int) -> int:
        return 0 if j == 0 else last if j == depth - 1 else 1

    k = 0
    while k < len(segments):
        tag, start, end = segments[k]
        if tag < 0:
            emit(start, end, None, None)
            k += 1
            continue
        chain = segments[k:k + traced]
        tags = [s[0] for s in chain]
        if tags == list(range(traced)):
            order = range(depth)
            after_ascending[0] = True
        elif tags == list(range(last, -1, -1)):
            order = range(depth - 1, -1, -1)
            after_ascending[0] = False
        else:
            raise CannotExpand(f"a run of blocks {tags} at event {start}")
        by_tag = {t: (s0, s1) for t, s0, s1 in chain}
        for j in order:
            s0, s1 = by_tag[template_of(j)]
            emit(s0, s1, template_of(j), j)
        k += traced
    return out, source
