#!/usr/bin/env python3
"""A plain PyTorch training loop on cuda that records a memory snapshot, as users do, for
scripts/gpu-check: `headroom analyze` must read it and agree with the allocator's own peaks.

    snapshot_cuda_loop.py OUT.pickle [--leak]

A small Transformer encoder trained for 8 steps with AdamW, under
torch.cuda.memory._record_memory_history (started before anything is allocated, so the trace holds
the whole run). With --leak, each step's loss is kept with its graph (the classic leak). Prints
torch.cuda.memory_stats()'s peaks as JSON: "requested_peak" (the trace's bytes) and "reserved_peak".
"""
import json
import sys

import torch


def main():
    out, leak = sys.argv[1], "--leak" in sys.argv[2:]
    torch.manual_seed(0)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    dev = "cuda"
    layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(8192, 512), torch.nn.TransformerEncoder(layer, num_layers=4),
                                torch.nn.Linear(512, 8192)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kept = []
    for step in range(8):
        x = torch.randint(0, 8192, (8, 256), device=dev)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 8192), x.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if leak:
            kept.append(logits)  # its graph's saved tensors stay alive
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._dump_snapshot(out)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps({"requested_peak": stats["requested_bytes.all.peak"], "reserved_peak": stats["reserved_bytes.all.peak"],
                      "allocated_peak": stats["allocated_bytes.all.peak"], "leak": leak}))


if __name__ == "__main__":
    main()
