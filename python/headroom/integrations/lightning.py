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
with where the allocations that survived their step were made (cpu: the Python line). Tested with
lightning 2.6.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import lightning

from ..guard import _rows
from ..monitor import Monitor
from ._common import PhaseMarks, report_leak, step_metrics

__all__ = ["HeadroomCallback"]

class HeadroomCallback(lightning.Callback):
    """``lightning.Trainer(callbacks=[HeadroomCallback()])``: headroom's per-step memory figures in
    the Trainer's loggers, and the leak verdict at the end (see the module's documentation).

    ``every``: log every this many optimizer steps (each step is measured). ``leak``: judge leaks
    when training ends and record, on the cpu, the Python line of each allocation. ``guard``: keep
    the run alive on out-of-memory — not built for Lightning yet; ``True`` is refused rather than
    ignored.
    """

    def __init__(self, guard: bool = False, leak: bool = True, every: int = 1):
        if guard:
            raise NotImplementedError("lightning HeadroomCallback(guard=True): not built yet; accepted: guard=False")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: accepted: a whole number of optimizer steps, 1 or more")
        self.every = every
        self.leak = leak
        self.monitor: Optional[Monitor] = None
        self.steps: list = []
        self.verdict: Optional[Dict[str, Any]] = None
        self._marks: Optional[PhaseMarks] = None
        self._stepped = False

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, if any
        self.monitor = Monitor(pl_module.device, model=pl_module, optimizer=optimizer, python_frames=self.leak)
        self._marks = PhaseMarks(self.monitor)
        self.steps = []
        self.verdict = None
        self._marks.enter("data")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._stepped = False
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
            record = self.monitor.end_step(batch=_rows(batch), accum=trainer.accumulate_grad_batches)
            self.steps.append(record)
            if trainer.global_step % self.every == 0:
                for key, value in step_metrics(record).items():
                    pl_module.log(key, float(value), on_step=True, on_epoch=False, prog_bar=False, logger=True)
        self._marks.enter("data")

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
        self.monitor.close()
        self.monitor = None
        self._marks = None

