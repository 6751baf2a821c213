"""headroom in transformers' ``Trainer``: where each optimizer step's memory goes, and the leak verdict.

::

    from headroom.integrations.transformers import HeadroomCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[HeadroomCallback()])
    trainer.train()   # log_history, TensorBoard, W&B... gain headroom/* every step

Every ``every`` optimizer steps it logs, through the Trainer's own ``log`` (so the values reach
``state.log_history`` and every reporting integration):

* ``headroom/peak_bytes``, ``headroom/live_bytes`` (after the step), ``headroom/reserved_bytes``
  (cuda: the caching allocator's, at the step's end);
* ``headroom/forward_peak_bytes``, ``headroom/backward_peak_bytes``, ``headroom/optimizer_peak_bytes``;
* ``headroom/weights_bytes``, ``headroom/gradients_bytes``, ``headroom/optimizer_bytes``,
  ``headroom/activations_bytes``: the step's peak by category;
* ``headroom/oom_recoveries``.

The figures are a :class:`headroom.Monitor`'s over the model and the Trainer's optimizer, with the
step's phases marked from the Trainer's events: forward from the model's forward pre-hook to its
forward hook (the loss, computed inside a transformers model's forward, included), backward from
there to the end of the micro-batch (the gradient norm the Trainer computes included), optimizer
around ``optimizer.step()``, zero_grad from there to the step's end (the learning-rate schedule and
``model.zero_grad()``), and data from the end of one step to the start of the next (what the Trainer
does between steps, the next batches' collation, logging, evaluation and saving, included). On the
cpu the bytes are headroom's counting allocator's (``import headroom`` before building the model);
on cuda, PyTorch's caching allocator's.

When training ends it logs ``headroom/leak_bytes_per_step`` and ``headroom/leak_detected`` and
writes the verdict, with where the allocations that survived their step were made (cpu: the Python
line), to the ``headroom`` logger (a warning when a leak is found).

What of the Trainer this touches beyond the ``TrainerCallback`` interface: the Trainer object
itself, found on the call stack when an event first reaches the callback (a callback is not given
it), for ``Trainer.log``. Tested with transformers 5.24.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, Optional

import torch
from transformers import Trainer, TrainerCallback

from ..monitor import Monitor

__all__ = ["HeadroomCallback"]

_log = logging.getLogger("headroom")


def _find_trainer() -> Optional[Trainer]:
    """The Trainer whose event is being handled: the nearest frame of one of its methods."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


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


class HeadroomCallback(TrainerCallback):
    """``Trainer(..., callbacks=[HeadroomCallback()])``: headroom's per-step memory figures in the
    Trainer's logs, and the leak verdict at the end (see the module's documentation).

    ``every``: log every this many optimizer steps (each step is measured). ``leak``: judge leaks
    when training ends and record, on the cpu, the Python line of each allocation (a few
    microseconds each). ``guard``: keep the run alive on out-of-memory — not built yet; ``True`` is
    refused rather than ignored.
    """

    def __init__(self, guard: bool = False, leak: bool = True, every: int = 1):
        if guard:
            raise NotImplementedError("HeadroomCallback(guard=True): not built yet; accepted: guard=False")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: accepted: a whole number of optimizer steps, 1 or more")
        self.every = every
        self.leak = leak
        self.monitor: Optional[Monitor] = None
        self.steps: list = []  # each step's Monitor record
        self.verdict: Optional[Dict[str, Any]] = None
        self._trainer: Optional[Trainer] = None
        self._phase: Optional[str] = None
        self._in_step = False
        self._hooks: list = []

    # Phases: at most one open at a time.
    def _enter(self, name: str) -> None:
        self._exit()
        self.monitor._core.enter(name)
        self._phase = name

    def _exit(self) -> None:
        if self._phase is not None:
            self.monitor._core.exit()
            self._phase = None

    def _log(self, values: Dict[str, Any]) -> None:
        if self._trainer is None:
            self._trainer = _find_trainer()
        if self._trainer is None:
            raise RuntimeError("HeadroomCallback: no transformers Trainer on the call stack to log through")
        self._trainer.log(values)

    def on_init_end(self, args, state, control, **kwargs):
        self._trainer = _find_trainer()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._trainer is None:
            self._trainer = _find_trainer()
        device = next(model.parameters()).device
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the real one
        self.monitor = Monitor(device, model=model, optimizer=optimizer, python_frames=self.leak)
        self.steps = []
        self.verdict = None

        def before_forward(module, args_):
            if self._in_step and module.training:
                self._enter("forward")

        def after_forward(module, args_, output):
            if self._in_step and module.training:
                self._enter("backward")

        self._hooks = [model.register_forward_pre_hook(before_forward), model.register_forward_hook(after_forward)]
        self._enter("data")

    def on_step_begin(self, args, state, control, **kwargs):
        self._exit()
        self._in_step = True

    def on_substep_end(self, args, state, control, **kwargs):
        self._exit()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._in_step = False
        self._enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._enter("zero_grad")

    def on_step_end(self, args, state, control, **kwargs):
        self._exit()
        record = self.monitor.end_step(batch=args.per_device_train_batch_size, accum=args.gradient_accumulation_steps)
        self.steps.append(record)
        if state.global_step % self.every == 0:
            self._log(step_metrics(record))
        self._enter("data")

    def on_train_end(self, args, state, control, **kwargs):
        self._exit()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.monitor is None:
            return
        if self.leak:
            self.verdict = self.monitor.leak()
            self._log({"headroom/leak_bytes_per_step": self.verdict["bytes_per_step"],
                       "headroom/leak_detected": bool(self.verdict["detected"])})
            lines = [f"headroom: {'leak' if self.verdict['detected'] else 'no leak'}: {self.verdict['reason']}"]
            lines += [f"  {site['description']}" for site in self.verdict["sites"][:10]]
            (_log.warning if self.verdict["detected"] else _log.info)("\n".join(lines))
        self.monitor.close()
        self.monitor = None
