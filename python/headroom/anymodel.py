"""Estimate and measure the model the user has: any ``torch.nn.Module``.

:func:`estimate_model` runs the user's own training step on fake tensors (``FakeTensorMode``:
shapes, dtypes and aliasing without data) under :class:`headroom.trace.StorageTrace`, which
records every storage allocated and freed with its phase; the model's repeated blocks are traced at
a depth of three and repeated to the full depth (:mod:`headroom.blocks`). The C++ core turns the
trace into the estimate every other path returns, and replays it through the caching allocator's
policy for the bytes a card would reserve.

:func:`measure_model` runs the same step for real on the cpu, under headroom's counting allocator:
the measured truth beside the estimate, and the fallback for a model that cannot run on fake tensors.

The user's model is borrowed, not changed: its parameters and buffers are swapped for fake (or, for
measure, copied) ones for the duration, hooks are removed and modes restored, also on error.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import json
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._pytree import tree_map

from . import _core
from .blocks import TRACED_DEPTH, Blocks, CannotExpand, expand
from .step import OptimizerLike, check_settings, make_optimizer, prepared, run_steps
from .trace import PHASES, StorageTrace

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
    return tree_map(lambda x: make(x) if isinstance(x, torch.Tensor) else x, inputs)


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
            if s.phase == "forward":
                self.kind.setdefault(sid, "activations")

    def label(self, sid: int) -> Tuple[str, str]:
        s = self.trace.storages[sid]
        kind = self.kind.get(sid)
        if kind is None:
            kind = "weight_copies" if s.op == "weight copy" else "temporaries"
        if kind in ("weights", "gradients", "optimizer", "weight_copies", "logits"):
            return kind, kind
        if kind in ("buffers", "inputs"):
            return kind, "other"
        return f"{kind}: {s.op}", kind


def _collected(on_phase: Callable[[str], None]) -> Callable[[str], None]:
    """Python's cycle collector runs when it likes, and what it frees (a checkpoint's reference
    cycles) would land anywhere in the trace: with it paused, cycles are collected as each phase
    begins, the same way in every block and every run."""
    def phase(name: str) -> None:
        gc.collect()
        on_phase(name)

    return phase


def _trace_step(model, inputs, loss_fn, optimizer, precision, checkpointing, device, accum, blocks: Blocks):
    """The step's trace on fake tensors: (events, labels, owner by storage, step_begin, trainable)."""
    fake_mode = FakeTensorMode()
    trace = StorageTrace()
    cats = _Categories(trace)
    block_of_param = blocks.block_of_parameters()
    setup: List[Tuple[torch.Tensor, str, int]] = []

    def make(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        with fake_mode:
            fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=_floating_dtype(t, precision), device="cpu")
            if is_param:
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
        setup.append((fake, "weights" if is_param else "buffers", block_of_param.get(id(t), -1)))
        return fake

    undo = _swap_tensors(model, make)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        with fake_mode:
            fake_inputs = _map_inputs(inputs, lambda x: torch.empty_strided(tuple(x.shape), tuple(x.stride()),
                                                                             dtype=x.dtype, device="cpu"))
        for t, kind, block in setup:
            sid = trace.add(t, kind, block)
            cats.kind[sid] = kind
            if kind == "weights":
                trace.weight_ids.add(sid)
                trace.block_of[sid] = block
        for t in [x for x in torch.utils._pytree.tree_flatten(fake_inputs)[0] if isinstance(x, torch.Tensor)]:
            cats.kind.setdefault(trace.add(t, "inputs"), "inputs")
        step_begin = len(trace.events)
        params = [p for p in model.parameters() if p.requires_grad]
        with fake_mode:
            opt = make_optimizer(optimizer, params, device)

        def after_forward(output):
            logits = getattr(output, "logits", None)
            if logits is None and isinstance(output, dict):
                logits = output.get("logits")
            if isinstance(logits, torch.Tensor):
                cats.mark([logits], "logits")

        def after_phase(phase: str):
            if phase == "forward":
                cats.forward_done()
            elif phase == "backward":
                grads = [p.grad for p in params if p.grad is not None]
                cats.mark(grads, "gradients")
                for p in params:
                    if p.grad is not None:
                        gsid = trace.storage_id(p.grad)
                        psid = trace.storage_id(p)
                        if gsid is not None and psid is not None:
                            trace.block_of[gsid] = trace.block_of.get(psid, -1)
            elif phase == "optimizer":
                cats.mark([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)],
                          "optimizer")

        flops = FlopCounterMode(display=False)
        with prepared(model, checkpointing, blocks.modules), blocks.marked(trace) if blocks.modules is not None \
                else contextlib.nullcontext(), fake_mode, flops, trace:
            run_steps(model, fake_inputs, loss_fn, opt, precision, accum, STEPS, _collected(trace.set_phase),
                      after_forward=after_forward, after_phase=after_phase)
            step_end = len(trace.events)  # what is freed after the last step is not the step's
        del opt, params, fake_inputs, setup
    finally:
        undo()
        if gc_was:
            gc.enable()
    gc.collect()  # frees what cycles held: the trace's events end with every storage's free
    labels: Dict[int, Tuple[str, str]] = {sid: cats.label(sid) for sid in trace.storages}
    owner = {sid: s.owner for sid, s in trace.storages.items()}
    return trace.events[:step_end], labels, owner, step_begin, flops.get_total_flops() // STEPS


