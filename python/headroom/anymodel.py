"""Estimate and measure the model the user has: any ``torch.nn.Module``.

:func:`estimate_model` runs the user's own training step on fake tensors (``FakeTensorMode``:
shapes, dtypes and aliasing without data) under :class:`headroom.trace.StorageTrace`, which
records every storage allocated and freed with its phase; the model's repeated blocks are traced
once per neighbourhood and repeated to the full depth (:mod:`headroom.blocks`). The C++ core turns
the trace into the estimate every other path returns, and replays it through the caching
allocator's policy for the bytes a card would reserve. A forward that needs values is traced the
same way on real tensors.

:func:`headroom.measure.measure_model` runs the same step for real on the cpu, under headroom's
counting allocator: the measured truth beside the estimate. Both reset the counting allocator's
peak (the probe of a kernel's scratch does too), which a :class:`headroom.Monitor` phase open
around them would see.

The user's model is borrowed, not changed: its parameters and buffers are swapped for fake (or, for
measure, copied) ones for the duration, hooks are removed and modes restored, also on error.
"""
from __future__ import annotations

import contextlib
import gc
import json
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                           UnsupportedOperatorException)
from torch.utils._pytree import tree_map

from . import _core
from .blocks import Blocks, CannotExpand, choose, expand, templates, with_ends
from .cycles import collected_at_phases, earlier_objects_frozen
from .eager_paths import eager_masks
from .step import OptimizerLike, UsageError, check_settings, make_optimizer, prepared, run_steps
from .trace import PHASES, Event, StorageTrace
from .world import Parallelize, ParallelizeError, World, fake_world, local

STEPS = 2  # the first step makes the optimizer's state, the second finds it there


