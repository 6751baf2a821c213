"""The Monitor's cost on a real training loop: a small transformers Llama, AdamW, on cpu.

Prints the median step time of the same loop with the counting allocator passing allocations
through uncounted (as without headroom), bare (counted, as after `import headroom`), with a Monitor
(phases, categories, end_step), and with a Monitor naming each allocation's Python line
(python_frames, the default on cpu), as ratios measured in one run, interleaved in rotating order so
that drift of the machine hits all alike: the variants take turns step by step.

    ~/.cache/headroom/venv/bin/python bench/monitor_overhead.py [--steps 20] [--rounds 8]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def setup(torch, transformers):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (8, 128))
    return model, opt, ids


def timed_steps(torch, model, opt, ids, steps, mon=None):
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        if mon is None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with mon.phase("forward"):
                loss = model(input_ids=ids, labels=ids).loss
            with mon.phase("backward"):
                loss.backward()
            with mon.phase("optimizer"):
                opt.step()
            with mon.phase("zero_grad"):
                opt.zero_grad(set_to_none=True)
            mon.end_step(loss=loss)
        times.append(time.perf_counter() - t)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "build", "python"))
    import headroom
    import torch
    import transformers

    torch.set_num_threads(1)
    model, opt, ids = setup(torch, transformers)
    timed_steps(torch, model, opt, ids, 2)  # warm-up: optimizer state, allocator caches
    frames = headroom.Monitor("cpu", model=model, optimizer=opt)
    plain = headroom.Monitor("cpu", model=model, optimizer=opt, python_frames=False)
    frames.close()  # origins only while a Monitor with python_frames is alive: made again per round
    runs = {"uncounted": [], "bare": [], "monitor": [], "monitor+frames": []}
    def one_step(name):
        """One timed step of `name`; the Monitor with python_frames lives only around its own steps."""
        if name == "uncounted":
            headroom._core.set_cpu_accounting(False)
            try:
                return timed_steps(torch, model, opt, ids, 1)
            finally:
                headroom._core.set_cpu_accounting(True)
        if name == "bare":
            return timed_steps(torch, model, opt, ids, 1)
        if name == "monitor":
            return timed_steps(torch, model, opt, ids, 1, plain)
        with headroom.Monitor("cpu", model=model, optimizer=opt) as mon:
            return timed_steps(torch, model, opt, ids, 1, mon)

    names = list(runs)
    for i in range(a.rounds * a.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:  # step by step, each in every place
            runs[name] += one_step(name)
    bare = statistics.median(runs["bare"])
    print(f"median step over {a.rounds} x {a.steps} steps (llama 4 layers, hidden 256, vocab 4096, batch 8 x 128, "
          f"AdamW, cpu, 1 thread):")
    for name, times in runs.items():
        m = statistics.median(times)
        print(f"  {name:<16} {1000 * m:8.2f} ms  ratio to bare {m / bare:.4f}")


if __name__ == "__main__":
    main()
