"""HeadroomCallback in Lightning's real Trainer, on a GPT-2-shaped model (GPT-2's width and vocabulary,
two layers) on the cpu: the headroom/* values every logger receives are a plain headroom.Monitor's
over the same steps written by hand in Lightning's order; the leak verdict reaches the loggers."""
import gc
import logging
import re
import weakref

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
    module = Module()
    with caplog.at_level(logging.INFO, logger="headroom"):
        trainer.fit(module, loader)
    # The callback, kept for its verdict, does not keep the model alive (Lightning gave it the
    # module's bound log methods).
    module_ref = weakref.ref(module)
    del trainer, module
    gc.collect()
    assert module_ref() is None
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


class Losses(lightning.Callback):
    """The loss Lightning hands on for each micro-batch (what its loggers and progress bar show)."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class Undropped(Module):
    def __init__(self):
        super().__init__()
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_positions=128))
        for m in self.model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0  # the halves would draw other masks than the whole


GUARD_STEPS = 2


def guarded_run(tmp_path, budget=None, guard=True, batch=8, accumulate=1, precision="32-true"):
    """Two updates of 8 x 128 tokens (unless told otherwise): GPT-2's width and vocabulary, two
    layers; the step's peak is the second's head backward (AdamW's state made by the first), over
    the logits and their gradient."""
    gc.collect()  # a run that failed before is held by its traceback's frames until collected
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50257, (8 * GUARD_STEPS, 128), generator=g)
    torch.manual_seed(0)
    module = Undropped()
    callback, losses, recorder = HeadroomCallback(guard=guard, leak=False), Losses(), Recorder()
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=GUARD_STEPS, accumulate_grad_batches=accumulate,
                                precision=precision, callbacks=[callback, losses], logger=recorder,
                                log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    headroom.cpu_budget(budget)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(tokens, batch_size=batch))
    finally:
        headroom.cpu_budget(None)
    logged = [m for _, m in recorder.calls if "headroom/peak_bytes" in m]
    # The peak exact from the callback's records (the loggers have float32's 24 bits).
    out = dict(losses=losses.losses, peak=max(r["peak_bytes"] for r in callback.steps),
               recoveries=[int(m["headroom/oom_recoveries"]) for m in logged], callback_recoveries=callback.recoveries,
               micro_batch=callback.micro_batch, weights=tmp_path / f"weights-{len(list(tmp_path.glob('weights-*')))}.pt",
               restored="training_step" not in module.__dict__ and "optimizer_zero_grad" not in module.__dict__)
    # On disk, not held: the next run's live bytes start where this one's did.
    torch.save([p.detach() for p in module.parameters()], out["weights"])
    del trainer, callback, module, losses, recorder
    gc.collect()
    return out


def weights(run):
    return torch.load(run["weights"])


def test_the_guard_absorbs_an_oom_at_the_same_effective_batch(tmp_path, caplog):
    """Under a cpu budget one byte below the unconstrained guarded run's peak, micro-batches of 8 run
    out of memory; the guard splits them and the run finishes with every micro-batch's loss within
    1e-4 of the unconstrained run's, and the same weights within a tenth of one AdamW update."""
    gc.collect()
    free = guarded_run(tmp_path)
    assert free["callback_recoveries"] == 0 and len(free["losses"]) == GUARD_STEPS and free["restored"]
    with caplog.at_level(logging.WARNING, logger="headroom"):
        tight = guarded_run(tmp_path, budget=free["peak"] - 1)
    assert tight["callback_recoveries"] >= 1 and sum(tight["recoveries"]) == tight["callback_recoveries"]
    assert tight["micro_batch"] < 8 and tight["peak"] < free["peak"] and tight["restored"]
    assert "out of memory with micro-batch 8; running the step again as 4 x 2" in caplog.text
    assert tight["losses"] == pytest.approx(free["losses"], rel=1e-4)
    # AdamW moves a weight by up to lr (1e-4) a step, whatever its gradient's size: where a gradient
    # is near zero, the parts' rounding shows in the update. Within a tenth of one update.
    for a, b in zip(weights(tight), weights(free)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_guard_keeps_accumulation_and_the_unguarded_run_when_nothing_fails(tmp_path):
    """With accumulation (4 x 2) and no budget, the guarded run (its own backward, zero_grad moved
    before the first micro-batch's forward) trains exactly as Lightning alone does."""
    gc.collect()
    plain = guarded_run(tmp_path, guard=False, batch=4, accumulate=2)
    guarded = guarded_run(tmp_path, guard=True, batch=4, accumulate=2)
    assert guarded["losses"] == plain["losses"] and len(plain["losses"]) == 2 * GUARD_STEPS
    for a, b in zip(weights(guarded), weights(plain)):
        assert torch.equal(a, b)


def test_without_the_guard_the_run_ends_with_a_plan_that_fits(tmp_path, caplog):
    """The same budget without the guard ends the run; the error names the step and phase and gives
    a plan for the same effective batch as Lightning settings, which fits that budget: the Trainer,
    given them, runs its updates under it."""
    gc.collect()
    free = guarded_run(tmp_path, guard=False)
    budget = free["peak"] - 1
    with caplog.at_level(logging.ERROR, logger="headroom"), pytest.raises(torch.OutOfMemoryError):
        guarded_run(tmp_path, budget=budget, guard=False)
    text = caplog.text
    assert "ran out of memory in" in text and "with micro-batch 8 x 1 accumulated" in text
    assert "the last step that ran: peak" in text
    found = re.search(r"lightning\.Trainer\((.*)\); module: (.*)", text)
    assert found, text
    trainer_args, module_args = eval(f"dict({found.group(1)})"), eval(f"dict({found.group(2)})")
    assert module_args["batch_size"] * trainer_args["accumulate_grad_batches"] == 8
    assert not module_args["gradient_checkpointing"]  # the module here has no switch for it
    planned = guarded_run(tmp_path, budget=budget, guard=False, batch=module_args["batch_size"],
                          accumulate=trainer_args["accumulate_grad_batches"], precision=trainer_args["precision"])
    assert len(planned["losses"]) == GUARD_STEPS * trainer_args["accumulate_grad_batches"] and planned["peak"] <= budget


class Manual(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.layer(batch).square().mean())
        optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_bad_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="every=0: accepted"):
        HeadroomCallback(every=0)
    # The guard splits what an automatic step's loss is over: a manual loop is refused, not half-guarded.
    module = Manual()
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, callbacks=[HeadroomCallback(guard=True)],
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"guard=True\) with manual optimization: accepted: automatic"):
        trainer.fit(module, torch.utils.data.DataLoader(torch.ones(4, 4), batch_size=2))
    assert "training_step" not in module.__dict__


