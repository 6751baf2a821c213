"""The paths a model takes in a real step, kept while headroom traces it on fake tensors.

transformers takes its compile-friendly path when it sees a FakeTensor (``is_tracing`` counts fake
tensors as tracing), where a real step does not. One such difference changes memory: without a
KV cache and without an attention mask (a training step), ``masking_utils`` asks whether the
position ids pack several sequences into a row; on real tensors the answer, "no", drops the packed
mask and attention runs causal without one, while on fake tensors the check is skipped and an
explicit mask is built and kept by every layer (on Llama 3.1 8B at 2 x 8192 tokens, 448 MiB a
layer that the real step never holds). This module is the one adapter to those internals: inside
:func:`eager_masks` the check runs as it does (its operators traced) and is answered as the real
step would answer it, from values headroom knows: position ids the model derives itself (an
``arange``) never pack; ones the caller passed are read from the real inputs before the trace;
ones on the meta device, whose values nobody knows, keep transformers' own (masked) answer.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor


def _packs(inputs: Any, original) -> bool:
    """Whether the caller's position ids pack several sequences into a row, as the real step finds:
    False for none passed (the model counts positions itself), True where their values are unknown."""
    passed = inputs.get("position_ids") if isinstance(inputs, dict) else None
    if passed is None:
        return False
    if not isinstance(passed, torch.Tensor) or passed.is_meta or isinstance(passed, FakeTensor):
        return True
    with torch.no_grad():
        ids = passed.detach().to("cpu")
        return original(ids if ids.dim() == 2 else ids.unsqueeze(0)) is not None


@contextlib.contextmanager
def eager_masks(inputs: Any) -> Iterator[None]:
    """transformers' packed-sequence check answered on fake tensors as on the real ones (above).
    Entered before the trace: the caller's position ids are read outside it."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    packs = _packs(inputs, original)

    def find_packed_sequence_indices(position_ids: torch.Tensor):
        packed = original(position_ids)  # the operators the real step runs, traced as they are
        if packed is not None and isinstance(position_ids, FakeTensor) and not packs:
            return None  # the real step's answer: one sequence a row, no mask
        return packed

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
