"""One rank of real FSDP2 training steps on the cpu (Gloo), run by torchrun from test_world.py: for
each of the models named (comma-separated, one after another in the same ranks), rank r's measured
peak (headroom's counting allocator) written to ``$OUT/<name>.rank<r>.json``.

The model is transformers' own LlamaForCausalLM, built on the meta device, sharded by the same
``parallelize`` the estimate is given, then made real on the cpu (seeded), as torchtitan does.
"""
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import headroom  # noqa: E402  (installs the counting allocator)
from headroom import _core  # noqa: E402
from world_models import MODELS, inputs_for  # noqa: E402


def measure(name: str, out_dir: str, rank: int, size: int) -> None:
    build, parallelize, settings = MODELS[name]
    gc.collect()  # what the model before left to the cycle collector
    base = _core.cpu_live_bytes()
    _core.reset_cpu_peak()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build()
    from torch.distributed.device_mesh import init_device_mesh

    shape = settings.get("mesh_shape", (size,))
    names = settings.get("mesh_dim_names", ("dp",) if len(shape) == 1 else None)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = parallelize(model, mesh) or model
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for m in model.modules():  # the rotary tables are computed, not drawn
            if hasattr(m, "inv_freq") and hasattr(m, "rope_init_fn"):
                inv, _ = m.rope_init_fn(m.config, torch.device("cpu"))
                m.inv_freq.copy_(inv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = inputs_for(name, torch.device("cpu"), rank)
    losses = []
    for _ in range(2):
        loss = model(**batch).loss
        losses.append(float(loss))
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = _core.cpu_peak_bytes() - base
    with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak_bytes": peak, "losses": losses}, f)


def main() -> None:
    names, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for name in names:  # each launch of torchrun costs its ranks' start (torch, transformers)
        measure(name, out_dir, rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
