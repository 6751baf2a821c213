"""Predict a configuration's peak memory, and plan the fastest one that fits, for a transformers
config (the native families gpt2, llama, mistral, qwen2, gpt_neox, qwen3, qwen3_moe, mixtral, gemma3 and
gemma3_text, phi3, olmo2; any other model through :func:`headroom.anymodel.estimate_model`).

The prediction is headroom's estimator: it replays a training step of headroom's own
implementation of the family (its attention path, its float32 loss, its checkpointing), operator by
operator, with torch.optim's update (``optimizer_impl="torch"``, the default here). The README's
table gives the measured difference from transformers' own models, per family.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from . import _core
from .plans import Plan, PlanResult

ConfigLike = Union[Mapping[str, Any], str, "os.PathLike[str]", Any]


def _config_json(config: ConfigLike) -> tuple[str, str]:
    """(config.json text, what to call it in errors) for a PretrainedConfig, a path or a dict."""
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):
        d = config.to_dict()
        d.setdefault("model_type", config.model_type)
        return json.dumps(d, default=str), f"{type(config).__name__}"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(), path
        except OSError as e:
            raise ValueError(f"config '{path}': cannot read it ({e.strerror}); accepted: a config.json path, a "
                             "directory holding one, a dict or a transformers PretrainedConfig") from None
    if isinstance(config, Mapping):
        return json.dumps(dict(config), default=str), "config dict"
    raise TypeError(f"config of type {type(config).__name__}: accepted: a transformers PretrainedConfig, a "
                    "config.json path or a dict")


def _flags(**settings: Any) -> Dict[str, str]:
    out = {}
    for name, value in settings.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[name.replace("_", "-")] = str(value)
    return out



def _estimate_module(model, inputs, config_settings_default: bool, **settings) -> Dict[str, Any]:
    """:func:`estimate` of a ``torch.nn.Module``: its own step traced (:mod:`headroom.anymodel`).
    ``config_settings_default``: the settings that apply to a config alone were left as they are."""
    from .anymodel import estimate_model

    if inputs is None:
        raise ValueError("estimate(model, inputs): inputs are needed for a model: what it is called with "
                         "(a dict for model(**inputs), a tensor, or a tuple), at the micro-batch size")
    if not config_settings_default:
        raise ValueError("estimate(model, ...): optimizer_impl, attention, shard, finetune, base_weights "
                         "and offload apply to a config; a model's own attention, torch.optim's update, which of "
                         "its parameters require grad (a peft model's) and the parallelism parallelize= applies "
                         "are what its trace follows")
    return estimate_model(model, inputs, **settings)

def estimate(
    config: ConfigLike,
    inputs: Any = None,
    *,
    loss_fn: Any = None,
    batch: int = 8,
    seq: int = 128,
    accum: int = 1,
    precision: str = "fp32",
    optimizer: str = "adamw",
    optimizer_impl: str = "torch",
    checkpointing: str = "none",
    attention: str = "flash",
    device: str = "cpu",
    world_size: int = 1,
    shard: str = "none",
    moe_routing: str = "balanced",
    finetune: str = "full",
    base_weights: str = "dense",
    offload: str = "none",
    parallelize: Any = None,
    rank: int = 0,
    mesh_shape: Optional[Sequence[int]] = None,
    mesh_dim_names: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """A training step's predicted peak memory per rank, without running it.

    Returns ``headroom estimate --json``'s object: ``{"model": {"name", "params"}, "peak_bytes",
    "peak_phase", "breakdown": {category: bytes}, "items": [...], "phases": {...}}`` (and, for
    ``device="cuda"``, the caching allocator's predicted reserved bytes). Settings are named and
    checked as the CLI's flags: precision fp32, bf16-mixed, fp16-mixed, bf16; optimizer adamw, adam,
    sgd, momentum, adagrad, adafactor, adamw8bit; checkpointing none, selective, every:K, full; attention flash,
    math; shard none, optimizer, gradients, full. ``optimizer_impl``: ``"torch"`` predicts the update
    of ``torch.optim``'s class of that name (its default: single-tensor on cpu, foreach on cuda;
    without weight decay for Adam and Adagrad; adafactor is predicted as headroom's own), as your
    script runs it; ``"headroom"`` that of headroom's own trainer (in place). ``moe_routing``, for a
    mixture of experts: ``"balanced"``, ``"worst"`` or a measured skew such as ``"1.8"``; the result's
    ``"experts"`` object says what was assumed and shows the experts' weights, gradients and
    optimizer state apart. ``finetune``: ``"full"``, ``"freeze:PATTERN[,PATTERN]"`` or
    ``"lora:r=R[,alpha=A][,dropout=P][,targets=q,k,v,o,gate,up,down]"`` as ``--finetune``; the
    result's ``model`` then has ``trainable_params`` (equal to peft's count for the same LoRA
    settings) beside ``params``, and frozen weights and adapters are items of their own.
    ``base_weights="nf4"`` (with LoRA) holds the frozen projections in 4-bit NF4 (QLoRA); ``offload=
    "optimizer"`` keeps the optimizer's state and update in host memory, reported as ``host_bytes``
    (and ``host_items``) apart from the device's peak.

    **Any model**: ``estimate(model, inputs, loss_fn=None, optimizer=, precision=, checkpointing=,
    device=, accum=)`` with a ``torch.nn.Module`` (real, or built on the meta device) and what it is
    called with (a dict, a tensor or a tuple, at the real micro-batch size) traces its own training
    step on fake tensors: see :func:`headroom.anymodel.estimate_model`. ``optimizer`` may then also
    be a callable ``params -> torch.optim.Optimizer``.

    **Any model at world size**: ``estimate(model, inputs, world_size=N, parallelize=fn, rank=r,
    mesh_shape=None, mesh_dim_names=None)`` traces rank ``r``'s step of the model after
    ``fn(model, mesh)`` — your own ``fully_shard`` / ``parallelize_module`` / checkpoint wrapping, as
    torchtitan's ``parallelize_llama`` — under a fake process group of N ranks; ``mesh`` is a cpu
    DeviceMesh of ``mesh_shape`` (default ``(N,)`` named ``("dp",)``), and ``inputs`` are rank r's
    micro-batch. The result adds ``"world"``; its bytes are that rank's.
    """
    import torch

    if isinstance(config, torch.nn.Module):
        defaults = (optimizer_impl, attention, shard, finetune, base_weights, offload) == \
            ("torch", "flash", "none", "full", "dense", "none")
        return _estimate_module(config, inputs, defaults, loss_fn=loss_fn, optimizer=optimizer, precision=precision,
                                checkpointing=checkpointing, device=device, accum=accum, world_size=world_size,
                                rank=rank, parallelize=parallelize, mesh_shape=mesh_shape,
                                mesh_dim_names=mesh_dim_names)
    if parallelize is not None or rank != 0 or mesh_shape is not None or mesh_dim_names is not None:
        raise TypeError("parallelize, rank, mesh_shape and mesh_dim_names are for a torch.nn.Module (the user's "
                        "parallelism traced); a config's layout is world_size= and shard=")
    if inputs is not None or loss_fn is not None:
        raise TypeError(f"inputs and loss_fn are for a torch.nn.Module, not a {type(config).__name__}")
    text, origin = _config_json(config)
    flags = _flags(batch=batch, seq=seq, accum=accum, precision=precision, optimizer=optimizer,
                   optimizer_impl=optimizer_impl, checkpointing=checkpointing, attention=attention, device=device, world_size=world_size,
                   shard=shard, moe_routing=moe_routing, finetune=finetune, base_weights=base_weights, offload=offload)
    return json.loads(_core.estimate(text, origin, flags))


def plan(
    config: ConfigLike,
    inputs: Any = None,
    *,
    global_batch: int,
    budget: Union[int, str],
    inputs_fn: Any = None,
    loss_fn: Any = None,
    seq: int = 128,
    precision: str = "fp32",
    optimizer: str = "adamw",
    optimizer_impl: str = "torch",
    device: str = "cpu",
    world_size: int = 1,
    margin: float = 0.05,
    allow_optimizer_change: bool = False,
    finetune: str = "full",
    base_weights: str = "dense",
    allow: Sequence[str] = (),
) -> PlanResult:
    """The ways to train ``global_batch`` sequences per optimizer step within ``budget`` bytes per
    rank (less ``margin``), fastest first: micro-batch x accumulation, precision, checkpointing and
    attention (the optimizer only with ``allow_optimizer_change``, or ``"optimizer"`` in ``allow``; 8-bit
    states and the optimizer offloaded to host memory only with ``"adamw8bit"`` and ``"offload"`` in
    ``allow``; with ``world_size`` > 1 the shard level too), keeping ``finetune`` and ``base_weights``
    (the fine-tuning method is yours to choose, not the planner's).
    Peaks come from :func:`estimate` (``optimizer_impl`` as there); step times from a
    FLOPs cost model (the CLI's ``headroom plan`` can also calibrate it by timing its own steps).

    **Any model**: ``plan(model, inputs, global_batch=, budget=)`` (or ``inputs_fn(batch)`` when the
    batch dimension of ``inputs`` cannot simply be scaled) searches precision x checkpointing x
    micro-batch through the model's traced estimate: see :func:`headroom.anyplan.plan_model`.
    """
    from . import parse_size
    import torch

    if isinstance(config, torch.nn.Module):
        from .anyplan import plan_model

        return plan_model(config, inputs, budget=budget, global_batch=global_batch, inputs_fn=inputs_fn,
                          loss_fn=loss_fn, optimizer=optimizer, device=device, margin=margin,
                          optimizers=("adamw", "sgd", "adafactor") if allow_optimizer_change else None)
    if inputs is not None or inputs_fn is not None or loss_fn is not None:
        raise TypeError(f"inputs, inputs_fn and loss_fn are for a torch.nn.Module, not a {type(config).__name__}")

    text, origin = _config_json(config)
    with tempfile.TemporaryDirectory(prefix="headroom-plan-") as tmp:
        # The planner reads a config file as the CLI does; the user's data is not in headroom's
        # memory, so the corpus it is told of is empty.
        model_path = os.path.join(tmp, "config.json")
        data_path = os.path.join(tmp, "empty.txt")
        with open(model_path, "w", encoding="utf-8") as f:
            f.write(text)
        open(data_path, "w").close()
        flags = _flags(model=model_path, data=data_path, seq=seq, precision=precision, optimizer=optimizer,
                       optimizer_impl=optimizer_impl, device=device, world_size=world_size, finetune=finetune,
                       base_weights=base_weights)
        try:
            result = json.loads(_core.plan(flags, int(global_batch), parse_size(budget), float(margin),
                                           bool(allow_optimizer_change), list(allow)))
        except ValueError as e:
            raise ValueError(str(e).replace(model_path, origin)) from None
    result["plans"] = [Plan(p) for p in result["plans"]]
    return PlanResult(result)
