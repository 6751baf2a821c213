"""One rank of FSDP2 on the card against estimate(model, inputs, world_size=N, parallelize=fn,
device="cuda") (scripts/gpu-check runs it; nothing here runs without a GPU).

    torchrun --nproc-per-node N tools/world_cuda_check.py run OUT_DIR   # each rank's measured peaks
    python3 tools/world_cuda_check.py compare OUT_DIR N                 # the estimate of each rank beside them

The model is PyTorch's nn.TransformerEncoder at 1024 wide (the GPU machine may have no
transformers), sharded per layer with bf16 parameters and fp32 reduction; the estimate's fake world
runs FSDP2 as it runs on the cpu (one stream), so this is where the card's streams are checked.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import headroom  # noqa: E402
from anymodel_cuda_check import Regressor  # noqa: E402

BATCH, SEQ = 4, 1024


def fsdp_bf16(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def run(out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    with torch.device("meta"):
        model = Regressor()
    fsdp_bf16(model, init_device_mesh("cuda", (size,)))
    model.to_empty(device="cuda")
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, SEQ, 1024, device="cuda")
    for _ in range(2):
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with open(os.path.join(out_dir, f"world-rank{rank}.json"), "w") as f:
        json.dump({"peak_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved()}, f)
    dist.destroy_process_group()


def compare(out_dir: str, size: int) -> None:
    with torch.device("meta"):
        model = Regressor()
    x = torch.zeros(BATCH, SEQ, 1024, device="meta")
    for r in range(size):
        m = json.load(open(os.path.join(out_dir, f"world-rank{r}.json")))
        est = headroom.estimate(model, (x,), world_size=size, rank=r, parallelize=fsdp_bf16, device="cuda")
        print(f"FSDP2 bf16 rank {r}/{size}: peak {m['peak_bytes']} est {100 * (est['peak_bytes'] - m['peak_bytes']) / m['peak_bytes']:+.2f}%"
              f"  reserved {m['reserved_bytes']} est {100 * (est['reserved_bytes'] - m['reserved_bytes']) / m['reserved_bytes']:+.2f}%")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        compare(sys.argv[2], int(sys.argv[3]))