def _trace_at(blocks: Blocks, depth: int, *args):
    with blocks.shallow(depth):
        return _trace_step(*args, blocks)


def _same_stream(a, b) -> bool:
    """The same allocations and frees, in the same order, of the same sizes and phases, with the
    same live bytes after each (the storage ids may differ)."""
    if len(a) != len(b):
        return False
    live_a, live_b, sizes_a, sizes_b = 0, 0, {}, {}
    for x, y in zip(a, b):
        if x[1:4] != y[1:4]:
            return False
        for e, sizes in ((x, sizes_a), (y, sizes_b)):
            if e[2]:
                sizes[e[0]] = e[1]
        live_a += x[1] if x[2] else -sizes_a.pop(x[0], 0)
        live_b += y[1] if y[2] else -sizes_b.pop(y[0], 0)
        if live_a != live_b:
            return False
    return True


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
                   allocator_conf: str = "", extrapolate: bool = True) -> Dict[str, Any]:
    check_settings(precision, checkpointing, optimizer, accum)
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device '{device}': accepted: cpu, cuda")
    blocks = Blocks(model)
    total, trainable = _count(model)
    name = type(model).__name__
    traced = blocks.depth
    note = "no repeated blocks: traced whole"
    if blocks.modules is not None:
        note = f"{blocks.depth} blocks in {blocks.name}: traced at full depth"
        if not blocks.identical:
            note = f"{blocks.depth} blocks in {blocks.name} of {blocks.kinds} kinds: traced at full depth"
    try:
        if extrapolate and blocks.can_extrapolate():
            trace_at = lambda depth: _trace_at(blocks, depth, model, inputs, loss_fn, optimizer, precision,
                                               checkpointing, device, accum)
            events, labels, owner, step_begin, shallow_flops = trace_at(TRACED_DEPTH)
            try:
                # The repetition is checked where it can be: three blocks repeated to four must be
                # the trace of four, event for event, or the model is traced whole.
                check = trace_at(TRACED_DEPTH + 1)
                if not _same_stream(expand(events, owner, TRACED_DEPTH, TRACED_DEPTH + 1)[0], check[0]):
                    raise CannotExpand(f"{TRACED_DEPTH} blocks repeated to {TRACED_DEPTH + 1} are not the trace of "
                                       f"{TRACED_DEPTH + 1}")
                events, source = expand(events, owner, TRACED_DEPTH, blocks.depth)
                labels = {new: labels[old] for new, old in source.items()}
                traced = TRACED_DEPTH
                flops = shallow_flops + (blocks.depth - TRACED_DEPTH) * (check[4] - shallow_flops)
                note = (f"{blocks.depth} identical blocks in {blocks.name}: traced at {TRACED_DEPTH} (and "
                        f"{TRACED_DEPTH + 1} to check), repeated to {blocks.depth}")
            except CannotExpand as why:
                events, labels, owner, step_begin, flops = _trace_step(model, inputs, loss_fn, optimizer, precision,
                                                                       checkpointing, device, accum, blocks)
                note = f"{blocks.depth} blocks in {blocks.name}: traced at full depth ({why})"
        else:
            events, labels, owner, step_begin, flops = _trace_step(model, inputs, loss_fn, optimizer, precision,
                                                                   checkpointing, device, accum, blocks)
    except (ValueError, TypeError):
        raise
    except Exception as e:  # noqa: BLE001 - the model's own error, said with what headroom was doing
        raise type(e)(f"headroom.estimate: tracing {name}'s training step on fake tensors: {e}") from e
    out = _result(events, labels, step_begin, name, total, device, allocator_conf)
    out["flops_per_step"] = int(flops)  # forward and backward (with recompute) of the accum micro-batches
    out["model"]["trainable_params"] = trainable
    out["traced"] = {"method": "fake tensors", "blocks": blocks.name, "depth": blocks.depth, "traced_depth": traced,
                     "extrapolated": traced != blocks.depth, "note": note}
    out["settings"] = {"precision": precision, "checkpointing": checkpointing, "device": device, "accum": accum,
                       "optimizer": optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "callable")}
    return out


