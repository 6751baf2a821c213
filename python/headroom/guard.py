"""Keep a run alive when a step runs out of memory, and find the largest batch that fits.

The rules are the C++ guard's (``headroom train``'s): before the optimizer update a step can run
again from its start, with the same rows in half-size micro-batches accumulated, so the global batch
and the update stay what they were; the smaller micro-batch is kept for the following steps. It
gives up (re-raising the error) when micro-batch 1 does not fit or the failure came in the update.
"""
from __future__ import annotations

import collections.abc
import contextlib
import json
import sys
from typing import Any, Callable, Dict, Optional

import torch

from . import _core
from .monitor import Monitor


def _rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, collections.abc.Mapping) else batch
    if isinstance(batch, (collections.abc.Mapping, list, tuple)):
        for value in values:
            if isinstance(value, torch.Tensor):
                return value.shape[0]
    raise TypeError(
        f"batch of type {type(batch).__name__}: accepted: a tensor, or a mapping (dict, BatchEncoding), list or "
        "tuple holding tensors whose first dimension is the batch"
    )


def _rows_of(batch: Any, start: int, end: int) -> Any:
    """Rows [start, end) of every tensor in ``batch`` (views, no copy); other values as they are."""

    def cut(v: Any) -> Any:
        return v[start:end] if isinstance(v, torch.Tensor) else v

    if isinstance(batch, torch.Tensor):
        return cut(batch)
    if isinstance(batch, collections.abc.Mapping):
        items = {k: cut(v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # a mapping type that is not built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(cut(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(cut(v) for v in batch)
    return batch


class Guard:
    """Runs optimizer steps so that an out-of-memory error does not end the run.

    ``step_fn(micro_batch)`` returns the loss of a micro-batch, the mean over its rows; the guard
    runs backward on it weighted by the micro-batch's share of the rows, then ``optimizer.step()``
    and ``optimizer.zero_grad(set_to_none=True)``. ``micro_batch``: the rows to start with (default:
    the whole batch). ``monitor``: phases and steps recorded there (forward, backward, optimizer,
    zero_grad; ``oom_recoveries``, ``batch`` and ``accum`` in its records). ``enabled=False`` lets the
    first error end the run, as ``--no-guard`` does. ``clip_grad_norm``: clip the gradients' global
    norm before the update. ``quiet``: no line on stderr for each recovery.

    Weighting by rows equals the whole batch's mean when every row has as many tokens in the loss
    (no padding); otherwise the accumulated loss is the rows' mean of their micro-batch means.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batch: Optional[int] = None,
        monitor: Optional[Monitor] = None,
        enabled: bool = True,
        clip_grad_norm: Optional[float] = None,
        quiet: bool = False,
    ):
        self.optimizer = optimizer
        self.micro_batch = micro_batch
        self.monitor = monitor
        self.enabled = enabled
        self.clip_grad_norm = clip_grad_norm
        self.quiet = quiet
        self.recoveries = 0  # over the run
        self.steps = 0

    def _phase(self, name: str):
        if self.monitor is None:
            return contextlib.nullcontext()
        return self.monitor.phase(name)

    def __call__(self, step_fn: Callable[[Any], torch.Tensor], batch: Any) -> float:
        """One optimizer step over ``batch``; returns its loss (the rows' mean)."""
        rows = _rows(batch)
        if rows < 1:
            raise ValueError("batch has no rows")
        micro = min(self.micro_batch or rows, rows)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        recoveries = 0
        while True:
            failure = None
            total = 0.0
            accum = _core.accumulation_for(rows, micro)
            try:
                for i in range(accum):
                    part = _rows_of(batch, i * micro, min(rows, (i + 1) * micro))
                    share = _rows(part) / rows
                    with self._phase("forward"):
                        loss = step_fn(part)
                    with self._phase("backward"):
                        (loss * share).backward()
                    total += float(loss.detach()) * share
                    loss = part = None
            except torch.OutOfMemoryError as e:
                failure = str(e).splitlines()[0] if str(e) else "out of memory"
            if failure is None:
                break
            # Out of the except block: the traceback, and the activations its frames held, are gone.
            loss = part = None
            self.optimizer.zero_grad(set_to_none=True)
            if self.monitor is not None:
                self.monitor.abort_step()
            action, smaller = _core.after_step_oom(micro, False, self.enabled)
            if action == "give_up":
                raise torch.OutOfMemoryError(
                    f"step {self.steps + 1}: out of memory with micro-batch {micro}"
                    + (" (the guard is off)" if not self.enabled else "; micro-batch 1 does not fit either"
                       if micro == 1 else "")
                    + f": {failure}"
                )
            recoveries += 1
            if not self.quiet:
                print(
                    f"step {self.steps + 1}: out of memory with micro-batch {micro}; running the step again as "
                    f"{smaller} x {_core.accumulation_for(rows, smaller)}",
                    file=sys.stderr,
                )
            micro = smaller
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        # The update: past this point nothing can be re-run (the C++ guard gives up here too).
        with self._phase("optimizer"):
            if self.clip_grad_norm is not None:
                params = [p for g in self.optimizer.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            self.optimizer.step()
        with self._phase("zero_grad"):
            self.optimizer.zero_grad(set_to_none=True)
        self.micro_batch = micro
        self.recoveries += recoveries
        self.steps += 1
        if self.monitor is not None:
            self.monitor.end_step(loss=total, batch=micro, accum=accum, oom_recoveries=recoveries)
        return total


def guard(step_fn: Callable[[Any], torch.Tensor], batch: Any, optimizer: torch.optim.Optimizer, **options) -> float:
    """One guarded optimizer step (see :class:`Guard`); the micro-batch an OOM lowered is kept on
    ``optimizer`` for its next steps. ``options`` are :class:`Guard`'s."""
    g = getattr(optimizer, "_headroom_guard", None)
    if g is None:
        g = Guard(optimizer, **options)
        optimizer._headroom_guard = g
    else:
        for name, value in options.items():  # later calls' options apply too, but the lowered micro-batch stays
            if name != "micro_batch":
                getattr(g, name)  # an unknown option is an AttributeError, as Guard's TypeError would be
                setattr(g, name, value)
    return g(step_fn, batch)


def find_max_batch(
    step_fn: Callable[[Any], torch.Tensor],
    make_batch: Callable[[int], Any],
    *,
    budget: Any = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    model: Optional[torch.nn.Module] = None,
    limit: int = 4096,
    predict: Optional[Callable[[int], int]] = None,
    config: Any = None,
    device: str = "cpu",
    **estimate_settings: Any,
) -> Dict[str, Any]:
    """The largest batch whose training step fits, found with few real trial steps.

    ``make_batch(n)`` returns a batch of ``n`` rows; each trial runs ``step_fn`` on it and backward
    (and ``optimizer.step()`` when given: the trials then train the model, as real steps do) under
    ``budget`` (cpu: the cpu budget, by default the current one; cuda: by default what this process
    holds and the card's free memory). The gradients a trial leaves are dropped: ``optimizer``'s, or
    ``model``'s parameters'.
    ``predict(n)`` -> predicted peak bytes seeds the search; with a transformers ``config`` (and
    :func:`estimate`'s settings, such as ``seq=``) the estimate does; without either, the search
    measures the line through two batches. Returns ``{"max_batch", "trials", "log": [...]}``.
    """
    from . import parse_size

    cuda = str(device).startswith("cuda")
    if budget is None:
        if cuda:
            budget = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
        else:
            budget = _core.cpu_budget()
        if budget is None:
            raise ValueError("find_max_batch on cpu needs budget= (or a headroom.cpu_budget in force)")
    budget = parse_size(budget)
    if predict is None and config is not None:
        from .predict import estimate

        def predict(n: int) -> int:
            return estimate(config, batch=n, device=device, **estimate_settings)["peak_bytes"]

    def trial(n: int):
        ok = True
        previous = _core.cpu_budget()
        if not cuda:
            _core.set_cpu_budget(budget)
            _core.reset_cpu_peak()
        else:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            loss = step_fn(make_batch(n))
            loss.backward()
            loss = None
            if optimizer is not None:
                optimizer.step()
        except torch.OutOfMemoryError:
            ok = False
        finally:
            if not cuda:
                _core.set_cpu_budget(previous)
        peak = torch.cuda.max_memory_allocated(device) if cuda else _core.cpu_peak_bytes()
        ok = ok and peak <= budget  # cuda: the card itself may hold more than the budget
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        if model is not None:
            model.zero_grad(set_to_none=True)
        # A failed trial: at least the budget (what it needed is not known past the refusal).
        return (ok, int(peak) if ok else int(budget) + 1)

    return json.loads(_core.search_max_batch(trial, budget, int(limit), predict))
