"""Time to estimate a 70B-shaped decoder without computing: headroom.estimate(model, inputs) against
PyTorch's own MemTracker (torch.distributed._tools.mem_tracker) in fake mode, in one run.

The model: transformers' LlamaForCausalLM at Llama-3-70B's shape (80 layers, hidden 8192, MLP
28672, 64 heads, 8 key/value heads, vocabulary 128,256), weights in bf16, one sequence of 4096
tokens, AdamW. headroom builds it on the meta device and traces its step on fake tensors (three
blocks, a fourth to check, repeated to 80); MemTracker follows its documented fake-mode recipe:
the model built under FakeTensorMode and every operator of one training step tracked.

    PYTHONPATH=build/python ~/.cache/headroom/venv/bin/python bench/anymodel_speed.py [--layers N]

Prints each tool's seconds and peak, and the ratio of the times. The peaks are not the same
quantity: headroom's is what a card's caching allocator would count (blocks rounded to 512 bytes,
cuBLAS's workspace), MemTracker's the fake tensors' bytes.
"""
import argparse
import time

import headroom  # noqa: F401  (before any tensor)
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

GiB = 2**30


def config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, rope_theta=500000.0, torch_dtype="bfloat16")


def bf16_model(layers: int) -> transformers.LlamaForCausalLM:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return transformers.LlamaForCausalLM(config(layers))
    finally:
        torch.set_default_dtype(old)


def headroom_time(layers: int, seq: int):
    start = time.perf_counter()
    with torch.device("meta"):
        model = bf16_model(layers)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    out = headroom.estimate(model, {"input_ids": ids, "labels": ids}, precision="bf16", optimizer="adamw",
                            device="cuda")
    return time.perf_counter() - start, out["peak_bytes"], out["traced"]["note"]


def memtracker_time(layers: int, seq: int):
    start = time.perf_counter()
    with FakeTensorMode():
        model = bf16_model(layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ids = torch.zeros(1, seq, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for step in range(2):  # the first step makes AdamW's state, the second finds it there
                if step:
                    tracker.reset_mod_stats()  # MemTracker refuses a second iteration without it
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        peak = sum(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].get(k, 0) for k in ("Total",))
    return time.perf_counter() - start, peak


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--seq", type=int, default=4096)
    a = p.parse_args()
    torch.set_num_threads(1)
    t_h, peak_h, note = headroom_time(a.layers, a.seq)
    print(f"headroom.estimate:        {t_h:7.1f} s   peak {peak_h:,} B ({peak_h / GiB:.2f} GiB; {note})", flush=True)
    t_m, peak_m = memtracker_time(a.layers, a.seq)
    print(f"MemTracker (fake mode):   {t_m:7.1f} s   peak {peak_m:,} B ({peak_m / GiB:.2f} GiB; every layer traced)",
          flush=True)
    print(f"headroom is {t_m / t_h:.1f}x faster on Llama-3-70B's shape ({a.layers} layers), batch 1 x {a.seq}, "
          "bf16 weights, AdamW")


if __name__ == "__main__":
    main()
