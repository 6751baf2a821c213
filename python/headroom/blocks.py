"""A model's repeated blocks: found, traced at a shallow depth, and repeated to the full depth.

Transformers are a stack of blocks (a ``ModuleList`` of layers of one class), and their training
step allocates the same storages for every block of one kind. A block's allocations and frees
depend on its own kind and on its neighbours' (the residual it receives, the gradient it passes
back), so a block is known by its *context*: the kinds before it, of itself and after it. A trace
of a few blocks that holds every context of the stack holds everything a trace of eighty does.

:func:`choose` picks that shallow stack as a prefix and a suffix of the real one, each block at
the position it has in the full model (so a config's per-layer settings still apply): for identical
blocks the first, the second and the last; for Gemma 3's five sliding layers to one global, the
first seven and the last two of its 26. The first and the last block are made kinds of their own
when their allocations differ from the others' (:func:`with_ends`). :func:`expand` builds the full-depth event stream from the
shallow trace: each run of block-tagged events (forward 0,1,..; backward ..,1,0; the optimizer's
and ``zero_grad``'s walk over the parameters) becomes one copy per block, each from the traced
block of the same context, and a storage a copy refers to is the copy of the block that made it
(its own, or a neighbour's). The result is the trace the full depth would give, event for event;
:mod:`headroom.anymodel` checks it by expanding to a stack one block deeper and tracing that too.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .trace import Event, StorageTrace

_POSITION_ATTRS = {"layer_idx", "layer_id", "idx", "layer_number", "block_idx", "index", "layer_index"}
Context = Tuple[Optional[int], int, Optional[int]]


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


def contexts(kinds: Sequence[int]) -> List[Context]:
    """Each block's (kind before, own kind, kind after); None at the ends."""
    n = len(kinds)
    return [(kinds[j - 1] if j else None, kinds[j], kinds[j + 1] if j + 1 < n else None) for j in range(n)]


def choose(kinds: Sequence[int], real: Sequence[int], longer_than: int = 0) -> Optional[List[int]]:
    """The indices of the shortest prefix-and-suffix of the stack, longer than ``longer_than``
    blocks and shorter than the stack, whose contexts are exactly the stack's (by ``kinds``) and in
    which every block has the ``real`` kind the full stack has at that position; None if none is."""
    depth = len(kinds)
    need = set(contexts(kinds))
    for total in range(max(3, longer_than + 1), depth):
        for tail in range(1, total):
            idx = list(range(total - tail)) + list(range(depth - tail, depth))
            if [real[i] for i in idx] == list(real[:total]) and set(contexts([kinds[i] for i in idx])) == need:
                return idx
    return None


def with_ends(kinds: Sequence[int], first: bool, last: bool) -> List[int]:
    """``kinds`` with the first and/or the last block made kinds of their own: the first block's
    input may need no gradient (frozen embeddings, a plain tensor), and the last may feed a head
    differently; their allocations then differ from the blocks' between."""
    out = list(kinds)
    top = max(out, default=-1)
    if first and out:
        out[0] = top + 1
    if last and len(out) > 1:
        out[-1] = top + 2
    return out


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
        ids: Dict[tuple, int] = {}
        self.kind_of: List[int] = [ids.setdefault(signature(b), len(ids)) for b in (self.modules or [])]
        self.kinds = len(ids)

    def block_of_parameters(self) -> Dict[int, int]:
        """id(parameter) -> its block's index (in the stack as it is now: shallow while traced)."""
        out: Dict[int, int] = {}
        if self.modules is None:
            return out
        for i, b in enumerate(self.modules):
            for p in b.parameters():
                out.setdefault(id(p), i)
        return out

    @contextlib.contextmanager
    def shallow(self, indices: Sequence[int]) -> Iterator[None]:
        """The model with only the blocks at ``indices`` (in order), for the duration."""
        kept = self.modules._modules
        blocks = list(kept.values())
        self.modules._modules = type(kept)((str(k), blocks[i]) for k, i in enumerate(indices))
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

            # First of the block's pre-hooks: what another's does (FSDP's gather) is the block's.
            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class CannotExpand(Exception):
    """The trace's block runs are not the pattern the chosen blocks give."""


