"""Measure the model the user has: the training step :mod:`headroom.anymodel` estimates, run for
real on the cpu on a copy of the model (meta weights become seeded random ones), under headroom's
counting allocator. It resets the counting allocator's peak, which a :class:`headroom.Monitor`
phase open around it would see.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch

from . import _core
from .anymodel import STEPS, _count, _prefixed, _real_inputs, _swap_tensors
from .blocks import Blocks
from .step import OptimizerLike, UsageError, check_settings, make_optimizer, prepared, run_steps
from .trace import PHASES


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
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _prefixed(e, f"headroom.measure: running {type(model).__name__}'s training step on the cpu: ") from e
    finally:
        del opt, params, clone, real_inputs
    return {"model": {"name": type(model).__name__, "params": total, "trainable_params": trainable},
            "peak_bytes": state["peak"], "peak_phase": state["peak_phase"], "phases": phases,
            "measured": {"method": "cpu counting allocator", "steps": STEPS}}