class Plain(lightning.LightningModule):
    """No transformers model inside: nothing for headroom to plan from."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1024, 1024)

    def training_step(self, batch, _):
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def test_an_oom_in_a_module_headroom_cannot_plan_says_so(tmp_path, caplog):
    """The run ends with the out-of-memory error as it was; the explanation says why there is no plan,
    and the module is given back as it was (guard=True: its hooks unwrapped)."""
    gc.collect()
    module, data = Plain(), torch.ones(64, 1024)  # 4 MiB of weights, 4 MiB a micro-batch of rows
    trainer = lightning.Trainer(accelerator="cpu", max_steps=2, callbacks=[HeadroomCallback(guard=True, leak=False)],
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    headroom.cpu_budget(headroom._core.cpu_live_bytes() + 12 * 2**20)  # weights and gradients; not AdamW's state
    try:
        with caplog.at_level(logging.ERROR, logger="headroom"), pytest.raises(torch.OutOfMemoryError):
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
    finally:
        headroom.cpu_budget(None)
    assert "ran out of memory in optimizer" in caplog.text
    assert "no plan: the model has no transformers config for headroom to plan from" in caplog.text
    assert "training_step" not in module.__dict__ and "optimizer_zero_grad" not in module.__dict__


class Box:
    """A batch type headroom cannot count the rows of."""

    def __init__(self, x):
        self.x = x


class BoxedPlain(Plain):
    def training_step(self, batch, _):
        return self.layer(batch.x).square().mean()


def test_a_batch_whose_rows_cannot_be_told_is_measured_and_refused_only_by_the_guard(tmp_path):
    def fit(callback):
        recorder = Recorder()
        trainer = lightning.Trainer(accelerator="cpu", max_steps=2, callbacks=[callback], logger=recorder,
                                    log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, default_root_dir=str(tmp_path))
        loader = torch.utils.data.DataLoader(torch.ones(8, 1024), batch_size=4, collate_fn=lambda xs: Box(torch.stack(xs)))
        trainer.fit(BoxedPlain(), loader)
        return [m for _, m in recorder.calls if "headroom/peak_bytes" in m]

    logged = fit(HeadroomCallback(leak=False))
    assert len(logged) == 2 and all(m["headroom/weights_bytes"] == 4 * (1024 * 1024 + 1024) for m in logged)
    with pytest.raises(TypeError, match="batch of type Box: accepted: a tensor, or a mapping"):
        fit(HeadroomCallback(guard=True, leak=False))
