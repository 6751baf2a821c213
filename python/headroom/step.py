"""A user's training step, as their script runs it: the model called on its inputs, the loss, its
backward, the optimizer's update and ``zero_grad`` — with the precision, checkpointing and
optimizer of a configuration applied the way a script applies them.

The any-model estimate runs it on fake tensors and ``measure`` on real ones, so both see the same
step. Nothing it changes on the model outlives :func:`prepared` (training mode, checkpointing).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Mapping, Optional, Union

import torch

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
CHECKPOINTING = ("none", "full")
OPTIMIZERS = ("adamw", "adam", "sgd", "momentum", "adagrad", "adafactor")

OptimizerLike = Union[str, Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]]


class UsageError(ValueError):
    """What headroom says of the caller's arguments while it runs their step, told apart from the
    model's own errors (which it passes on with what it was doing)."""


def check_settings(precision: str, checkpointing: str, optimizer: OptimizerLike, accum: int) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision '{precision}': accepted: {', '.join(PRECISIONS)}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing '{checkpointing}': accepted: none, full (every repeated block)")
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer '{optimizer}': accepted: {', '.join(OPTIMIZERS)}, or a callable "
                             "params -> torch.optim.Optimizer")
    elif not callable(optimizer):
        raise TypeError(f"optimizer of type {type(optimizer).__name__}: accepted: a name or a callable "
                        "params -> torch.optim.Optimizer")
    if not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum {accum!r}: accepted: a whole number of micro-batches, at least 1")


def make_optimizer(optimizer: OptimizerLike, params: List[torch.nn.Parameter], device: str) -> torch.optim.Optimizer:
    """torch.optim's class of that name with its defaults, as a script makes it. ``device="cuda"``:
    the multi-tensor (foreach) update that torch.optim picks on cuda; on cpu the single-tensor one."""
    if not params:
        raise UsageError("the model has no trainable parameters (every one has requires_grad=False)")
    if callable(optimizer) and not isinstance(optimizer, str):
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(f"optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt
    foreach = True if device.startswith("cuda") else None
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=foreach)
    if optimizer == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    if optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-3, foreach=foreach)
    return torch.optim.Adafactor(params, lr=1e-2, foreach=foreach)


def call_model(model: torch.nn.Module, inputs: Any):
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def loss_of(output: Any, inputs: Any, loss_fn: Optional[Callable]) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(output, inputs)
    else:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None:
            raise UsageError(f"the model returned {type(output).__name__} without a loss: pass labels in inputs, or "
                             "loss_fn=lambda output, inputs: ... returning a scalar tensor")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UsageError(f"the loss is {type(loss).__name__}"
                         f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}"
                         ": accepted: a scalar tensor")
    return loss


@contextlib.contextmanager
def prepared(model: torch.nn.Module, checkpointing: str, blocks: Optional[torch.nn.ModuleList]) -> Iterator[None]:
    """Training mode, and checkpointing as a script enables it: the model's own
    ``gradient_checkpointing_enable()`` (transformers), else ``torch.utils.checkpoint`` around each
    repeated block. All of it undone afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    # transformers' checkpointing adds hooks of its own (enable_input_require_grads) that its
    # disable keeps: every hook dict is put back as it was.
    hooks = [(d, dict(d)) for m in model.modules()
             for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)]
    model.train()
    undo: List[Callable[[], None]] = []
    try:
        if checkpointing == "full":
            if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
                # transformers 5 names it activation_checkpointing_*; 4.x gradient_checkpointing_*.
                enable = getattr(model, "activation_checkpointing_enable", None)
                disable = getattr(model, "activation_checkpointing_disable", None)
                if enable is None or disable is None:
                    enable, disable = model.gradient_checkpointing_enable, model.gradient_checkpointing_disable
                if not _checkpointing_on(model):
                    if enable is model.gradient_checkpointing_enable:
                        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    else:
                        enable(activation_checkpointing_kwargs={"use_reentrant": False})
                    undo.append(disable)
            elif blocks is not None:
                from torch.utils.checkpoint import checkpoint

                for b in blocks:
                    inner = b.forward

                    def wrapped(*args, _inner=inner, **kwargs):
                        return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

                    b.forward = wrapped
                    undo.append(lambda b=b: b.__dict__.pop("forward", None))
            else:
                raise UsageError("checkpointing 'full': the model has no repeated blocks to checkpoint and no "
                                 "gradient_checkpointing_enable()")
        yield
    finally:
        for u in reversed(undo):
            u()
        for d, before in hooks:
            if d != before:
                d.clear()
                d.update(before)
        for m, mode in modes:
            m.training = mode


def _checkpointing_on(model: torch.nn.Module) -> bool:
    """Whether a transformers model already checkpoints (read without its deprecation warning)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def autocast(precision: str):
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision == "fp16-mixed":
        return torch.autocast("cpu", dtype=torch.float16)
    return contextlib.nullcontext()


def run_steps(model, inputs, loss_fn, optimizer: torch.optim.Optimizer, precision: str, accum: int, steps: int,
              on_phase: Callable[[str], None], after_forward: Optional[Callable[[Any], None]] = None,
              after_phase: Optional[Callable[[str], None]] = None,
              backward: Optional[Callable[[torch.Tensor], None]] = None) -> None:
    """``steps`` optimizer steps of ``accum`` micro-batches each, telling ``on_phase`` where it is
    (and ``after_phase`` when a phase ends; ``backward(loss)`` runs the backward when given). The
    model's output is dropped once its loss is taken, as ``loss = model(**batch).loss`` drops it."""
    done = after_phase or (lambda phase: None)
    for _ in range(steps):
        for _ in range(accum):
            on_phase("forward")
            with autocast(precision):
                output = call_model(model, inputs)
                loss = loss_of(output, inputs, loss_fn)
            if after_forward is not None:
                after_forward(output)
            del output
            if accum > 1:
                loss = loss / accum
            done("forward")
            on_phase("backward")
            if backward is None:
                loss.backward()
            else:
                backward(loss)
            del loss
            done("backward")
        on_phase("optimizer")
        optimizer.step()
        done("optimizer")
        on_phase("zero_grad")
        optimizer.zero_grad(set_to_none=True)
        done("zero_grad")
    on_phase("idle")
