"""HeadroomCallback in Lightning's real Trainer, on a GPT-2-shaped model (GPT-2's width and vocabulary,
two layers) on the cpu: the headroom/* values every logger receives are a plain headroom.Monitor's
over the same steps written by hand in Lightning's order; the leak verdict reaches the loggers."""
import gc
import logging

import headroom
import lightning
import pytest
import torch
import transformers
from headroom.integrations._common import step_metrics
from headroom.integrations.lightning import HeadroomCallback

BATCH, ACCUM, SEQ, STEPS = 2, 2, 32, 6


class Recorder(lightning.pytorch.loggers.Logger):
    """Every log_metrics call, as it came."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_positions=64)  # n_embd 768, vocab 50,257, tied head
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch, _):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50257, (STEPS * BATCH * ACCUM, SEQ), generator=g)


def by_hand(tokens):
    """Lightning's automatic optimization written out: each micro-batch's training_step, the
    gradients zeroed after the first one's, backward on the loss over the accumulation, the update."""
    module = Module()
    module.train()
    optimizer = module.configure_optimizers()
    mon = headroom.Monitor("cpu", model=module, optimizer=optimizer)
    records = []
    for step in range(STEPS):
        for k in range(ACCUM):
            start = (step * ACCUM + k) * BATCH
            with mon.phase("data"):
                batch = tokens[start:start + BATCH]
            with mon.phase("forward"):
                loss = module.training_step(batch, 0) / ACCUM
            if k == 0:
                with mon.phase("zero_grad"):
                    optimizer.zero_grad(set_to_none=True)
            with mon.phase("backward"):
                loss.backward()
        with mon.phase("optimizer"):
            optimizer.step()
        records.append(mon.end_step(batch=BATCH, accum=ACCUM))
    mon.close()
    return records


def test_the_loggers_receive_what_a_monitor_measures_by_hand(tmp_path, caplog):
    tokens = data()
    # Both runs from the same live bytes (the counts are the whole process's): what earlier tests
    # left to the cycle collector goes first, the run by hand before the Trainer's.
    gc.collect()
    expected = [step_metrics(r) for r in by_hand(tokens)]
    gc.collect()
    recorder = Recorder()
    callback = HeadroomCallback()
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=ACCUM,
                                callbacks=[callback], logger=recorder, log_every_n_steps=1,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader(tokens, batch_size=BATCH)
    with caplog.at_level(logging.INFO, logger="headroom"):
        trainer.fit(Module(), loader)
    logged = [m for _, m in recorder.calls if "headroom/peak_bytes" in m]
    assert len(logged) == STEPS
    exact = {"headroom/weights_bytes", "headroom/gradients_bytes", "headroom/optimizer_bytes",
             "headroom/oom_recoveries"}
    for got, want in zip(logged, expected):
        assert set(want) <= set(got)
        for k, v in want.items():
            # pl_module.log keeps float32: 24 significant bits. Beyond that the model states exactly;
            # the peaks and live bytes within 4 KiB (Lightning's own few scalars).
            rounding = abs(v) * 2.0 ** -23
            assert abs(got[k] - v) <= rounding + (0 if k in exact else 4096), (k, got[k], v)
    params = 50257 * 768 + 64 * 768 + 2 * (12 * 768 * 768 + 13 * 768) + 2 * 768
    assert logged[-1]["headroom/weights_bytes"] == pytest.approx(4 * params, rel=2.0 ** -23)
    verdict = [m for _, m in recorder.calls if "headroom/leak_detected" in m]
    assert len(verdict) == 1 and verdict[0]["headroom/leak_detected"] == 0.0
    assert callback.verdict is not None and not callback.verdict["detected"]
    assert "headroom: no leak" in caplog.text


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="every=0: accepted"):
        HeadroomCallback(every=0)
    with pytest.raises(NotImplementedError, match="guard=True"):
        HeadroomCallback(guard=True)
