"""A plain PyTorch training loop over a small transformers model, on headroom's bundled corpus,
wrapped by headroom: a Monitor (per-phase memory by category, leak verdict), the OOM guard, and a
cpu budget that makes the cpu behave like a small card.

    ~/.cache/headroom/venv/bin/python examples/monitor_loop.py       (after `make build`)

It plants nothing: the leak verdict should say no leak. Change `keep = []` below into a list that
keeps each step's loss (`keep.append(loss)`) to see one found, with this file's line.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "build", "python"))  # the module `make build` assembles

import headroom  # noqa: E402  (first: the counting allocator sees every tensor from here on)
import torch  # noqa: E402
import transformers  # noqa: E402

torch.manual_seed(0)
text = open(os.path.join(HERE, "..", "data", "corpus.txt"), "rb").read()
tokens = torch.tensor(list(text), dtype=torch.long)  # byte-level: a vocabulary of 256

config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

SEQ, BATCH, STEPS = 128, 16, 12
est = headroom.estimate(config, batch=BATCH, seq=SEQ)
print(f"headroom's estimate of a step at batch {BATCH}: {headroom.format_bytes(est['peak_bytes'])}")

mon = headroom.Monitor("cpu", model=model, optimizer=opt)
guard = headroom.Guard(opt, monitor=mon, clip_grad_norm=1.0)
# A card smaller than the batch needs: the guard halves the micro-batch and accumulates.
headroom.cpu_budget(headroom._core.cpu_live_bytes() + int(0.8 * est["peak_bytes"]))
keep = []


def loss_of(rows):
    return model(input_ids=rows, labels=rows).loss


for step in range(STEPS):
    starts = torch.randint(0, len(tokens) - SEQ, (BATCH,))
    batch = torch.stack([tokens[s:s + SEQ] for s in starts.tolist()])
    loss = guard(loss_of, batch)
    print(f"step {step + 1:>2}: loss {loss:.3f}  micro-batch {guard.micro_batch}  peak "
          f"{headroom.format_bytes(mon.steps[-1]['peak_bytes'])}")

headroom.cpu_budget(None)
print()
print(mon.summary())
verdict = mon.leak()
print("leak:", "DETECTED" if verdict["detected"] else "none", "-", verdict["reason"])
for site in verdict["sites"]:
    print("  ", site["description"])