def _swap_tensors(model: torch.nn.Module, make: Callable[[torch.Tensor, bool], torch.Tensor]):
    """Replaces every parameter and buffer of ``model`` by ``make(tensor, is_parameter)`` (a tensor
    shared by two modules, as tied embeddings are, stays shared); returns the undo."""
    done: Dict[int, torch.Tensor] = {}
    saved: List[Tuple[dict, str, Any]] = []
    for m in model.modules():
        for table, is_param in ((m._parameters, True), (m._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                new = done.get(id(t))
                if new is None:
                    new = done[id(t)] = make(t, is_param)
                saved.append((table, name, t))
                table[name] = new

    def undo():
        for table, name, t in reversed(saved):
            table[name] = t

    return undo


def _floating_dtype(t: torch.Tensor, precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" and t.is_floating_point() else t.dtype


def _map_inputs(inputs: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``inputs`` with each tensor made anew; one tensor passed twice (``input_ids`` as the
    ``labels``) stays one."""
    made: Dict[int, torch.Tensor] = {}

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in made:
            made[id(x)] = make(x)
        return made[id(x)]

    return tree_map(one, inputs)


class _Categories:
    """What each traced storage is, decided as the step runs (at each phase's end)."""

    def __init__(self, trace: StorageTrace):
        self.trace = trace
        self.kind: Dict[int, str] = {}

    def mark(self, tensors, kind: str) -> None:
        for t in tensors:
            sid = self.trace.storage_id(t)
            if sid is not None:
                self.kind.setdefault(sid, kind)

    def forward_done(self) -> None:
        for sid in self.trace.live_ids():
            s = self.trace.storages[sid]
            if s.phase == "forward" and not s.op.startswith("FSDP gathered parameters"):
                self.kind.setdefault(sid, "activations")

    def label(self, sid: int) -> Tuple[str, str]:
        s = self.trace.storages[sid]
        kind = self.kind.get(sid)
        if kind is None:
            kind = "weight_copies" if s.op == "weight copy" else "temporaries"
            if s.op.startswith("FSDP gathered parameters"):
                return f"FSDP gathered parameters: {s.op}", "weight_copies"
        if kind in ("weights", "gradients", "optimizer", "weight_copies", "logits"):
            return kind, kind
        if kind in ("buffers", "inputs"):
            return kind, "other"
        return f"{kind}: {s.op}", kind


class _Traced(NamedTuple):
    events: List[Event]
    labels: Dict[int, Tuple[str, str]]
    owner: Dict[int, int]  # storage id -> the block tag of its allocation
    step_begin: int  # events before it are the setup (weights, inputs)
    flops: int  # per step
    block_flops: List[int]  # per step, of each block of the stack as traced


def _trace_step(*args, **kwargs) -> _Traced:
    with earlier_objects_frozen():
        return _traced_step(*args, **kwargs)


def _traced_step(model, inputs, loss_fn, optimizer, precision, checkpointing, device, accum, blocks: Blocks,
                 fake: bool = True, world: World = None) -> _Traced:
    """The step's trace. On fake tensors, or (``fake=False``, for a model whose forward needs
    values) on real ones: seeded random weights, the inputs' own values (zeros for meta inputs).
    With a ``world``, one rank's step of a copy of the model the user's parallelism was applied to."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=world is not None) if fake else contextlib.nullcontext()
    generator = torch.Generator().manual_seed(0)
    trace = StorageTrace(probe_scratch=device == "cpu", cuda=device.startswith("cuda"))
    cats = _Categories(trace)
    if world is not None:
        model = world.parallelized(model)
        blocks = Blocks(model)
        trace.stack_name = blocks.name
    block_of_param: Dict[int, int] = {}
    setup: List[Tuple[torch.Tensor, str, int]] = []

    def make(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        with fake_mode:
            new = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=_floating_dtype(t, precision), device="cpu")
            if not fake:
                with torch.no_grad():
                    if t.is_meta:
                        new.normal_(0.0, 0.02, generator=generator) if new.is_floating_point() else new.zero_()
                    else:
                        new.copy_(t)
            if is_param:
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        setup.append((new, "weights" if is_param else "buffers", block_of_param.get(id(t), -1)))
        return new

    if world is None:
        block_of_param.update(blocks.block_of_parameters())
        undo = _swap_tensors(model, make)
    else:
        undo = _materialized_shards(model, fake_mode, blocks, block_of_param, setup)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with fake_mode:
            fake_inputs = _map_inputs(inputs, lambda x: torch.empty_strided(tuple(x.shape), tuple(x.stride()),
                                                                             dtype=x.dtype, device="cpu")) if fake \
                else _real_inputs(inputs)
        _record_setup(trace, cats, setup, fake_inputs)
        step_begin = len(trace.events)
        params = [p for p in model.parameters() if p.requires_grad]
        with fake_mode:
            opt = make_optimizer(optimizer, params, device)

        after_phase = _phase_marks(model, world, trace, cats, block_of_param, params, opt)

        with eager_masks(inputs), prepared(model, checkpointing, blocks.modules), \
                blocks.marked(trace) if blocks.modules is not None else contextlib.nullcontext(), fake_mode, trace, \
                trace.resizes():
            run_steps(model, fake_inputs, loss_fn, opt, precision, accum, STEPS, collected_at_phases(trace),
                      after_forward=_logits_mark(cats), after_phase=after_phase, backward=trace.backward)
            step_end = len(trace.events)  # what is freed after the last step is not the step's
        del opt, params, fake_inputs, setup
    finally:
        undo()
        if gc_was:
            gc.enable()
    gc.collect()  # frees what cycles held: the trace's events end with every storage's free
    labels: Dict[int, Tuple[str, str]] = {sid: cats.label(sid) for sid in trace.storages}
    owner = {sid: s.owner for sid, s in trace.storages.items()}
    per_block = [trace.block_flops.get(t, 0) // STEPS for t in range(len(blocks.modules or []))]
    return _Traced(trace.events[:step_end], labels, owner, step_begin, trace.flops // STEPS, per_block)


def _record_setup(trace: StorageTrace, cats: _Categories, setup: List[Tuple[torch.Tensor, str, int]],
                  inputs) -> None:
    """The tensors made before the step: the weights and buffers (each with its block), the inputs."""
    for t, kind, block in setup:
        sid = trace.add(t, kind, block)
        cats.kind[sid] = kind
        if kind == "weights":
            trace.weight_ids.add(sid)
            trace.block_of[sid] = block
    for t in [x for x in torch.utils._pytree.tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]:
        cats.kind.setdefault(trace.add(t, "inputs"), "inputs")


def _logits_mark(cats: _Categories) -> Callable:
    """After the forward: the output's logits (an attribute or a key) are the logits category."""
    def after_forward(output):
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        if isinstance(logits, torch.Tensor):
            cats.mark([logits], "logits")
    return after_forward


def _phase_marks(model, world, trace: StorageTrace, cats: _Categories, block_of_param: Dict[int, int], params,
                 opt) -> Callable[[str], None]:
    """After each phase, the categories it settles: the forward's end (with a world, the shards
    FSDP's first forward may have re-padded), the gradients and their blocks, the optimizer's state."""
    def after_phase(phase: str):
        if phase == "forward":
            if world is not None:  # FSDP's first forward may re-pad a rank's shards: the shards now
                for p in model.parameters():
                    if local(p) is p:
                        continue  # not a shard: a parameter gathered whole (the root's, kept to backward)
                    sid = trace.storage_id(p)
                    if sid is not None:
                        cats.kind.setdefault(sid, "weights")
                        trace.weight_ids.add(sid)
                        trace.block_of.setdefault(sid, block_of_param.get(id(p), -1))
            cats.forward_done()
        elif phase == "backward":
            cats.mark([p.grad for p in params if p.grad is not None], "gradients")
            for p in params:
                if p.grad is not None:
                    gsid = trace.storage_id(p.grad)
                    psid = trace.storage_id(p)
                    if gsid is not None and psid is not None:
                        trace.block_of[gsid] = trace.block_of.get(psid, -1)
        elif phase == "optimizer":
            cats.mark([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
                      "optimizer")
    return after_phase


def _materialized_shards(model, fake_mode, blocks: Blocks, block_of_param: Dict[int, int],
                         setup: List[Tuple[torch.Tensor, str, int]]) -> Callable[[], None]:
    """The parallelized copy's tensors made (fake) where they live, as a script's ``to_empty`` after
    ``parallelize`` makes them: each rank's shards. Returns the undo (none: the copy is headroom's)."""
    with fake_mode:
        model.to_empty(device="cpu")
    block_of_param.update(blocks.block_of_parameters())
    seen = set()
    for table, kind in ((model.parameters(), "weights"), (model.buffers(), "buffers")):
        for t in table:
            if id(t) not in seen:
                seen.add(id(t))
                setup.append((local(t), kind, block_of_param.get(id(t), -1)))
    return lambda: None


def _trace_at(blocks: Blocks, indices: List[int], fake: bool, *args, world: World = None) -> _Traced:
    with blocks.shallow(indices):
        return _trace_step(*args, blocks, fake=fake, world=world)


def _span(indices: List[int]) -> str:
    """Block indices as ranges: [0, 1, 2, 25] -> 'blocks 0-2, 25'."""
    runs: List[List[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "blocks " + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _extrapolated(blocks: Blocks, kinds: List[int], shallow: List[int], check: List[int], fake: bool,
                  args: tuple, world: World = None) -> _Traced:
    """The full-depth trace from one of the ``shallow`` blocks (``kinds``: each block's, ends
    included), checked first: the shallow trace expanded to the ``check`` blocks must be their own
    trace, event for event."""
    t = _trace_at(blocks, shallow, fake, *args, world=world)
    shallow_kinds = [kinds[i] for i in shallow]
    to_check = expand(t.events, t.owner, shallow_kinds, [kinds[i] for i in check])[0]  # fails early, untraced
    if not _same_stream(to_check, _trace_at(blocks, check, fake, *args, world=world).events):
        raise CannotExpand(f"{_span(shallow)} repeated to the {len(check)} of the check are not their trace")
    events, source = expand(t.events, t.owner, shallow_kinds, kinds)
    block_flops = [t.block_flops[i] for i in templates(shallow_kinds, kinds)]
    flops = t.flops - sum(t.block_flops) + sum(block_flops)
    return _Traced(events, {new: t.labels[old] for new, old in source.items()}, {}, t.step_begin, flops, block_flops)


def _canonical(events: List[Event]) -> List[tuple]:
    """The stream as peaks and the caching allocator see it: each allocation (size, phase) in
    order, and each run of frees between two allocations as the sorted sizes it frees (their order
    changes neither a peak nor the free blocks a cache holds after the run). Frees of storages the
    stream did not allocate are left out."""
    out: List[tuple] = []
    run: List[Tuple[int, int]] = []
    sizes: Dict[int, int] = {}
    for sid, nbytes, allocated, phase, _ in events:
        if allocated:
            if run:
                out.append(tuple(sorted(run)))
                run = []
            sizes[sid] = nbytes
            out.append((nbytes, phase))
        elif sid in sizes:
            run.append((phase, sizes.pop(sid)))
    if run:
        out.append(tuple(sorted(run)))
    return out


def _same_stream(a: List[Event], b: List[Event]) -> bool:
    """The same allocations in the same order, of the same sizes and phases, with the same frees
    between each two (the storage ids, and the order of frees between two allocations, may differ)."""
    return _canonical(a) == _canonical(b)


def _result(events, labels: Dict[int, Tuple[str, str]], step_begin: int, name: str, params: int, device: str,
            allocator_conf: str) -> Dict[str, Any]:
    label_index: Dict[Tuple[str, str], int] = {}
    label_rows: List[Tuple[str, str, str]] = []
    rows = []
    for sid, nbytes, allocated, phase, _ in events:
        lab = labels[sid]
        i = label_index.get(lab)
        if i is None:
            i = label_index[lab] = len(label_rows)
            label_rows.append((lab[0], lab[1], ""))
        rows.append((sid, nbytes, allocated, phase, i))
    out = json.loads(_core.estimate_trace(name, params, label_rows, rows, list(PHASES), step_begin,
                                          device.startswith("cuda"), allocator_conf))
    out["reserved_bytes"] = out.get("peak_reserved_bytes", 0)
    return out


def _count(model: torch.nn.Module) -> Tuple[int, int]:
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def estimate_model(model: torch.nn.Module, inputs: Any, *, loss_fn=None, optimizer: OptimizerLike = "adamw",
                   precision: str = "fp32", checkpointing: str = "none", device: str = "cpu", accum: int = 1,
                   allocator_conf: str = "", extrapolate: bool = True, world_size: int = 1, rank: int = 0,
                   parallelize: Parallelize = None, mesh_shape=None, mesh_dim_names=None) -> Dict[str, Any]:
    """See :func:`headroom.estimate`. A forward that cannot run on fake tensors (it needs values:
    ``.item()``, data-dependent shapes such as a mixture of experts' routing) is traced on real
    tensors instead, at the depth the repetition allows, and the result says so.

    With ``world_size`` > 1 (or a ``parallelize``): rank ``rank``'s step, ``parallelize(model, mesh)``
    applied to a copy of the model under a fake process group of ``world_size`` ranks (see
    :mod:`headroom.world`); ``inputs`` are that rank's micro-batch."""
    if world_size != 1 or parallelize is not None or rank != 0 or mesh_shape is not None:
        if parallelize is not None and not callable(parallelize):
            raise TypeError(f"parallelize of type {type(parallelize).__name__}: accepted: a function "
                            "(model, mesh) that applies fully_shard / parallelize_module to the model")
        with fake_world(world_size, rank, parallelize, mesh_shape, mesh_dim_names) as world:
            try:
                out = _estimate_model(model, inputs, loss_fn, optimizer, precision, checkpointing, device, accum,
                                      allocator_conf, extrapolate, fake=True, world=world)
            except _NeedsValues as e:
                raise ValueError(f"estimate(world_size={world_size}): {e}; a rank's step is traced on fake tensors "
                                 "only: accepted: a model whose forward runs without reading values") from None
            out["world"] = world.describe()
            return out
    try:
        return _estimate_model(model, inputs, loss_fn, optimizer, precision, checkpointing, device, accum,
                               allocator_conf, extrapolate, fake=True)
    except _NeedsValues as e:
        out = _estimate_model(model, inputs, loss_fn, optimizer, precision, checkpointing, device, accum,
                              allocator_conf, extrapolate, fake=False)
        out["traced"]["method"] = f"real tensors on the cpu ({e})"
        return out


class _NeedsValues(Exception):
    pass


def _prefixed(e: Exception, what: str, after: str = "") -> Exception:
    """The model's own error, of its own type where that can be made, said with what headroom was doing
    (and, ``after`` it, a known cause)."""
    try:
        return type(e)(what + str(e) + after)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        return RuntimeError(what + f"{type(e).__name__}: {e}" + after)


def _known_cause(e: Exception, model) -> str:
    """What is known to cause the model's error: on torch 2.15 selective checkpointing's recompute
    replays the forward's decisions, and a KV cache filled in the forward makes it differ."""
    if "not found in storage" in str(e) and getattr(getattr(model, "config", None), "use_cache", False):
        return ("; the model's config has use_cache=True: the KV cache its forward fills makes selective "
                "checkpointing's recompute differ from that forward (torch 2.15 replays it strictly); set "
                "model.config.use_cache = False for training")
    return ""


def _estimate_model(model, inputs, loss_fn, optimizer, precision, checkpointing, device, accum, allocator_conf,
                    extrapolate, fake, world: World = None) -> Dict[str, Any]:
    check_settings(precision, checkpointing, optimizer, accum)
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device '{device}': accepted: cpu, cuda")
    blocks = Blocks(model)
    total, trainable = _count(model)
    name = type(model).__name__
    # Micro-batches after the second allocate as the second does (it finds the first's gradients):
    # two are traced, and the FLOPs scaled to all of them.
    traced_accum = min(accum, 2)
    whole = lambda: _trace_step(model, inputs, loss_fn, optimizer, precision, checkpointing, device, traced_accum,
                                blocks, fake=fake, world=world)
    note = "no repeated blocks: traced whole"
    traced_depth = blocks.depth
    try:
        if blocks.modules is None:
            t = whole()
        else:
            stack = (f"{blocks.depth} identical blocks" if blocks.kinds == 1 else
                     f"{blocks.depth} blocks of {blocks.kinds} kinds") + f" in {blocks.name}"
            t, why = None, "asked" if not extrapolate else "no shorter stack holds every block's neighbours"
            for ends in ((False, False), (True, False), (True, True)) if extrapolate else ():
                eff = with_ends(blocks.kind_of, *ends)
                shallow = choose(eff, blocks.kind_of)
                check = choose(eff, blocks.kind_of, longer_than=len(shallow)) if shallow else None
                if check is None:
                    if shallow:
                        why = f"a stack of {len(shallow)} and its check would trace as many blocks as the model has"
                    continue
                try:
                    t = _extrapolated(blocks, eff, shallow, check, fake, (model, inputs, loss_fn, optimizer, precision,
                                                                          checkpointing, device, traced_accum), world)
                except CannotExpand as e:
                    why = str(e)
                    continue
                traced_depth = len(shallow)
                note = f"{stack}: traced {_span(shallow)} (and {_span(check)} to check), repeated to {blocks.depth}"
                break
            if t is None:
                t = whole()
                note = f"{stack}: traced at full depth ({why})"
    except (UsageError, ParallelizeError):
        raise
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as e:
        if not fake:
            raise
        raise _NeedsValues(f"{getattr(e, 'func', None) or type(e).__name__} needs values") from e
    except Exception as e:  # noqa: BLE001 - the model's own error, said with what headroom was doing
        raise _prefixed(e, f"headroom.estimate: tracing {name}'s training step on "
                           f"{'fake' if fake else 'real'} tensors: ", _known_cause(e, model)) from e
    events, labels, step_begin, flops = t.events, t.labels, t.step_begin, t.flops * accum // traced_accum
    out = _result(events, labels, step_begin, name, total, device, allocator_conf)
    out["flops_per_step"] = int(flops)  # forward and backward (with recompute) of the accum micro-batches
    out["model"]["trainable_params"] = trainable
    out["traced"] = {"method": "fake tensors", "blocks": blocks.name, "depth": blocks.depth,
                     "traced_depth": traced_depth, "kinds": blocks.kinds,
                     "extrapolated": traced_depth != blocks.depth, "note": note}
    out["settings"] = {"precision": precision, "checkpointing": checkpointing, "device": device, "accum": accum,
                       "optimizer": optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "callable")}
    return out


def _real_inputs(inputs: Any) -> Any:
    def real(x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            return torch.zeros(x.shape, dtype=x.dtype)
        return x.detach().clone().requires_grad_(x.requires_grad)

    return _map_inputs(inputs, real)
