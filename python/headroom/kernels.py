"""What the trace knows of single operators: where a kernel allocates otherwise than its traced
outputs say, and how much it computes.

* grouped_mm's meta kernel (what fake tensors run) refuses the fp32 that transformers' MoE experts
  give it on the cpu: its outputs are shaped by the meta kernel on bf16 stand-ins
  (:func:`via_bf16_meta`).
* cpu kernels with scratch of their own (mkldnn's convolutions reorder weights and inputs) are run
  once for real at the traced shapes, on zeros, to measure it (:func:`kernel_scratch`).
* CUDA kernels that allocate otherwise than the cpu kernel traced in their place (attention):
  :func:`cuda_output_bytes`, :func:`cuda_scratch_bytes`.
* FLOPs: torch's own table (what FlopCounterMode counts) and grouped_mm's (:data:`FLOPS`), counted by
  the trace as it sees each operator, so that no second dispatch mode (nor FlopCounterMode's module
  hooks, which kept checkpointed tensors alive) changes what is traced.

This module and :mod:`headroom.trace` are where the any-model path touches torch's private APIs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import flop_registry

from . import _core

# Operators whose meta kernel (what fake tensors run) refuses dtypes their cpu kernel takes: the
# meta of grouped_mm wants bf16 (CUDA's rule), while transformers' MoE experts call it in fp32 on
# the cpu. Their outputs' shapes come from the meta kernel run on bf16 stand-ins.
META_NEEDS_BF16 = {torch.ops.aten._grouped_mm.default}


# cpu kernels with scratch of their own, probed for real.
PROBED = {torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}
_PROBE_LIMIT = 1 << 30  # inputs larger than this are not run for real: no scratch recorded


def kernel_scratch(func, args, kwargs) -> int:
    """What ``func`` allocates inside itself above its inputs and outputs, run once on zeros of
    the traced shapes under headroom's counting allocator (0 when the inputs exceed the limit)."""
    flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if sum(t.untyped_storage().nbytes() for t in flat) > _PROBE_LIMIT:
        return 0

    def real(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype).zero_()

    with _disable_current_modes():
        try:
            real_args, real_kwargs = tree_map_only(torch.Tensor, real, args), tree_map_only(torch.Tensor, real, kwargs)
            before = _core.cpu_live_bytes()
            _core.reset_cpu_peak()
            out = func(*real_args, **real_kwargs)
            peak, after = _core.cpu_peak_bytes(), _core.cpu_live_bytes()
        except (torch.OutOfMemoryError, RuntimeError):
            return 0  # under a cpu_budget too small for the probe, or a kernel that refuses zeros: none known
        del out, real_args, real_kwargs
    return max(0, peak - max(before, after))


def shape_key(func, args, kwargs) -> tuple:
    def key(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
        return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)

    return (func,) + tuple(key(x) for x in tree_flatten((args, kwargs))[0])


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args, out_val=None, **kwargs) -> int:
    """grouped_mm (not in torch's FLOP table): each row of ``a`` meets its group's matrix once."""
    if a.dim() == 2 and b.dim() == 3:  # tokens x in, experts x in x out
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:  # the weights' gradient: in x tokens, tokens x out
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 2 * a.numel() * b.shape[-1]


# --- where a CUDA kernel allocates otherwise than the cpu kernel traced in its place -------------
_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def cuda_output_bytes(func, k: int, out: torch.Tensor, args) -> Optional[int]:
    """The bytes of output ``k`` of a traced cpu operator as its CUDA counterpart allocates it, where
    they differ: fp32 attention runs the memory-efficient kernel on cuda, whose log-sum-exp pads the
    sequence to a multiple of 32 (bf16/fp16 run flash attention, whose log-sum-exp is the cpu's)."""
    if func is _SDPA and k == 1 and args[0].dtype == torch.float32 and out.dim() == 3:
        b, h, s = out.shape
        return b * h * _round_up(s, 32) * 4
    return None


def cuda_scratch_bytes(func, args) -> int:
    """What a CUDA kernel allocates inside itself where the cpu kernel traced in its place does not:
    flash attention's backward keeps a float32 accumulator of the query gradient over sequence
    rounded to 128 and head size rounded to 32, and the softmax's row sums; with fewer key/value
    heads than query heads it expands their gradients to every head first. The memory-efficient
    backward (fp32) keeps the row sums."""
    if func is not _SDPA_BACKWARD:
        return 0
    q, k = args[1], args[2]
    b, h, s, d = q.shape
    if q.dtype == torch.float32:
        return b * h * s * 4
    rows = _round_up(s, 128)
    scratch = b * rows * h * (_round_up(d, 32) if d <= 192 else 256) * 4 + b * h * rows * 4
    if k.shape[1] != h:
        scratch += 2 * b * k.shape[2] * h * d * q.element_size()
    return scratch


# The FLOPs of an operator.
FLOPS = {**flop_registry, torch.ops.aten._grouped_mm: _grouped_mm_flops}


def via_bf16_meta(func, args, kwargs):
    """``func``'s fake outputs, shaped by its meta kernel over bf16 stand-ins of the inputs, in the
    inputs' own floating dtype."""
    flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    dtype = next((t.dtype for t in flat if t.is_floating_point()), torch.bfloat16)
    device = flat[0].device

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), device="meta",
                                   dtype=torch.bfloat16 if t.is_floating_point() else t.dtype)

    with unset_fake_temporarily():
        meta_out = func(*tree_map_only(torch.Tensor, stand_in, args), **tree_map_only(torch.Tensor, stand_in, kwargs))
    return tree_map_only(torch.Tensor, lambda o: torch.empty_strided(
        tuple(o.shape), tuple(o.stride()), dtype=dtype if o.dtype == torch.bfloat16 else o.dtype, device=device), meta_out)