def templates(traced_kinds: Sequence[int], kinds: Sequence[int]) -> List[int]:
    """For each block of the stack ``kinds``, the first block of the traced stack with its context."""
    place: Dict[Context, int] = {}
    for t, c in enumerate(contexts(traced_kinds)):
        place.setdefault(c, t)
    try:
        return [place[c] for c in contexts(kinds)]
    except KeyError as e:
        raise CannotExpand(f"no traced block has the context {e.args[0]}") from None


def _segments(events: Sequence[Event]) -> List[Tuple[int, int, int]]:
    """Maximal runs of events with one tag, in one phase: (tag, start, end). What happens between
    two neighbouring blocks (a free as the loop moves on) goes with the block before: it recurs
    between every pair."""
    segments: List[Tuple[int, int, int]] = []
    for i, e in enumerate(events):
        tag = max(e[4], -1)
        if segments and segments[-1][0] == tag and events[segments[-1][1]][3] == e[3]:
            segments[-1] = (tag, segments[-1][1], i + 1)
        else:
            segments.append((tag, i, i + 1))
    merged: List[Tuple[int, int, int]] = []
    for k, seg in enumerate(segments):
        between = (seg[0] < 0 and merged and merged[-1][0] >= 0 and k + 1 < len(segments)
                   and segments[k + 1][0] >= 0 and abs(segments[k + 1][0] - merged[-1][0]) == 1
                   and events[merged[-1][1]][3] == events[segments[k + 1][1]][3])
        if between:
            merged[-1] = (merged[-1][0], merged[-1][1], seg[2])
        else:
            merged.append(seg)
    return merged


def _ordinals(events: Sequence[Event], owner: Dict[int, int],
              traced_kinds: Sequence[int]) -> Tuple[Dict[int, int], Dict[Tuple[int, int], int]]:
    """A block's storages correspond to another's of its kind by their order: the n-th storage a
    block allocates is what the n-th of the other is to it. Returns storage id -> n, and (block, n)
    -> a traced storage (for labels)."""
    traced = len(traced_kinds)
    ordinal: Dict[int, int] = {}
    counts = [0] * traced
    for sid, _, allocated, _, tag in events:
        o = owner.get(sid, -1)
        if allocated and 0 <= o < traced:
            ordinal[sid] = counts[o]
            counts[o] += 1
    for kind in set(traced_kinds):
        same = {counts[t] for t in range(traced) if traced_kinds[t] == kind}
        if len(same) != 1:
            raise CannotExpand(f"traced blocks of one kind allocate {sorted(same)} storages")
    return ordinal, {(owner[sid], n): sid for sid, n in ordinal.items()}


