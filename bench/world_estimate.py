"""One rank of Llama 3.1 8B trained as torchtitan launches it, estimated from the user's own
parallelize function under a fake process group: transformers' LlamaForCausalLM at its real width,
built on the meta device, FSDP2 with bf16 parameters (MixedPrecisionPolicy(bfloat16, float32)) over
8 and 128 ranks, micro-batch 2 x 8192, with no activation checkpointing, with full (torch's
checkpoint_wrapper around each block) and with torchtitan's per-op selective policy
(create_selective_checkpoint_contexts: every second matmul's output and attention's saved). Prints
each estimate's allocated and reserved peak, where it peaks, and the wall time of the trace.

    PYTHONPATH=build/python ~/.cache/headroom/venv/bin/python bench/world_estimate.py [RANKS ...]

Needs `make build` (the module in build/python) and transformers in the venv; about 2 GB of memory.
"""
import functools
import os
import sys
import time

import torch
import transformers

import headroom

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
from world_models import per_op_policy  # noqa: E402  (torchtitan's default policy, as the test runs it)

GiB = 2 ** 30
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                   tie_word_embeddings=False)


def parallelize(model, mesh, checkpointing: str):
    """What a torchtitan-style script does to the model: checkpoint each block, then FSDP2."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    layers = model.model.layers
    for i, block in enumerate(layers):
        if checkpointing == "full":
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif checkpointing == "per-op":
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False,
                                           context_fn=lambda: create_selective_checkpoint_contexts(per_op_policy()))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def main():
    torch.set_num_threads(1)
    ranks = [int(a) for a in sys.argv[1:]] or [8, 128]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_31_8B))
        # Per-op: without the KV cache, which makes torch 2.15's strict recompute differ from the
        # forward (docs/any-model.md); the other rows keep the config's default, use_cache=True.
        no_cache = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_31_8B, use_cache=False))
    ids = torch.zeros(2, 8192, dtype=torch.long, device="meta")
    print("| ranks | checkpointing | allocated peak | reserved peak | peak phase | traced | wall |")
    print("| ---: | --- | ---: | ---: | --- | --- | ---: |")
    for n in ranks:
        for ckpt in ("none", "full", "per-op"):
            t = time.perf_counter()
            est = headroom.estimate(no_cache if ckpt == "per-op" else model, {"input_ids": ids, "labels": ids},
                                    world_size=n, device="cuda",
                                    parallelize=functools.partial(parallelize, checkpointing=ckpt))
            wall = time.perf_counter() - t
            print(f"| {n} | {ckpt}{' (use_cache=False)' if ckpt == 'per-op' else ''} | "
                  f"{est['peak_bytes'] / GiB:.1f} GiB | {est['reserved_bytes'] / GiB:.1f} GiB | "
                  f"{est['peak_phase']} | {est['traced']['traced_depth']} of {est['traced']['depth']} blocks | "
                  f"{wall:.1f} s |", flush=True)

if __name__ == "__main__":
    main()
