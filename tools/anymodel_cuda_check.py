"""Any model on a GPU (scripts/gpu-check runs it; nothing here runs without one): headroom.estimate
with device="cuda", traced on the cpu, against torch.cuda.max_memory_allocated and
max_memory_reserved of the same training step run for real on the card.

The zoo: three models written with torch alone (the GPU machine may have no transformers) — a
decoder at Qwen3-0.6B's widths and vocabulary with grouped-query attention through
F.scaled_dot_product_attention under bf16 autocast (flash attention on the card), PyTorch's
nn.TransformerEncoder in fp32 (memory-efficient attention), and a ViT-B/16-shaped vision encoder
under bf16 autocast (cuDNN convolution) — and, where transformers imports, its Qwen3 and BERT.
Each: the model built on the meta device for the estimate, and seeded on the card for the run; two
steps of AdamW (foreach, torch's default on cuda). Prints one JSON line per model and a summary.
"""
import json
import sys

import headroom
import torch
import torch.nn.functional as F

STEPS = 2


class Decoder(torch.nn.Module):
    """A pre-norm decoder: RMSNorm, q/k/v/o with 16 query and 8 key/value heads, SwiGLU."""

    def __init__(self, layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=128, inner=3072, vocab=151936):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm1": torch.nn.RMSNorm(hidden), "q": torch.nn.Linear(hidden, heads * head_dim, bias=False),
            "k": torch.nn.Linear(hidden, kv_heads * head_dim, bias=False),
            "v": torch.nn.Linear(hidden, kv_heads * head_dim, bias=False),
            "o": torch.nn.Linear(heads * head_dim, hidden, bias=False), "norm2": torch.nn.RMSNorm(hidden),
            "gate": torch.nn.Linear(hidden, inner, bias=False), "up": torch.nn.Linear(hidden, inner, bias=False),
            "down": torch.nn.Linear(inner, hidden, bias=False)}) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        b, t = ids.shape
        for blk in self.layers:
            h = blk["norm1"](x)
            q = blk["q"](h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = blk["k"](h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = blk["v"](h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + blk["o"](a.transpose(1, 2).reshape(b, t, -1))
            h = blk["norm2"](x)
            x = x + blk["down"](F.silu(blk["gate"](h)) * blk["up"](h))
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(1024, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).float().pow(2).mean()


class Vision(torch.nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 768, 16, 16)
        layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True, dropout=0.0, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(768, 1000)

    def forward(self, pixels, labels):
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        return F.cross_entropy(self.head(self.encoder(x).mean(1)).float(), labels)


def zoo():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151936, (4, 1024), generator=g)
    cases = [
        ("decoder, qwen3-0.6b widths, GQA sdpa, bf16-mixed", Decoder, lambda: (ids, ids), "bf16-mixed"),
        ("nn.TransformerEncoder, fp32", Regressor, lambda: (torch.randn(8, 512, 1024, generator=g),), "fp32"),
        ("vit-b/16 shape, bf16-mixed", Vision,
         lambda: (torch.randn(32, 3, 224, 224, generator=g), torch.randint(0, 1000, (32,), generator=g)), "bf16-mixed"),
    ]
    try:
        import transformers
    except ImportError:
        return cases
    qcfg = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                                    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    bcfg = transformers.BertConfig(num_hidden_layers=4)
    bids = torch.randint(0, 30522, (16, 512), generator=g)
    cases += [
        ("transformers Qwen3 (tied), bf16-mixed", lambda: transformers.Qwen3ForCausalLM(qcfg),
         lambda: {"input_ids": ids, "labels": ids}, "bf16-mixed"),
        ("transformers BERT MLM, fp32", lambda: transformers.BertForMaskedLM(bcfg),
         lambda: {"input_ids": bids, "labels": bids}, "fp32"),
    ]
    return cases


def call(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out if isinstance(out, torch.Tensor) else out.loss


def measured(build, make_inputs, precision):
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = build().cuda().train()
    inputs = torch.utils._pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, make_inputs())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = call(model, inputs)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    del model, opt, inputs
    return allocated, reserved


def estimated(build, make_inputs, precision):
    with torch.device("meta"):
        model = build()
    inputs = make_inputs()
    loss_fn = None if isinstance(inputs, dict) else (lambda out, _inputs: out)
    return headroom.estimate(model, inputs, loss_fn=loss_fn, precision=precision, device="cuda",
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=True))


def main():
    if not torch.cuda.is_available():
        print(json.dumps({"check": "anymodel-cuda", "ok": False, "why": "no cuda device"}))
        return 1
    worst = {"allocated": 0.0, "reserved": 0.0}
    for name, build, make_inputs, precision in zoo():
        try:
            est = estimated(build, make_inputs, precision)
            allocated, reserved = measured(build, make_inputs, precision)
        except Exception as e:  # noqa: BLE001 - one model's failure is reported, the others still run
            print(json.dumps({"check": "anymodel-cuda", "model": name, "ok": False, "error": f"{type(e).__name__}: {e}"}))
            continue
        errors = {"allocated": est["peak_bytes"] / allocated - 1, "reserved": est["reserved_bytes"] / reserved - 1}
        for k, v in errors.items():
            worst[k] = max(worst[k], abs(v))
        print(json.dumps({"check": "anymodel-cuda", "model": name, "estimated_peak": est["peak_bytes"],
                          "max_memory_allocated": allocated, "error_allocated": round(errors["allocated"], 5),
                          "estimated_reserved": est["reserved_bytes"], "max_memory_reserved": reserved,
                          "error_reserved": round(errors["reserved"], 5), "traced": est["traced"]["note"]}), flush=True)
    print(json.dumps({"check": "anymodel-cuda summary", "worst_error_allocated": round(worst["allocated"], 5),
                      "worst_error_reserved": round(worst["reserved"], 5)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
