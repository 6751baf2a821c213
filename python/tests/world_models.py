"""The models test_world.py measures under torchrun and estimates at world size: transformers' own
Llama at SmolLM-135M's width and vocabulary, tied and untied, shrunk in depth only, each with the ``parallelize`` a torchtitan-style script applies."""
from typing import Callable, Dict, Tuple

import torch
import transformers

SEQ = 128


def _smollm(tied: bool = True, layers: int = 4, use_cache: bool = True) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   tie_word_embeddings=tied, max_position_embeddings=2048, use_cache=use_cache)
    return transformers.LlamaForCausalLM(cfg)


def fsdp_bf16(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 with bf16 parameters and fp32 gradient reduction, each block its own unit (torchtitan's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def fsdp_fp32_keep(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 in fp32, blocks kept gathered from forward to backward (reshard_after_forward=False)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_tp(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """2D: tensor parallel over ``mesh["tp"]`` (attention and MLP projections split column- then
    row-wise, as torchtitan's plan without sequence parallel), FSDP2 with bf16 parameters over
    ``mesh["dp"]``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh["tp"]
    for block in model.model.layers:
        parallelize_module(block, tp, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dp = mesh["dp"]
    for block in model.model.layers:
        fully_shard(block, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    return model


def per_op_policy():
    """A selective checkpointing policy as torchtitan's default (its description, not its code):
    matmul outputs saved except every second one, attention's saved, everything else recomputed.
    Made afresh for each checkpointed call, so that a call's recompute counts its matmuls as its
    forward did."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy

    saved = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    counts: Dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func is torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def per_op_checkpointed(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Each block under torch's checkpoint_wrapper with the per-op policy, then FSDP2 in bf16."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    layers = model.model.layers
    for i, block in enumerate(layers):
        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False,
                                       context_fn=lambda: create_selective_checkpoint_contexts(per_op_policy()))
    return fsdp_bf16(model, mesh)


def _smollm_tp() -> torch.nn.Module:
    """SmolLM's width with 8 attention heads (4 key-value heads), so that two tensor-parallel ranks
    split them evenly; transformers' attention reads the heads per rank from the projection's output."""
    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=49152,
                                   tie_word_embeddings=True, max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(cfg)


MODELS: Dict[str, Tuple[Callable[[], torch.nn.Module], Callable, dict]] = {
    "smollm-fsdp-bf16": (_smollm, fsdp_bf16, {}),
    "smollm-untied-fsdp-fp32-keep": (lambda: _smollm(tied=False), fsdp_fp32_keep, {}),
    # Without transformers' KV cache, as training runs: torch 2.15's selective checkpointing replays
    # forward's op-by-op decisions in the recompute, which a cache filled by the forward changes.
    "smollm-fsdp-bf16-per-op": (lambda: _smollm(use_cache=False), per_op_checkpointed, {}),
    "smollm-fsdp2-tp2": (_smollm_tp, fsdp_tp, {"mesh_shape": (2, 2), "mesh_dim_names": ("dp", "tp")}),
}


# A run whose activations set its peak (at batch 2 the root's gradient reduction does).
BATCH = {"smollm-fsdp-bf16-per-op": 8}


def inputs_for(name: str, device: torch.device, rank: int = 0) -> dict:
    batch = BATCH.get(name, 2)
    if device.type == "meta":
        ids = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    else:
        ids = torch.randint(0, 49152, (batch, SEQ), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": ids}
