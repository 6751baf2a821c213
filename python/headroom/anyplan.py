"""Plan any model: the fastest way to train it within a budget, through its traced estimate.

The search runs over precision x checkpointing x optimizer x micro-batch (the accumulation follows
from the global batch). For each of the first three, the micro-batches that divide the global batch
are tried by bisection (a larger micro-batch never needs less memory), each by
:func:`headroom.anymodel.estimate_model` with its accumulation (the second micro-batch finds the
first's gradients). Step time is the traced FLOPs of the step — forward, backward and the
recompute of checkpointing, by torch's FLOP table — at a
rate per precision: on cuda bf16 and fp16 run at twice fp32's (tensor cores), on cpu at fp32's; no
fixed cost per micro-batch is assumed, so ties go to fewer micro-batches, then to the smaller peak.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from .anymodel import estimate_model
from .plans import Plan, PlanResult
from .step import OptimizerLike


def scaled_inputs(inputs: Any, batch: int) -> Any:
    """``inputs`` with the batch dimension (the first, of the size most tensors share) at ``batch``,
    as meta tensors (the estimate needs only their shapes)."""
    tensors = [t for t in torch.utils._pytree.tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        raise ValueError("plan(model, inputs): no tensor in inputs has a batch dimension; pass inputs_fn=lambda batch: ...")
    sizes = [t.shape[0] for t in tensors]
    base = max(set(sizes), key=sizes.count)

    def scale(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != base:
            return t
        return torch.empty((batch,) + tuple(t.shape[1:]), dtype=t.dtype, device="meta")

    return torch.utils._pytree.tree_map(scale, inputs)


def _rate(precision: str, device: str) -> float:
    return 2.0 if device.startswith("cuda") and precision != "fp32" else 1.0


def plan_model(model: torch.nn.Module, inputs: Any = None, *, budget: Union[int, str], global_batch: int,
               inputs_fn: Optional[Callable[[int], Any]] = None, loss_fn=None, optimizer: OptimizerLike = "adamw",
               precisions: Sequence[str] = ("fp32", "bf16-mixed"), checkpointing: Sequence[str] = ("none", "full"),
               optimizers: Optional[Sequence[OptimizerLike]] = None, device: str = "cpu", margin: float = 0.05,
               progress: Optional[Callable[[str], None]] = None) -> PlanResult:
    from . import parse_size

    limit_bytes = parse_size(budget)
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch {global_batch!r}: accepted: a positive number of samples")
    if inputs is None and inputs_fn is None:
        raise ValueError("plan(model, ...): pass inputs (their batch dimension is scaled) or inputs_fn(batch)")
    if not 0 <= margin < 1:
        raise ValueError(f"margin {margin}: accepted: a fraction in [0, 1)")
    make = inputs_fn or (lambda b: scaled_inputs(inputs, b))
    limit = int(limit_bytes * (1 - margin))
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    plans: List[Dict[str, Any]] = []
    considered = 0
    smallest: Optional[Dict[str, Any]] = None
    for opt in (optimizers or [optimizer]):
        for precision in precisions:
            for ckpt in checkpointing:
                def at(micro: int) -> Dict[str, Any]:
                    nonlocal considered, smallest
                    considered += 1
                    if progress:
                        progress(f"estimating {precision}, checkpointing {ckpt}, micro-batch {micro}")
                    e = estimate_model(model, make(micro), loss_fn=loss_fn, optimizer=opt, precision=precision,
                                       checkpointing=ckpt, device=device, accum=global_batch // micro)
                    if smallest is None or e["peak_bytes"] < smallest["bytes"]:
                        smallest = {"bytes": e["peak_bytes"], "plan": f"{precision}, checkpointing {ckpt}, micro {micro}"}
                    return e

                lo, hi, best = 0, len(divisors) - 1, None
                while lo <= hi:  # the largest micro-batch that fits
                    mid = (lo + hi) // 2
                    e = at(divisors[mid])
                    if e["peak_bytes"] <= limit:
                        best, lo = (divisors[mid], e), mid + 1
                    else:
                        hi = mid - 1
                if best is None:
                    continue
                micro, e = best
                accum = global_batch // micro
                plans.append({
                    "batch": micro, "accum": accum, "precision": precision, "checkpointing": ckpt,
                    "optimizer": opt if isinstance(opt, str) else getattr(opt, "__name__", "callable"),
                    "attention": "flash", "shard": "none", "world_size": 1,
                    "predicted_peak_bytes": e["peak_bytes"], "predicted_reserved_bytes": e["reserved_bytes"],
                    "flops_per_step": e["flops_per_step"],
                    "_time": e["flops_per_step"] / _rate(precision, device),
                })
    plans.sort(key=lambda p: (p["_time"], p["accum"], p["predicted_peak_bytes"]))
    fastest = plans[0]["_time"] if plans else 1.0
    for p in plans:
        p["predicted_step_time_ratio"] = round(p.pop("_time") / fastest, 4) if fastest else 1.0
    result = {"plans": [Plan(p) for p in plans], "considered": considered, "global_batch": global_batch,
              "budget_bytes": limit_bytes, "cost_model": "traced FLOPs; bf16/fp16 at 2x fp32 on cuda"}
    if not plans:
        result["smallest_peak"] = smallest
    return PlanResult(result)
