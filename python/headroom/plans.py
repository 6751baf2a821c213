"""A plan, as ``headroom plan --json`` lists it, and the planner's answer: what :func:`headroom.plan`
returns for a transformers config and for any model alike, and how a plan becomes the settings of
transformers, Lightning or a plain PyTorch loop."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from . import _core


class Plan(dict):
    """One way to train: ``batch`` (micro-batch), ``accum``, ``precision``, ``checkpointing``,
    ``optimizer``, ``attention``, ``shard``, ``world_size``, ``predicted_peak_bytes`` and
    ``predicted_step_time_ratio`` (to the best plan's), as ``headroom plan --json`` lists them."""

    def training_arguments(self) -> Dict[str, Any]:
        """The transformers settings: ``{"training_arguments": {...}, "model_kwargs": {...}, "notes": [...]}``.

        ``TrainingArguments(output_dir=..., **p.training_arguments()["training_arguments"])``;
        ``model_kwargs`` go to ``from_pretrained`` (``attn_implementation``, and ``dtype`` for pure bf16);
        ``notes`` say where transformers cannot do exactly what was planned.
        """
        return json.loads(_core.training_arguments(json.dumps(self)))

    def training_arguments_code(self) -> str:
        """The same as Python source to paste (``headroom plan --emit hf``)."""
        return _core.training_arguments_code(json.dumps(self))

    def lightning_trainer_kwargs(self) -> Dict[str, Any]:
        """The Lightning settings: ``{"trainer_kwargs": {...}, "module": {...}, "model_kwargs": {...},
        "notes": [...]}``.

        ``lightning.Trainer(**p.lightning_trainer_kwargs()["trainer_kwargs"])`` (``precision``,
        ``accumulate_grad_batches``, and ``devices`` and ``strategy`` over several ranks); ``module``
        is what the LightningModule and its DataLoader take: ``batch_size``, ``gradient_checkpointing``
        (enable it in ``configure_model``) and ``optimizer`` (``configure_optimizers``' source);
        ``notes`` say where Lightning cannot do exactly what was planned.
        """
        return json.loads(_core.lightning_trainer_kwargs(json.dumps(self)))

    def lightning_trainer_code(self) -> str:
        """The same as Python source to paste (``headroom plan --emit lightning``)."""
        return _core.lightning_trainer_code(json.dumps(self))

    def torch_loop(self, device: str = "cuda") -> str:
        """A plain PyTorch loop with the plan's accumulation, autocast and checkpointing, as Python
        source (``headroom plan --emit torch``)."""
        return _core.torch_loop_code(json.dumps(self), device)


class PlanResult(dict):
    """``headroom plan --json``'s object: ``plans`` (fastest first), ``considered``, ``global_batch``,
    ``budget_bytes``; when nothing fits, ``smallest_peak`` says what came closest."""

    @property
    def plans(self) -> List[Plan]:
        return self["plans"]

    @property
    def best(self) -> Optional[Plan]:
        """The fastest plan that fits, or None."""
        return self["plans"][0] if self["plans"] else None
