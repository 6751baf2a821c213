#!/usr/bin/env python3
"""A plain PyTorch (Python, eager) training loop for the `tiny` preset, the baseline that
bench_train_throughput's figure is compared with: same architecture (llama layout: RMSNorm, rotary,
SwiGLU, grouped-query attention through scaled_dot_product_attention), same corpus, batch, sequence
length, fused AdamW and gradient clipping, on the same CPU threads.

  ~/.cache/headroom/venv/bin/python bench/pytorch_baseline.py [steps=20]
"""
import json
import sys
import time

import torch
import torch.nn.functional as F

from tiny_model import Model, config, corpus

cfg = config()
V = cfg["vocab_size"]
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
B, T = 8, 128


torch.manual_seed(0)
model = Model(cfg, T)
params = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
train = corpus()
gen = torch.Generator().manual_seed(0)
step_seconds = []
for step in range(STEPS):
    t0 = time.perf_counter()
    starts = torch.randint(0, len(train) - T - 1, (B,), generator=gen)
    win = torch.stack([train[s : s + T + 1] for s in starts])
    logits = model(win[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, V), win[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_seconds.append(time.perf_counter() - t0)
tok_s = B * T * STEPS / sum(step_seconds)
print(json.dumps({"impl": "pytorch-eager-python", "params": params, "threads": torch.get_num_threads(),
                  "steps": STEPS, "batch": B, "seq": T, "final_loss": round(loss.item(), 4),
                  "tokens_per_s": round(tok_s, 1)}))
