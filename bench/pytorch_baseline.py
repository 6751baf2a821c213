#!/usr/bin/env python3
"""A plain PyTorch (Python, eager) training loop for the `tiny` preset, the baseline that
bench_train_throughput's figure is compared with: same architecture (llama layout: RMSNorm, rotary,
SwiGLU, grouped-query attention through scaled_dot_product_attention), same corpus, batch, sequence
length, fused AdamW and gradient clipping, on the same CPU threads.

  ~/.cache/headroom/venv/bin/python bench/pytorch_baseline.py [steps=20]
"""
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
cfg = json.loads((ROOT / "configs/models/tiny.json").read_text())
D, L, H = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
KV, I, V = cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]
HD = D // H
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
B, T = 8, 128


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(D, eps=1e-5), torch.nn.RMSNorm(D, eps=1e-5)
        self.q = torch.nn.Linear(D, H * HD, bias=False)
        self.k = torch.nn.Linear(D, KV * HD, bias=False)
        self.v = torch.nn.Linear(D, KV * HD, bias=False)
        self.o = torch.nn.Linear(H * HD, D, bias=False)
        self.gate = torch.nn.Linear(D, I, bias=False)
        self.up = torch.nn.Linear(D, I, bias=False)
        self.down = torch.nn.Linear(I, D, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, H, HD).transpose(1, 2)
        k = self.k(h).view(b, t, KV, HD).transpose(1, 2)
        v = self.v(h).view(b, t, KV, HD).transpose(1, 2)
        rot = lambda z: z * cos + torch.cat([-z[..., HD // 2:], z[..., :HD // 2]], -1) * sin
        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, D))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(L))
        self.norm = torch.nn.RMSNorm(D, eps=1e-5)
        self.head = torch.nn.Linear(D, V, bias=False)
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, HD, 2).float() / HD))
        emb = torch.cat([torch.outer(torch.arange(T).float(), inv)] * 2, -1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        return self.head(self.norm(x))


torch.manual_seed(0)
model = Model()
params = sum(p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
data = torch.frombuffer(bytearray((ROOT / "data/corpus.txt").read_bytes()), dtype=torch.uint8).long()
train = data[: len(data) - len(data) // 10]
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
