"""Trials of headroom's FindBatch against Lightning's BatchSizeFinder (mode "power" and "binsearch",
its defaults otherwise: 3 steps a trial, from batch 2) on the same models, in one run, on the cpu
under a headroom cpu budget: the batch each finds, the sizes it tried, the training steps it ran,
its seconds, and whether the size found fits — one plain torch step (forward, backward, AdamW's
update, after a first update has made the optimizer's state) at that size under the same budget;
for FindBatch also one row more.

Models: GPT-2's shape (width 768, vocabulary 50,257, tied head) with 2 layers, every parameter
trained, 64 tokens a row; Qwen3-0.6B's shape (hidden 1024, intermediate 3072, vocabulary 151,936,
16 heads, 8 KV heads, head_dim 128, tied head) with 2 layers, the embedding (and so the tied head)
frozen and the rest trained, 32 tokens a row (fully trained, its steps would pass 1,000 tokens
before the activations set the peak: minutes a step on a small cpu). AdamW, fp32.

Lightning's is_oom_error does not recognise the error headroom's cpu budget raises ("CPU out of
memory (headroom budget)"): this bench, and only it, patches it to accept torch.OutOfMemoryError,
and says so when it starts.

    PYTHONPATH=build/python OMP_NUM_THREADS=2 stdbuf -oL python bench/find_batch_vs_lightning.py [--models gpt2,qwen3]
"""
import argparse
import gc
import logging
import os
import tempfile
import time
import traceback

import headroom  # noqa: F401  (first: the counting allocator the cpu budget needs)
import lightning
import lightning.pytorch.tuner.batch_size_scaling as scaling
import lightning.pytorch.utilities.memory as lightning_memory
import torch
import transformers
from headroom.integrations._find_batch import FindBatch
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.utilities.exceptions import _TunerExitException

ROWS = 256  # the dataset: more rows than any finder reaches


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_positions=64))


def qwen3():
    config = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, vocab_size=151936,
                                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                                      head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


# name: (model, vocabulary, tokens a row, budget, what is trained). The budgets put the answer at
# about 20 and 12 rows (chosen with headroom.estimate, at half a row past the 20th and the 12th).
MODELS = {
    "gpt2": (gpt2, 50257, 64, "1530MiB", "all"),
    "qwen3": (qwen3, 151936, 32, "1745MiB", "all but the embedding"),
}


def patch_lightning_oom_check():
    original = lightning_memory.is_oom_error

    def is_oom_error(exception):
        return isinstance(exception, torch.OutOfMemoryError) or original(exception)

    lightning_memory.is_oom_error = is_oom_error
    scaling.is_oom_error = is_oom_error  # the name batch_size_scaling imported
    print("bench: lightning's is_oom_error (lightning.pytorch.utilities.memory, and the name "
          "lightning.pytorch.tuner.batch_size_scaling imported) patched to also accept torch.OutOfMemoryError: "
          "headroom's cpu budget raises 'CPU out of memory (headroom budget)', which it does not recognise", flush=True)


class Module(lightning.LightningModule):
    def __init__(self, make, vocab, seq):
        super().__init__()
        self.model = make()
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (ROWS, seq), generator=g)
        self.batch_size = 2
        self.rows = []  # every training_step's rows

    def training_step(self, batch, _):
        self.rows.append(batch.shape[0])
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.tokens, batch_size=self.batch_size)


def timed(finder_class):
    """The finder, timed; the fit ends when its search does."""

    class Timed(finder_class):
        def on_fit_start(self, trainer, pl_module):
            pl_module.rows.clear()
            start = time.perf_counter()
            super().on_fit_start(trainer, pl_module)
            self.seconds = time.perf_counter() - start
            raise _TunerExitException()

    return Timed


def runs(sizes):
    """Consecutive equal sizes once each: the sizes tried, in order."""
    out = []
    for n in sizes:
        if not out or out[-1] != n:
            out.append(n)
    return out


def search(name, finder, directory):
    make, vocab, seq, budget, _ = MODELS[name]
    module = Module(make, vocab, seq)
    callback = timed(FindBatch)() if finder == "FindBatch" else timed(BatchSizeFinder)(mode=finder)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                default_root_dir=directory, callbacks=[callback])
    error = None
    try:
        with headroom.cpu_budget(budget):
            trainer.fit(module)
    except Exception as e:  # a finder that fails is a row of the table too
        frames = traceback.extract_tb(e.__traceback__)
        frame = next((f for f in reversed(frames) if f.filename.endswith("batch_size_scaling.py")), frames[-1])
        error = f"{type(e).__name__} in `{frame.line}` ({os.path.basename(frame.filename)}:{frame.lineno})"
        print(f"  {finder}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
    rows = list(module.rows)
    out = dict(found=None if error else callback.optimal_batch_size, seconds=getattr(callback, "seconds", None),
               steps=len(rows), tried=runs(rows), error=error)
    if finder == "FindBatch":  # its trials are its log; a first update at batch 1 made the optimizer's state
        out.update(tried=[t["batch"] for t in callback.search_log], warm_up=callback.steps - callback.trials,
                   seed=callback.seed)
    del trainer, callback, module
    gc.collect()
    return out


def plain_step_fits(name, n):
    make, vocab, seq, budget, _ = MODELS[name]
    model = make()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (n, seq), generator=g)
    model(input_ids=data[:1], labels=data[:1]).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    try:
        with headroom.cpu_budget(budget):
            loss = model(input_ids=data, labels=data).loss
            loss.backward()
            loss = None
            optimizer.step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, optimizer
        gc.collect()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,qwen3")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    patch_lightning_oom_check()
    print(f"torch {torch.__version__}, lightning {lightning.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    table = []
    with tempfile.TemporaryDirectory() as directory:
        for name in args.models.split(","):
            _, _, seq, budget, trained = MODELS[name]
            print(f"\n{name}: 2 layers, {seq} tokens a row, trained: {trained}, budget {budget}", flush=True)
            results = {}
            for finder in ("FindBatch", "power", "binsearch"):
                r = search(name, finder, directory)
                results[finder] = r
                print(f"  {finder}: {r}", flush=True)
            checked = {}
            for finder, r in results.items():
                sizes = [r["found"]] if r["found"] else []
                if finder == "FindBatch" and r["found"]:
                    sizes.append(r["found"] + 1)
                for n in sizes:
                    if n not in checked:
                        checked[n] = plain_step_fits(name, n)
                        print(f"  plain step at {n} rows under {budget}: {'fits' if checked[n] else 'does not fit'}",
                              flush=True)
            for finder, r in results.items():
                fits = "—" if not r["found"] else "yes" if checked[r["found"]] else "NO"
                if finder == "FindBatch" and r["found"]:
                    fits += f" (+1: {'fits' if checked[r['found'] + 1] else 'does not'})"
                label = "FindBatch" if finder == "FindBatch" else f"BatchSizeFinder {finder}"
                seconds = f"{r['seconds']:.1f}" if r["seconds"] is not None else "—"
                tried = f"{len(r['tried'])}: {', '.join(map(str, r['tried']))}"
                if r.get("warm_up"):
                    tried += " (after an update at 1)"
                table.append(f"| {name} | {budget} | {label} | {r['found'] if r['found'] else 'none: ' + r['error']} | "
                             f"{tried} | {r['steps']} | {seconds} | {fits} |")
    print("\n| model | budget | finder | batch found | trials: sizes tried | training steps | seconds | fits |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | --- |")
    for line in table:
        print(line)
    print(flush=True)


if __name__ == "__main__":
    main()
