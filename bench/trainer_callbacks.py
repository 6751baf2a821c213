"""The step-time overhead of headroom's Trainer callbacks: transformers' Trainer and Lightning's, each
run without a callback, with HeadroomCallback(leak=False), with HeadroomCallback() (the Python line
of every cpu allocation recorded, for the leak verdict) and with HeadroomCallback(guard=True,
leak=False) (no out-of-memory error here: what the guard costs when nothing fails), on a GPT-2-shaped model (GPT-2's width and
vocabulary, two layers) on the cpu. The settings alternate, `--rounds` times, so that the machine's
drift falls on each alike; each prints the median step time over the rounds' steps after the first,
and its ratio to the run without a callback, measured in this one run (goal: within 1%).

    PYTHONPATH=build/python python bench/trainer_callbacks.py [--steps N] [--rounds N] [--batch N] [--seq N]
"""
import argparse
import logging
import statistics
import tempfile
import time

import headroom  # noqa: F401  (first: the counting allocator the cpu figures come from)
import lightning
import torch
import transformers
from headroom.integrations import lightning as hl
from headroom.integrations import transformers as ht


def gpt2(seq):
    config = transformers.GPT2Config(n_layer=2, n_positions=seq, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class StepTimes(transformers.TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    # From the step's start (the micro-batches' forward and backward) to the end of every callback's
    # on_step_end before this one's: the callback's own work at the step's end is inside.
    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


class LightningStepTimes(lightning.Callback):
    def __init__(self):
        self.times, self._start = [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)


class Module(lightning.LightningModule):
    def __init__(self, seq):
        super().__init__()
        self.model = gpt2(seq)

    def training_step(self, batch, _):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def hf_run(callback, steps, batch, seq, tokens):
    timer = StepTimes()
    rows = [{"input_ids": t, "labels": t} for t in tokens]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps,
                                              optim="adamw_torch", use_cpu=True, report_to=[], logging_steps=steps,
                                              save_strategy="no", disable_tqdm=True, seed=0)
        callbacks = ([callback] if callback is not None else []) + [timer]  # the timer's step end last
        transformers.Trainer(model=gpt2(seq), args=args, train_dataset=rows, callbacks=callbacks).train()
    return timer.times[1:]


def lightning_run(callback, steps, batch, seq, tokens):
    timer = LightningStepTimes()
    callbacks = ([callback] if callback is not None else []) + [timer]  # the timer's batch end last
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(seq), torch.utils.data.DataLoader(tokens, batch_size=batch))
    return timer.times[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50257, (a.steps * a.batch, a.seq), generator=g)
    for name, run, make in (("transformers Trainer", hf_run, ht.HeadroomCallback),
                            ("lightning Trainer", lightning_run, hl.HeadroomCallback)):
        settings = (("no callback", lambda: None), ("HeadroomCallback(leak=False)", lambda: make(leak=False)),
                    ("HeadroomCallback()", lambda: make()),
                    ("HeadroomCallback(guard=True)", lambda: make(guard=True, leak=False)))
        times = {label: [] for label, _ in settings}
        for _ in range(a.rounds):
            for label, callback in settings:
                times[label] += run(callback(), a.steps, a.batch, a.seq, tokens)
        base = statistics.median(times["no callback"])
        print(f"\n{name}: GPT-2 shape, 2 layers, batch {a.batch} x {a.seq}, cpu, one thread, "
              f"{a.rounds} rounds x {a.steps - 1} timed steps")
        for label, _ in settings:
            m = statistics.median(times[label])
            print(f"  {label:<30} median step {m:.4f} s  ({m / base:.3f}x)")


if __name__ == "__main__":
    main()