class _Expansion:
    """:func:`expand`'s state: the new storage ids, their sources, and the events written."""

    def __init__(self, events: Sequence[Event], owner: Dict[int, int], traced_kinds: Sequence[int],
                 kinds: Sequence[int]) -> None:
        self.events, self.owner, self.traced_kinds, self.kinds = events, owner, traced_kinds, kinds
        self.traced, self.depth = len(traced_kinds), len(kinds)
        self.template = templates(traced_kinds, kinds)
        self.copies: Dict[int, List[int]] = {}
        for j, t in enumerate(self.template):
            self.copies.setdefault(t, []).append(j)
        self.ordinal, self.by_ordinal = _ordinals(events, owner, traced_kinds)
        self.ids: Dict[Tuple[int, int], int] = {}
        self.source: Dict[int, int] = {}
        self.out: List[Event] = []
        self.after_ascending: Optional[bool] = None  # the direction of the last run of blocks

    def instance(self, sid: int, tmpl: Optional[int], copy: Optional[int]) -> int:
        o = self.owner.get(sid, -1)
        if o < 0 or sid not in self.ordinal:
            key = (-1, sid)
        else:
            if tmpl is None:
                mine = self.copies.get(o)
                if not mine:
                    raise CannotExpand(f"storage {sid} of block {o}, which no block copies, is used outside the blocks")
                if len(mine) == 1:
                    inst = mine[0]
                elif self.after_ascending is None:
                    raise CannotExpand(f"storage {sid} of block {o} is used outside the blocks")
                else:  # after a forward run the copy nearest the end, after a backward run the first
                    inst = mine[-1] if self.after_ascending else mine[0]
            else:
                inst = copy + (o - tmpl)
                if not 0 <= inst < self.depth or self.kinds[inst] != self.traced_kinds[o]:
                    raise CannotExpand(f"block {tmpl}'s events use storage {sid} of block {o}")
            key = (inst, self.ordinal[sid])
        new = self.ids.get(key)
        if new is None:
            new = self.ids[key] = len(self.ids) + 1
            # Labels come from the traced storage of that place: the block that copy copies.
            self.source[new] = sid if key[0] == -1 else self.by_ordinal.get((self.template[key[0]], key[1]), sid)
        return new

    def every_block(self, seen: set) -> set:
        kinds = self.traced_kinds
        return {(o, n) for (o, n) in seen
                if all((b, n) in seen for b in range(self.traced) if kinds[b] == kinds[o])}

    def emit(self, start: int, end: int, tmpl: Optional[int], copy: Optional[int]) -> None:
        events, owner, ordinal, kinds = self.events, self.owner, self.ordinal, self.traced_kinds
        every = set()
        if tmpl is None:
            # Outside the blocks, a storage of every traced block of a kind at once (autocast's
            # weight copies, freed together as it exits) is one of every block at the full depth.
            every = self.every_block({(owner.get(e[0], -1), ordinal[e[0]]) for e in events[start:end]
                                      if e[0] in ordinal})
        elif len(self.copies.get(tmpl, ())) == 1:
            # In an end block's run, frees of the same storage of every block of a kind at once (the
            # recomputed tensors checkpoint_wrapper's frames hold, let go as the first block's
            # backward ends) are that storage's free in every block at the full depth.
            freed = {(owner.get(e[0], -1), ordinal[e[0]]) for e in events[start:end] if e[0] in ordinal and not e[2]}
            every = {(o, n) for (o, n) in self.every_block(freed)
                     if any(b != tmpl for b in range(self.traced) if kinds[b] == kinds[o])}
        for sid, nbytes, allocated, phase, _ in events[start:end]:
            o = owner.get(sid, -1)
            if every and sid in ordinal and (o, ordinal[sid]) in every and (tmpl is None or not allocated):
                for j in self.copies.get(o, []):
                    self.out.append((self.instance(sid, o, j), nbytes, allocated, phase, -1 if copy is None else copy))
                continue
            self.out.append((self.instance(sid, tmpl, copy), nbytes, allocated, phase, -1 if copy is None else copy))

    def run(self) -> None:
        segments, traced, depth = _segments(self.events), self.traced, self.depth
        k = 0
        while k < len(segments):
            tag, start, end = segments[k]
            if tag < 0:
                self.emit(start, end, None, None)
                k += 1
                continue
            chain = segments[k:k + traced]
            tags = [seg[0] for seg in chain]
            if tags == list(range(traced)):
                order = range(depth)
                self.after_ascending = True
            elif tags == list(range(traced - 1, -1, -1)):
                order = range(depth - 1, -1, -1)
                self.after_ascending = False
            else:
                raise CannotExpand(f"a run of blocks {tags} at event {start}")
            by_tag = {t: (s0, s1) for t, s0, s1 in chain}
            for j in order:
                s0, s1 = by_tag[self.template[j]]
                self.emit(s0, s1, self.template[j], j)
            k += traced


def expand(events: Sequence[Event], owner: Dict[int, int], traced_kinds: Sequence[int],
           kinds: Sequence[int]) -> Tuple[List[Event], Dict[int, int]]:
    """The event stream of the stack ``kinds`` from one traced on the stack ``traced_kinds``
    (chosen by :func:`choose`: every context of ``kinds`` is one of its blocks').

    Segments of events with one block tag become one copy per block, each from the traced block of
    its context; a storage a copy refers to is the copy of the block that made it.
    ``owner``: storage id -> the block tag its allocation had (-1: none). Returns the new events and,
    for each new storage id, the traced storage it copies (for its label).
    """
    expansion = _Expansion(events, owner, traced_kinds, kinds)
    expansion.run()
    return expansion.out, expansion.source
