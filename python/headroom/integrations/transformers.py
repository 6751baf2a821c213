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

``guard=True`` keeps the run alive at the same effective batch, by headroom's guard's rules
(:mod:`headroom.guard`): when a micro-batch's forward or backward runs out of memory, the step's
gradients are dropped and its micro-batches so far run again, each split in halves and accumulated
(halved again while that fails, down to one row); the smaller micro-batch is kept for the later
steps, and ``headroom/oom_recoveries`` counts the splits. The optimizer sees the same rows per update
and the learning-rate schedule is unchanged (unlike ``auto_find_batch_size``, which shrinks the
batch). Each part passes the Trainer the whole micro-batch's ``num_items_in_batch``, so a loss
normalised by it (a transformers model's own) sums exactly; a loss the Trainer divides by the
accumulation steps instead is weighted by the part's share of the rows. A failure in the optimizer's
update, or with one row, ends the run as it would have. Dropout draws other masks for the halves
than for the whole.

An out-of-memory error in a micro-batch that it does not absorb (``guard=False``, or one row
already) ends the run as it would have, after an error on the ``headroom`` logger: the step, the
phase and the micro-batch it failed in, the last complete step's peak by category, and a plan that
fits the device (cuda: the card's memory; cpu: the :func:`headroom.cpu_budget`) for the same
effective batch, written as ``TrainingArguments`` fields (:func:`headroom.plan` on the model's
config; a model headroom cannot plan is said so).

What of the Trainer this touches beyond the ``TrainerCallback`` interface: the Trainer object
itself, found on the call stack when an event first reaches the callback (a callback is not given
it), for ``Trainer.log``; and ``Trainer.training_step`` (wrapped on the instance for the run, to
see its out-of-memory errors) with, under ``guard=True``, the attributes that decide its loss scaling,
``current_gradient_accumulation_steps``, ``loss_is_scaled_for_ga``, ``model_accepts_loss_kwargs``
and ``compute_loss_func``. Tested with transformers 5.24.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, Optional

import torch
from transformers import Trainer, TrainerCallback

from .. import _core
from ..guard import _rows, _rows_of
from ..monitor import Monitor
from ._common import PhaseMarks, checked_every, fitting_plan, oom_lines, report_leak, step_metrics

__all__ = ["HeadroomCallback", "step_metrics"]

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


def _plan_line(model, inputs, args) -> str:
    """A plan that fits this device for the Trainer's effective batch, as TrainingArguments fields;
    or why there is none."""
    ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
    precision = "bf16-mixed" if args.bf16 else "fp16-mixed" if args.fp16 else (
        "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32")

    def fields(best) -> str:
        settings = best.training_arguments()
        text = "TrainingArguments({})".format(
            ", ".join(f"{k}={v!r}" for k, v in settings["training_arguments"].items()))
        return text + "".join(f"\n    note: {note}" for note in settings["notes"])

    return fitting_plan(model, getattr(model, "config", None),
                        global_batch=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                        seq=int(ids.shape[-1]) if ids is not None else 128, precision=precision,
                        optimizer=_OPTIM.get(str(getattr(args.optim, "value", args.optim)), "adamw"), render=fields)


_OPTIM = {"sgd": "sgd", "adagrad": "adagrad", "adafactor": "adafactor", "adamw_bnb_8bit": "adamw8bit",
          "adamw_8bit": "adamw8bit", "paged_adamw_8bit": "adamw8bit"}


class HeadroomCallback(TrainerCallback):
    """``Trainer(..., callbacks=[HeadroomCallback()])``: headroom's per-step memory figures in the
    Trainer's logs, the leak verdict at the end and, with ``guard=True``, out-of-memory errors in a
    micro-batch absorbed at the same effective batch (see the module's documentation).

    ``every``: log every this many optimizer steps (each step is measured). ``leak``: judge leaks
    when training ends and record, on the cpu, the Python line of each allocation (a few
    microseconds each).
    """

    def __init__(self, guard: bool = False, leak: bool = True, every: int = 1):
        self.every = checked_every(every)
        self.guard = bool(guard)
        self.leak = leak
        self.micro_batch: Optional[int] = None  # rows a part, once the guard has split micro-batches
        self.recoveries = 0  # over the run
        self._step_recoveries = 0
        self._step_inputs: list = []  # this step's micro-batches so far, to run again after an OOM
        self._rng = None
        self._original_step = None
        self.monitor: Optional[Monitor] = None
        self.steps: list = []  # each step's Monitor record
        self.verdict: Optional[Dict[str, Any]] = None
        self._trainer: Optional[Trainer] = None
        self._marks: Optional[PhaseMarks] = None
        self._in_step = False
        self._hooks: list = []

    def _log(self, values: Dict[str, Any], control) -> None:
        if self._trainer is None:
            self._trainer = _find_trainer()
        if self._trainer is None:
            raise RuntimeError("HeadroomCallback: no transformers Trainer on the call stack to log through")
        # Trainer.log's on_log event clears should_log: the Trainer's own log of this step must still come.
        should_log = control.should_log
        self._trainer.log(values)
        control.should_log = should_log

    # The guard: Trainer.training_step, wrapped.
    def _loss_scaled_by_trainer(self, num_items_in_batch) -> bool:
        t = self._trainer
        if getattr(t, "loss_is_scaled_for_ga", None) is not None:
            return not t.loss_is_scaled_for_ga
        scaled = (getattr(t, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or (
            getattr(t, "compute_loss_func", None) is not None)
        return not scaled

    def _run(self, model, inputs, num_items_in_batch):
        """One micro-batch, in parts of ``micro_batch`` rows once the guard has split; the loss the
        Trainer adds to its running total, for the whole micro-batch."""
        rows = _rows(inputs)
        micro = min(self.micro_batch or rows, rows)
        if micro >= rows:
            return self._original_step(model, inputs, num_items_in_batch)
        trainer = self._trainer
        divide = self._loss_scaled_by_trainer(num_items_in_batch)
        steps = trainer.current_gradient_accumulation_steps
        total = None
        try:
            for i in range(_core.accumulation_for(rows, micro)):
                part = _rows_of(inputs, i * micro, min(rows, (i + 1) * micro))
                if divide:  # the part's mean, weighted by its share of the rows
                    trainer.current_gradient_accumulation_steps = steps * rows / _rows(part)
                loss = self._original_step(model, part, num_items_in_batch)
                total = loss if total is None else total + loss
        finally:
            trainer.current_gradient_accumulation_steps = steps
        return total

    def _advice(self, model, inputs, failure: str, state) -> str:
        """What an out-of-memory error that ends the run says: where it happened, the last step's
        peak by category, and a plan that fits, as TrainingArguments fields."""
        args = self._trainer.args
        rows = _rows(inputs)
        micro = min(self.micro_batch or rows, rows)
        lines = oom_lines(state.global_step + 1, self._marks.current, micro, args.gradient_accumulation_steps,
                          failure, self.steps)
        lines.append("  " + _plan_line(model, inputs, args))
        return "\n".join(lines)

    def _recover(self, model, inputs, failure: str, state) -> None:
        """After an OOM in a micro-batch: the step starts again with smaller parts, or the run ends."""
        rows = _rows(inputs)
        micro = min(self.micro_batch or rows, rows)
        action, smaller = _core.after_step_oom(micro, False, self.guard)
        if action == "give_up":
            _log.error(self._advice(model, inputs, failure, state))
            self._detach()  # the run ends here: the Trainer and the model are left as they were given
            self.monitor.close()
            self.monitor, self._marks = None, None
            raise torch.OutOfMemoryError(
                f"step {state.global_step + 1}: out of memory with micro-batch {micro}"
                + ("; micro-batch 1 does not fit either" if self.guard else " (HeadroomCallback(guard=False))")
                + f": {failure}")
        model.zero_grad(set_to_none=True)
        self._marks.abort_step()
        _log.warning("headroom: step %d: out of memory with micro-batch %d; running the step again as %d x %d",
                     state.global_step + 1, micro, smaller, _core.accumulation_for(rows, smaller))
        self.micro_batch = smaller
        self._step_recoveries += 1
        if self._rng is not None:
            torch.set_rng_state(self._rng)

    def _install_guard(self, state) -> None:
        trainer = self._trainer
        self._original_step = trainer.training_step

        def training_step(model, inputs, num_items_in_batch=None):
            self._step_inputs.append((inputs, num_items_in_batch))
            try:
                return self._run(model, inputs, num_items_in_batch)
            except torch.OutOfMemoryError as e:
                failure = str(e).splitlines()[0] if str(e) else "out of memory"
            # Out of the except block: the traceback, and the activations its frames held, are gone.
            while True:
                self._recover(model, inputs, failure, state)
                try:
                    loss = None
                    for earlier, items in self._step_inputs:  # the step's micro-batches so far, again
                        loss = self._run(model, earlier, items)
                    return loss  # the Trainer has counted the earlier ones' losses already
                except torch.OutOfMemoryError as e:
                    failure = str(e).splitlines()[0] if str(e) else "out of memory"

        trainer.training_step = training_step

    def on_init_end(self, args, state, control, **kwargs):
        self._trainer = _find_trainer()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._trainer is None:
            self._trainer = _find_trainer()
        device = next(model.parameters()).device
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the real one
        self.monitor = Monitor(device, model=model, optimizer=optimizer, python_frames=self.leak)
        self._marks = PhaseMarks(self.monitor)
        self.steps = []
        self.verdict = None

        def before_forward(module, args_):
            if self._in_step and module.training:
                self._marks.enter("forward")

        def after_forward(module, args_, output):
            if self._in_step and module.training:
                self._marks.enter("backward")

        self._hooks = [model.register_forward_pre_hook(before_forward), model.register_forward_hook(after_forward)]
        self.recoveries = 0
        if self._trainer is None:
            raise RuntimeError("HeadroomCallback: no transformers Trainer on the call stack to watch")
        self._install_guard(state)  # guard=False: it only explains an out-of-memory error
        self._marks.enter("data")

    def on_step_begin(self, args, state, control, **kwargs):
        self._marks.exit()
        self._in_step = True
        self._step_inputs = []
        self._step_recoveries = 0
        if self.guard:
            self._rng = torch.get_rng_state()

    def on_substep_end(self, args, state, control, **kwargs):
        self._marks.exit()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._in_step = False
        self._marks.enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._marks.enter("zero_grad")

    def on_step_end(self, args, state, control, **kwargs):
        self._marks.exit()
        rows = args.per_device_train_batch_size
        micro = min(self.micro_batch or rows, rows)
        record = self.monitor.end_step(batch=micro,
                                       accum=args.gradient_accumulation_steps * _core.accumulation_for(rows, micro),
                                       oom_recoveries=self._step_recoveries)
        self.recoveries += self._step_recoveries
        self._step_inputs = []
        self.steps.append(record)
        if state.global_step % self.every == 0:
            self._log(step_metrics(record), control)
        self._marks.enter("data")

    def _detach(self) -> None:
        """The hooks and the wrapped training_step removed from the model and the Trainer."""
        if self._marks is not None:
            self._marks.exit()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._original_step is not None:
            self._trainer.__dict__.pop("training_step", None)  # the class's own again
            self._original_step = None
        self._in_step = False

    def on_train_end(self, args, state, control, **kwargs):
        self._detach()
        if self.monitor is None:
            return
        if self.leak:
            self.verdict = self.monitor.leak()
            self._log({"headroom/leak_bytes_per_step": self.verdict["bytes_per_step"],
                       "headroom/leak_detected": bool(self.verdict["detected"])}, control)
            report_leak(self.verdict)
        self.monitor.close()
        self.monitor = None
        self._marks = None
