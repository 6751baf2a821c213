"""headroom in Lightning: where each optimizer step's memory goes, and the leak verdict.

::

    from headroom.integrations.lightning import HeadroomCallback
    trainer = lightning.Trainer(callbacks=[HeadroomCallback()], log_every_n_steps=1)
    trainer.fit(module, loader)   # every logger gains headroom/* each optimizer step

Every ``every`` optimizer steps it logs, through ``pl_module.log`` (so the values reach every logger
the Trainer has), the same keys as :mod:`headroom.integrations.transformers`: ``headroom/peak_bytes``,
``headroom/live_bytes``, ``headroom/reserved_bytes`` (cuda), ``headroom/forward_peak_bytes``,
``headroom/backward_peak_bytes``, ``headroom/optimizer_peak_bytes``, ``headroom/weights_bytes``,
``headroom/gradients_bytes``, ``headroom/optimizer_bytes``, ``headroom/activations_bytes`` (the
step's peak by category) and ``headroom/oom_recoveries``. ``pl_module.log`` stores them as float32
tensors: a figure above 16 MiB is rounded to 24 significant bits (1.3 GB to 128 bytes).

The figures are a :class:`headroom.Monitor`'s over the LightningModule's parameters and its first
optimizer, with the phases marked from Lightning's hooks (automatic optimization): forward from
``on_train_batch_start`` (``training_step`` follows), zero_grad from ``on_before_zero_grad`` (Lightning
zeroes the gradients after the first micro-batch's ``training_step`` of each step), backward from
``on_before_backward`` to ``on_after_backward``, optimizer from ``on_before_optimizer_step`` to the
batch's end, and data from the end of one batch to the start of the next (the next batch's loading
and transfer included). A step ends with the batch whose optimizer step ran.

When training ends the leak verdict goes to every logger (``headroom/leak_bytes_per_step``,
``headroom/leak_detected``: ``pl_module.log`` is not allowed there) and to the ``headroom`` logger,
with where the allocations that survived their step were made (cpu: the Python line).

``guard=True`` keeps the run alive at the same effective batch, by headroom's guard's rules
(:mod:`headroom.guard`): ``training_step`` runs its own backward, and when a micro-batch's forward or
backward runs out of memory, the update's gradients are dropped and its micro-batches so far run
again, each split in halves (halved again while that fails, down to one row), every part's loss
weighted by its share of the rows; the smaller micro-batch is kept for the later steps and
``headroom/oom_recoveries`` counts the splits. The optimizer sees the same rows per update, the
loss Lightning logs is the whole micro-batch's, and the schedule is unchanged. A failure in the
optimizer's update, or with one row, ends the run as it would have. Dropout draws other masks for
the halves than for the whole, and what ``training_step`` logs with ``self.log`` is the last part's.
It needs automatic optimization on one device.

An out-of-memory error that ends the run (``guard=False``, or one row already) is explained on the
``headroom`` logger: the step, the phase and the micro-batch it failed in, the last complete step's
peak by category, and a plan that fits the device (cuda: the card's memory; cpu: the
:func:`headroom.cpu_budget`) for the same effective batch, as ``lightning.Trainer`` arguments and
the module's settings (:meth:`headroom.Plan.lightning_trainer_kwargs`, from the config of the
transformers model the module holds; a module headroom cannot plan is said so).

What of Lightning this touches beyond the ``Callback`` interface, under ``guard=True`` and for the
run only: the module's ``training_step`` and ``optimizer_zero_grad``, wrapped on the instance (both
public hooks a module may override; the zeroing Lightning does after the first micro-batch's
``training_step`` runs before it instead), and ``trainer.precision_plugin.scaler`` (16-mixed's loss
scaling) for the backward ``training_step`` runs. Lightning's own backward then runs on a detached
copy of the loss, with its ``on_before_backward``/``on_after_backward`` hooks as before. Tested with
lightning 2.6.
"""
from __future__ import annotations

import collections.abc
import gc
import logging
from typing import Any, Dict, Optional

import lightning
import torch

from .. import _core
from ..guard import _rows, _rows_of
from ..monitor import Monitor
from ._common import (LIGHTNING_PRECISIONS, PhaseMarks, checked_every, fitting_plan, oom_lines, optimizer_name,
                      report_leak, step_metrics, transformers_model)
from ._find_batch import FindBatch

__all__ = ["FindBatch", "HeadroomCallback"]

_log = logging.getLogger("headroom")

def _loss_of(output: Any) -> Optional[torch.Tensor]:
    return output.get("loss") if isinstance(output, collections.abc.Mapping) else output


