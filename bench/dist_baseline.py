"""PyTorch's own data parallelism on the architecture headroom's bench_dist compares with: DDP, or
FSDP2 (`fully_shard` per block and on the model), training tiny's layout at the given widths on the
bundled corpus with fused-free AdamW and gradient clipping, over Gloo on cpu. Run under torchrun:

  torchrun --standalone --nproc-per-node 2 bench/dist_baseline.py ddp|fsdp2 BATCH SEQ STEPS [key=value ...]

Rank 0 prints one JSON line: tokens/s over the steps after the first (all ranks' tokens).
Peak memory is measured from outside (bench/dist_compare.sh wraps each rank in /usr/bin/time)."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tiny_model import Model, config, corpus

mode, B, T, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = config(**{k: int(v) for k, v in (a.split("=") for a in sys.argv[5:])})
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = Model(cfg, T)
if mode == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
elif mode == "fsdp2":
    from torch.distributed.fsdp import fully_shard
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
else:
    sys.exit(f"mode {mode!r}: accepted ddp or fsdp2")
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
train = corpus()
gen = torch.Generator().manual_seed(rank)
times = []
for step in range(STEPS):
    t0 = time.perf_counter()
    starts = torch.randint(0, len(train) - T - 1, (B,), generator=gen)
    win = torch.stack([train[s : s + T + 1] for s in starts])
    logits = model(win[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, cfg["vocab_size"]), win[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
steady = times[1:] or times
if rank == 0:
    print(f'{{"impl": "{mode}", "ranks": {world}, "tokens_per_s": {B * T * world * len(steady) / sum(steady):.1f}}}')
dist.destroy_process_group()
