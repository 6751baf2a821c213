"""What the trainer callbacks share: the headroom/* values of a step, the phase marks on a Monitor,
the leak verdict's report, and the plan an out-of-memory error is answered with."""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import torch

from .. import _core, format_bytes
from ..monitor import Monitor

_log = logging.getLogger("headroom")


def checked_every(every: Any) -> int:
    """The callbacks' ``every=``: a whole number of optimizer steps, 1 or more."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r}: accepted: a whole number of optimizer steps, 1 or more")
    return every


def transformers_model(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The first transformers model in ``module`` (itself included): one with a ``config`` that has
    ``to_dict``; ``None`` when there is none."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            return sub
    return None


def optimizer_name(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """headroom's name for ``optimizer``'s update, or None when it does not model that one."""
    kind = type(optimizer).__name__
    if kind == "SGD":
        return "momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    return {"AdamW": "adamw", "Adam": "adam", "Adagrad": "adagrad", "Adafactor": "adafactor"}.get(kind)


# lightning.Trainer(precision=...) -> headroom's precision; the others it does not model.
LIGHTNING_PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16",
                        "16-mixed": "fp16-mixed"}


def step_metrics(record: Dict[str, Any]) -> Dict[str, Any]:
    """The ``headroom/*`` values of one step's :meth:`Monitor.end_step` record."""
    phases = record.get("phases", {})
    out: Dict[str, Any] = {
        "headroom/peak_bytes": record["peak_bytes"],
        "headroom/live_bytes": record["live_bytes"],
    }
    if "reserved_bytes" in record:
        out["headroom/reserved_bytes"] = record["reserved_bytes"]
    for phase in ("forward", "backward", "optimizer"):
        out[f"headroom/{phase}_peak_bytes"] = phases.get(phase, {}).get("peak", 0)
    at_peak = phases.get(record.get("peak_phase", ""), {}).get("breakdown", {})
    for category in ("weights", "gradients", "optimizer", "activations"):
        out[f"headroom/{category}_bytes"] = at_peak.get(category, 0)
    out["headroom/oom_recoveries"] = record.get("oom_recoveries", 0)
    return out


class PhaseMarks:
    """The phases of a Monitor's step as a trainer's events mark them: at most one open at a time,
    each entered closing the one before."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor
        self.current: Optional[str] = None

    def enter(self, name: str) -> None:
        self.exit()
        self.monitor._core.enter(name)
        self.current = name

    def exit(self) -> None:
        if self.current is not None:
            self.monitor._core.exit()
            self.current = None

    def abort_step(self) -> None:
        """The step in flight is dropped (it runs again), with the phase open in it."""
        self.current = None
        self.monitor.abort_step()


def report_leak(verdict: Dict[str, Any]) -> None:
    """The verdict and its first sites on the ``headroom`` logger: a warning when a leak is found."""
    lines = [f"headroom: {'leak' if verdict['detected'] else 'no leak'}: {verdict['reason']}"]
    lines += [f"  {site['description']}" for site in verdict["sites"][:10]]
    (_log.warning if verdict["detected"] else _log.info)("\n".join(lines))


def oom_lines(step: int, phase: Optional[str], micro: int, accum: int, failure: str, steps: list) -> list:
    """The first lines of what an out-of-memory error that ends a run says: where it happened, and
    the last complete step's peak by category."""
    lines = [f"headroom: step {step} ran out of memory in {phase or 'the step'} with micro-batch {micro} x {accum} "
             f"accumulated: {failure}"]
    if steps:
        m = step_metrics(steps[-1])
        lines.append(
            "  the last step that ran: peak {} = weights {} + gradients {} + optimizer state {} + activations {} "
            "(+ other)".format(*(format_bytes(m[f"headroom/{k}"]) for k in
                                 ("peak_bytes", "weights_bytes", "gradients_bytes", "optimizer_bytes",
                                  "activations_bytes"))))
    return lines


def fitting_plan(model: torch.nn.Module, config: Any, *, global_batch: int, seq: int, precision: str,
                 optimizer: str, render: Callable[[Any], str]) -> str:
    """A line giving a plan that fits this device (cuda: the card's memory; cpu: the
    :func:`headroom.cpu_budget`) for ``global_batch`` sequences of ``seq`` tokens a step, its settings
    written by ``render(plan)``; or why there is none (no budget, a model headroom cannot plan)."""
    from ..predict import plan

    try:
        if config is None or not hasattr(config, "to_dict"):
            return "no plan: the model has no transformers config for headroom to plan from"
        param = next(model.parameters())
        if param.is_cuda:
            budget = torch.cuda.get_device_properties(param.device).total_memory
            where = "cuda"
        else:
            budget = _core.cpu_budget()
            where = "cpu"
            if budget is None:
                return "no plan: no headroom.cpu_budget is set, so the cpu has no size to plan for"
        result = plan(config.to_dict(), global_batch=global_batch, budget=budget, seq=seq, precision=precision,
                      optimizer=optimizer, device=where)
    except Exception as e:  # noqa: BLE001 - a model headroom cannot plan: say so, keep the OOM's own error
        return f"no plan: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    best = result.best
    if best is None:
        return f"no plan fits {format_bytes(budget)} for {global_batch} sequences of {seq} tokens a step"
    return (f"a plan that fits {format_bytes(budget)} (predicted peak {format_bytes(best['predicted_peak_bytes'])}): "
            + render(best))