class HeadroomCallback(lightning.Callback):
    """``lightning.Trainer(callbacks=[HeadroomCallback()])``: headroom's per-step memory figures in
    the Trainer's loggers, the leak verdict at the end and, with ``guard=True``, out-of-memory errors
    in a micro-batch absorbed at the same effective batch (see the module's documentation).

    ``every``: log every this many optimizer steps (each step is measured). ``leak``: judge leaks
    when training ends and record, on the cpu, the Python line of each allocation.
    """

    def __init__(self, guard: bool = False, leak: bool = True, every: int = 1):
        self.every = checked_every(every)
        self.guard = bool(guard)
        self.leak = leak
        self.micro_batch: Optional[int] = None  # rows a part, once the guard has split micro-batches
        self.recoveries = 0  # over the run
        self.monitor: Optional[Monitor] = None
        self.steps: list = []
        self.verdict: Optional[Dict[str, Any]] = None
        self._marks: Optional[PhaseMarks] = None
        self._stepped = False
        self._rows = 0  # the micro-batch in flight
        self._module = None
        self._trainer = None
        self._optimizer = None
        self._step_batches: list = []  # this update's micro-batches so far, to run again after an OOM
        self._step_recoveries = 0
        self._rng = None
        self._zeroed: Optional[tuple] = None  # (epoch, batch_idx) whose zero_grad ran before its forward

    # The guard: the module's training_step and optimizer_zero_grad, wrapped on the instance.
    def _run(self, batch, batch_idx, rest, original):
        """One micro-batch: forward and backward, in parts of ``micro_batch`` rows once the guard
        has split; what Lightning gets back has the whole micro-batch's loss, detached."""
        trainer, module = self._trainer, self._module
        rows = _rows(batch)
        micro = min(self.micro_batch or rows, rows)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        total, output = None, None
        for i in range(_core.accumulation_for(rows, micro)):
            part = batch if micro >= rows else _rows_of(batch, i * micro, min(rows, (i + 1) * micro))
            self._marks.enter("forward")
            output = original(part, batch_idx, *rest)
            loss = _loss_of(output)
            if loss is None:  # the step skipped, as the module asked
                return output
            share = _rows(part) / rows
            self._marks.enter("backward")
            scaled = loss * (share / trainer.accumulate_grad_batches)
            module.backward(scaler.scale(scaled) if scaler is not None else scaled)
            value = loss.detach() * share
            total = value if total is None else total + value
            del loss, scaled
        self._marks.enter("forward")
        leaf = total.detach().requires_grad_(True)  # Lightning's backward on it reaches no parameter
        if isinstance(output, collections.abc.Mapping):
            return {**output, "loss": leaf}
        return leaf

    def _recover(self, failure: str) -> None:
        """After an OOM in a micro-batch: the update starts again with smaller parts, or the run ends."""
        micro = min(self.micro_batch or self._rows, self._rows)
        action, smaller = _core.after_step_oom(micro, False, self.guard)
        if action == "give_up":
            raise torch.OutOfMemoryError(
                f"step {self._trainer.global_step + 1}: out of memory with micro-batch {micro}; micro-batch 1 "
                f"does not fit either: {failure}")
        self._optimizer.zero_grad(set_to_none=True)
        self._module.zero_grad(set_to_none=True)
        gc.collect()  # what the failed attempt left in reference cycles (its frames, its graph)
        self._marks.abort_step()
        _log.warning("headroom: step %d: out of memory with micro-batch %d; running the step again as %d x %d",
                     self._trainer.global_step + 1, micro, smaller, _core.accumulation_for(self._rows, smaller))
        self.micro_batch = smaller
        self._step_recoveries += 1
        torch.set_rng_state(self._rng)

    def _install_guard(self, trainer, pl_module) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError("HeadroomCallback(guard=True) with manual optimization: accepted: automatic "
                             "optimization (the guard splits what training_step's loss is computed over)")
        if trainer.world_size > 1:
            raise ValueError(f"HeadroomCallback(guard=True) over {trainer.world_size} processes: accepted: one "
                             "device (guard=False logs the figures under any strategy)")
        original_step = pl_module.training_step
        original_zero_grad = pl_module.optimizer_zero_grad

        def optimizer_zero_grad(epoch, batch_idx, optimizer):
            if self._zeroed != (epoch, batch_idx):
                original_zero_grad(epoch, batch_idx, optimizer)

        def training_step(batch, batch_idx, *rest):
            if batch_idx % trainer.accumulate_grad_batches == 0:  # the update's first micro-batch
                self._step_batches = []
                self._rng = torch.get_rng_state()
                self._marks.enter("zero_grad")
                original_zero_grad(trainer.current_epoch, batch_idx, self._optimizer)  # before, not after, its backward
                self._zeroed = (trainer.current_epoch, batch_idx)
            self._step_batches.append((batch, batch_idx, rest))
            try:
                return self._run(batch, batch_idx, rest, original_step)
            except torch.OutOfMemoryError as e:
                failure = str(e).splitlines()[0] if str(e) else "out of memory"
            # Out of the except block: the traceback, and the activations its frames held, are gone.
            while True:
                self._recover(failure)
                try:
                    output = None
                    for earlier, index, more in self._step_batches:  # the update's micro-batches, again
                        output = self._run(earlier, index, more, original_step)
                    return output  # Lightning has the earlier ones' losses already
                except torch.OutOfMemoryError as e:
                    failure = str(e).splitlines()[0] if str(e) else "out of memory"

        pl_module.training_step = training_step
        pl_module.optimizer_zero_grad = optimizer_zero_grad

    def _detach(self) -> None:
        """The wrapped hooks removed from the module: its own again."""
        if self._module is not None:
            self._module.__dict__.pop("training_step", None)
            self._module.__dict__.pop("optimizer_zero_grad", None)

    def _advice(self, failure: str) -> str:
        """What an out-of-memory error that ends the run says: where it happened, the last step's
        peak by category, and a plan that fits, as Lightning settings."""
        trainer, module = self._trainer, self._module
        micro = min(self.micro_batch or self._rows, self._rows)
        accum = trainer.accumulate_grad_batches
        lines = oom_lines(trainer.global_step + 1, self._marks.current, micro, accum, failure, self.steps)
        batch = self._step_batches[-1][0] if self._step_batches else None
        ids = batch.get("input_ids") if isinstance(batch, collections.abc.Mapping) else (
            batch if isinstance(batch, torch.Tensor) and batch.dim() == 2 else None)

        def settings(best) -> str:
            kwargs = best.lightning_trainer_kwargs()
            trainer_args = ", ".join(f"{k}={v!r}" for k, v in kwargs["trainer_kwargs"].items())
            module_args = ", ".join(f"{k}={v!r}" for k, v in kwargs["module"].items() if k != "optimizer")
            return f"lightning.Trainer({trainer_args}); module: {module_args}" + "".join(
                f"\n    note: {note}" for note in kwargs["notes"])

        optimizer = optimizer_name(self._optimizer) if self._optimizer is not None else None
        model = transformers_model(module)
        lines.append("  " + fitting_plan(module, model.config if model is not None else None,
                                         global_batch=self._rows * accum,
                                         seq=int(ids.shape[-1]) if ids is not None else 128,
                                         precision=LIGHTNING_PRECISIONS.get(str(trainer.precision), "fp32"),
                                         optimizer=optimizer or "adamw", render=settings))
        return "\n".join(lines)

    def _count_rows(self, batch) -> int:
        """The batch's rows; without the guard, 0 for a batch whose rows cannot be told (the figures
        do not need them; only the split does)."""
        try:
            return _rows(batch)
        except TypeError:
            if self.guard:
                raise
            return 0

    # Lightning's events.
    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, if any
        self._trainer, self._module, self._optimizer = trainer, pl_module, optimizer
        self.monitor = Monitor(pl_module.device, model=pl_module, optimizer=optimizer, python_frames=self.leak)
        self._marks = PhaseMarks(self.monitor)
        self.steps = []
        self.verdict = None
        self.recoveries = 0
        self._step_batches = []
        if self.guard:
            self._install_guard(trainer, pl_module)
        self._marks.enter("data")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._stepped = False
        self._rows = self._count_rows(batch)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._step_recoveries = 0
            if not self.guard:
                self._step_batches = []
        if not self.guard:
            self._step_batches.append((batch, batch_idx, ()))
        self._marks.enter("forward")

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self._marks.enter("zero_grad")

    def on_before_backward(self, trainer, pl_module, loss):
        self._marks.enter("backward")

    def on_after_backward(self, trainer, pl_module):
        self._marks.exit()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._stepped = True
        self._marks.enter("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._marks.exit()
        if self._stepped:
            rows = self._count_rows(batch)
            micro = min(self.micro_batch or rows, rows)
            parts = _core.accumulation_for(rows, micro) if micro > 0 else 1  # 0: rows not known
            record = self.monitor.end_step(batch=micro, accum=trainer.accumulate_grad_batches * parts,
                                           oom_recoveries=self._step_recoveries)
            self.recoveries += self._step_recoveries
            self._step_recoveries = 0
            self.steps.append(record)
            if trainer.global_step % self.every == 0:
                for key, value in step_metrics(record).items():
                    pl_module.log(key, float(value), on_step=True, on_epoch=False, prog_bar=False, logger=True)
        self._marks.enter("data")

    def on_exception(self, trainer, pl_module, exception):
        if self.monitor is None:
            return
        if isinstance(exception, torch.OutOfMemoryError):
            failure = str(exception).splitlines()[0] if str(exception) else "out of memory"
            _log.error(self._advice(failure))
        self._end()

    def on_train_end(self, trainer, pl_module):
        if self.monitor is None:
            return
        self._marks.exit()
        if self.leak:
            self.verdict = self.monitor.leak()
            values = {"headroom/leak_bytes_per_step": float(self.verdict["bytes_per_step"]),
                      "headroom/leak_detected": float(bool(self.verdict["detected"]))}
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
            report_leak(self.verdict)
        self._end()

    def _end(self) -> None:
        """The module given back as it was, the Monitor closed; Lightning's bound ``log`` and
        ``log_dict`` let go, so that this callback does not keep the module alive."""
        self._detach()
        self.__dict__.pop("log", None)
        self.__dict__.pop("log_dict", None)
        self._module = self._trainer = self._optimizer = None
        if self._marks is not None:
            self._marks.exit()
        self.monitor.close()
        self.monitor = None
        self._marks = None
        self._step_batches = []