# --- measure: the same step, for real ----------------------------------------------------------------

def _materialize(model: torch.nn.Module, precision: str, generator: torch.Generator) -> torch.nn.Module:
    """A real copy of ``model`` on the cpu (meta tensors get seeded random values)."""
    clone = copy.deepcopy(model)  # keeps shared (tied) tensors shared

    def real(t: torch.Tensor, is_param: bool) -> torch.Tensor:
        if not t.is_meta:
            return t
        with torch.no_grad():
            r = torch.empty(t.shape, dtype=t.dtype)
            if r.is_floating_point():
                r.normal_(0.0, 0.02, generator=generator) if is_param else r.uniform_(0.0, 1.0, generator=generator)
            else:
                r.zero_()
        return torch.nn.Parameter(r, requires_grad=t.requires_grad) if is_param else r

    _swap_tensors(clone, real)  # the clone's own tensors: nothing to undo
    if precision == "bf16":
        clone = clone.to(torch.bfloat16)
    return clone


def _real_inputs(inputs: Any) -> Any:
    def real(x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            return torch.zeros(x.shape, dtype=x.dtype)
        return x.detach().clone().requires_grad_(x.requires_grad)

    return _map_inputs(inputs, real)


def measure_model(model: torch.nn.Module, inputs: Any, *, loss_fn=None, optimizer: OptimizerLike = "adamw",
                  precision: str = "fp32", checkpointing: str = "none", accum: int = 1, seed: int = 0) -> Dict[str, Any]:
    """Two real training steps on the cpu of a copy of ``model``; the counting allocator's peaks."""
    check_settings(precision, checkpointing, optimizer, accum)
    torch.manual_seed(seed)
    base = _core.cpu_live_bytes()
    total, trainable = _count(model)
    clone = _materialize(model, precision, torch.Generator().manual_seed(seed))
    real_inputs = _real_inputs(inputs)
    params = [p for p in clone.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, "cpu")
    phases: Dict[str, int] = {p: 0 for p in PHASES[1:]}
    state = {"phase": "idle", "peak": 0, "peak_phase": "idle"}

    def close():
        peak = _core.cpu_peak_bytes() - base
        ph = state["phase"]
        if ph != "idle":
            phases[ph] = max(phases[ph], peak)
        if peak > state["peak"]:
            state["peak"], state["peak_phase"] = peak, ph

    def on_phase(phase: str):
        close()
        state["phase"] = phase
        _core.reset_cpu_peak()
        if phase != "idle":
            phases[phase] = max(phases[phase], _core.cpu_live_bytes() - base)

    blocks = Blocks(clone)
    try:
        with prepared(clone, checkpointing, blocks.modules):
            _core.reset_cpu_peak()
            run_steps(clone, real_inputs, loss_fn, opt, precision, accum, STEPS, on_phase)
        close()
    except torch.OutOfMemoryError:
        raise
    except (ValueError, TypeError):
        raise
    except Exception as e:  # noqa: BLE001
        raise type(e)(f"headroom.measure: running {type(model).__name__}'s training step on the cpu: {e}") from e
    finally:
        del opt, params, clone, real_inputs
    return {"model": {"name": type(model).__name__, "params": total, "trainable_params": trainable},
            "peak_bytes": state["peak"], "peak_phase": state["peak_phase"], "phases": phases,
            "measured": {"method": "cpu counting allocator", "steps": STEPS}}
