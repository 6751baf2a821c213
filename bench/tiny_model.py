"""The `tiny` preset's architecture (llama layout: RMSNorm, rotary, SwiGLU, grouped-query attention
through scaled_dot_product_attention) in plain PyTorch, for the Python baselines in bench/. Widths
come from configs/models/tiny.json unless overridden (the same names as --set takes)."""
import json
import pathlib

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent


def config(**overrides):
    cfg = json.loads((ROOT / "configs/models/tiny.json").read_text())
    cfg.update(overrides)
    return cfg


class Block(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, H, KV, I = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
        self.H, self.KV, self.HD, self.D = H, KV, D // H, D
        self.n1, self.n2 = torch.nn.RMSNorm(D, eps=1e-5), torch.nn.RMSNorm(D, eps=1e-5)
        self.q = torch.nn.Linear(D, H * self.HD, bias=False)
        self.k = torch.nn.Linear(D, KV * self.HD, bias=False)
        self.v = torch.nn.Linear(D, KV * self.HD, bias=False)
        self.o = torch.nn.Linear(H * self.HD, D, bias=False)
        self.gate = torch.nn.Linear(D, I, bias=False)
        self.up = torch.nn.Linear(D, I, bias=False)
        self.down = torch.nn.Linear(I, D, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        H, KV, HD = self.H, self.KV, self.HD
        h = self.n1(x)
        q = self.q(h).view(b, t, H, HD).transpose(1, 2)
        k = self.k(h).view(b, t, KV, HD).transpose(1, 2)
        v = self.v(h).view(b, t, KV, HD).transpose(1, 2)
        rot = lambda z: z * cos + torch.cat([-z[..., HD // 2:], z[..., :HD // 2]], -1) * sin
        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, self.D))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(torch.nn.Module):
    def __init__(self, cfg, seq):
        super().__init__()
        D, V = cfg["hidden_size"], cfg["vocab_size"]
        HD = D // cfg["num_attention_heads"]
        self.embed = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = torch.nn.RMSNorm(D, eps=1e-5)
        self.head = torch.nn.Linear(D, V, bias=False)
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, HD, 2).float() / HD))
        emb = torch.cat([torch.outer(torch.arange(seq).float(), inv)] * 2, -1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        return self.head(self.norm(x))


def corpus():
    data = torch.frombuffer(bytearray((ROOT / "data/corpus.txt").read_bytes()), dtype=torch.uint8).long()
    return data[: len(data) - len(data) // 10]
