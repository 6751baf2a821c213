"""Monitor: where a training loop's memory goes, step by step and phase by phase."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Union

import torch

from . import _core

PHASES = ("data", "forward", "backward", "optimizer", "zero_grad")


def _optimizer_tensors(optimizer: Optional[torch.optim.Optimizer]):
    if optimizer is None:
        return None

    def state() -> List[torch.Tensor]:
        out = []
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
        return out

    return state


class Monitor:
    """Live and peak memory of a training loop, per step and per phase, by category.

    ``device``: ``"cpu"`` (exact counts from headroom's counting allocator, installed by
    ``import headroom``) or ``"cuda"``/``"cuda:N"`` (PyTorch's caching allocator: allocated, and
    reserved). ``model`` and ``optimizer`` let it name what the bytes are: the parameters' storages
    are weights, their ``.grad`` gradients, the optimizer's state tensors optimizer state; what was
    live when the step began and is none of those is "other"; the rest of a peak is activations and
    temporaries. ``metrics``: a path; each step is written there as one JSON line with the fields of
    ``headroom train --metrics``. ``python_frames`` (cpu): record where in your Python code each
    allocation is made, so that :meth:`leak` can name the line (a few microseconds per allocation).

    A step runs from construction (or the previous :meth:`end_step`) to the next :meth:`end_step`;
    mark its parts with ``with mon.phase("forward"):`` (data, forward, backward, optimizer,
    zero_grad; a phase entered several times in a step, as with micro-batches, is merged).
    """

    def __init__(
        self,
        device: Union[str, torch.device] = "cpu",
        *,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        metrics: Optional[Union[str, os.PathLike]] = None,
        python_frames: bool = True,
    ):
        parameters = list(model.parameters()) if model is not None else []
        if optimizer is not None and model is None:
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.device = str(device)
        self._live = _core.Monitor(self.device, parameters, _optimizer_tensors(optimizer), python_frames)
        self.steps: List[Dict[str, Any]] = []
        self._metrics = open(metrics, "w") if metrics is not None else None

    @property
    def _core(self):
        if self._live is None:
            raise ValueError("this Monitor is closed")
        return self._live

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Marks a part of the step: ``with mon.phase("backward"): loss.backward()``."""
        self._core.enter(name)
        try:
            yield
        finally:
            self._core.exit()

    def end_step(
        self,
        *,
        loss: Union[float, torch.Tensor, None] = None,
        tokens: Optional[int] = None,
        batch: int = 0,
        accum: int = 1,
        lr: Optional[float] = None,
        grad_norm: Optional[float] = None,
        oom_recoveries: int = 0,
    ) -> Dict[str, Any]:
        """Closes the step and returns its record (the ``--metrics`` line's fields).

        ``peak_bytes`` the step's peak, ``live_bytes`` what is live now, ``peak_phase`` and ``phases``:
        per phase live_in, live_out, peak and the peak's ``breakdown`` by category.
        """
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach())
        record = json.loads(
            self._core.end_step(loss, tokens, int(batch), int(accum), int(oom_recoveries), lr, grad_norm)
        )
        self.steps.append(record)
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        return record

    def abort_step(self) -> None:
        """Drops the step in flight (after an out-of-memory error); the step starts again."""
        self._core.abort_step()

    def leak(self, warmup_steps: int = 2) -> Dict[str, Any]:
        """The leak verdict over the steps so far (the detector of ``headroom doctor``).

        ``detected``, ``bytes_per_step`` (robust slope of the live bytes after each step, warm-up steps
        dropped), ``reason``, and ``sites``: the allocations still alive that steps after the warm-up
        made, grouped by phase, size and (cpu) ``origin``, the Python ``file:line in function`` that made
        them. Needs at least ``warmup_steps + 4`` steps for a verdict.
        """
        return json.loads(self._core.leak(int(warmup_steps)))

    def summary(self) -> str:
        """A table of each phase's highest peak over the steps, by category."""
        return self._core.summary()

    @property
    def live_bytes(self) -> int:
        """Bytes live on the device now (cpu: since ``import headroom``)."""
        return self._core.live_bytes()

    @property
    def source(self) -> str:
        """Where the figures come from: ``"cpu (counting allocator)"``, ``"cuda:0 (caching allocator)"``."""
        return self._core.source()

    def close(self) -> None:
        """Stops recording origins and closes the metrics file (also on ``with`` exit and deletion)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._live = None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
