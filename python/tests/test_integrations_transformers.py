"""HeadroomCallback in transformers' real Trainer, on a GPT-2-shaped model (GPT-2's width and
vocabulary, two layers) on the cpu: the headroom/* values it logs are a plain headroom.Monitor's over
the same steps written by hand; a leak in the user's compute_loss is found, and named by the line
that made the tensors it keeps."""
import gc
import logging
import re

import headroom
import pytest
import torch
import transformers
from headroom.integrations.transformers import HeadroomCallback, step_metrics

BATCH, ACCUM, SEQ, STEPS = 2, 2, 32, 6


def gpt2(positions=64):
    config = transformers.GPT2Config(n_layer=2, n_positions=positions)  # n_embd 768, vocab 50,257, tied head
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def rows(n, seq=SEQ):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 50257, (seq,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def arguments(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                    gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=1e-4, optim="adamw_torch",
                    use_cpu=True, report_to=[], logging_steps=STEPS, save_strategy="no", disable_tqdm=True, seed=0)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def by_hand(tmp_path, data):
    """The Trainer's steps written out: the same model, optimizer (the Trainer's own construction:
    AdamW over two parameter groups), micro-batches, gradient norm and zero_grad, under a Monitor."""
    model = gpt2()
    optimizer = transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=data).create_optimizer()
    mon = headroom.Monitor("cpu", model=model, optimizer=optimizer)
    model.train()
    records = []
    for step in range(STEPS):
        with mon.phase("data"):
            start = step * BATCH * ACCUM
            micro = [transformers.default_data_collator(data[i:i + BATCH]) for i in range(start, start + BATCH * ACCUM, BATCH)]
        for batch in micro:
            with mon.phase("forward"):
                loss = model(**batch).loss / ACCUM
            with mon.phase("backward"):
                loss.backward()
        with mon.phase("backward"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with mon.phase("optimizer"):
            optimizer.step()
        with mon.phase("zero_grad"):
            model.zero_grad()
        records.append(mon.end_step(batch=BATCH, accum=ACCUM))
    mon.close()
    return records


def logged(trainer):
    return [h for h in trainer.state.log_history if "headroom/peak_bytes" in h]


def test_the_trainer_logs_what_a_monitor_measures_by_hand(tmp_path, caplog):
    data = rows(STEPS * BATCH * ACCUM)
    # By hand first, and gone before the Trainer's run: the counts are the whole process's (and what
    # earlier tests left to the cycle collector goes before either).
    gc.collect()
    expected = [step_metrics(r) for r in by_hand(tmp_path, data)]
    gc.collect()
    callback = HeadroomCallback()
    trainer = transformers.Trainer(model=gpt2(), args=arguments(tmp_path), train_dataset=data, callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="headroom"):
        trainer.train()
    history = logged(trainer)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    keys = {"headroom/peak_bytes", "headroom/live_bytes", "headroom/forward_peak_bytes",
            "headroom/backward_peak_bytes", "headroom/optimizer_peak_bytes", "headroom/weights_bytes",
            "headroom/gradients_bytes", "headroom/optimizer_bytes", "headroom/activations_bytes",
            "headroom/oom_recoveries"}
    for got, want in zip(history, expected):
        assert keys <= set(got)
        # The model states exactly. The peaks and what stays live within 4 KiB: the Trainer holds a
        # few scalars of its own (its running loss, the gradient norm) that the loop by hand does not.
        for k in ("headroom/weights_bytes", "headroom/gradients_bytes", "headroom/optimizer_bytes",
                  "headroom/oom_recoveries"):
            assert got[k] == want[k], k
        for k in keys - {"headroom/weights_bytes", "headroom/gradients_bytes", "headroom/optimizer_bytes",
                         "headroom/oom_recoveries"}:
            assert abs(got[k] - want[k]) <= 4096, (k, got[k], want[k])
    # By hand too: GPT-2's weights at two layers (the head tied), float32; AdamW's two moments.
    params = 50257 * 768 + 64 * 768 + 2 * (12 * 768 * 768 + 13 * 768) + 2 * 768
    assert history[-1]["headroom/weights_bytes"] == 4 * params
    assert history[-1]["headroom/optimizer_bytes"] >= 8 * params
    # The leak verdict, logged and written: nothing grows here.
    verdict = [h for h in trainer.state.log_history if "headroom/leak_detected" in h]
    assert len(verdict) == 1 and verdict[0]["headroom/leak_detected"] is False
    assert "headroom: no leak" in caplog.text


class LeakyTrainer(transformers.Trainer):
    kept = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        LeakyTrainer.kept.append(outputs.logits.detach())  # the leak: every micro-batch's logits
        return outputs.loss


def test_a_leak_in_compute_loss_is_found_and_named_by_where_it_was_made(tmp_path, caplog):
    data = rows(STEPS * BATCH * ACCUM)
    callback = HeadroomCallback(every=2)
    trainer = LeakyTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=data, callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="headroom"):
        trainer.train()
    LeakyTrainer.kept.clear()
    assert [h["step"] for h in logged(trainer)] == [2, 4, 6]  # every=2
    assert callback.verdict["detected"]
    # Two micro-batches' logits a step: 2 x 32 x 50,257 float32 each.
    assert callback.verdict["bytes_per_step"] == pytest.approx(2 * BATCH * SEQ * 50257 * 4, rel=0.01)
    # Named by where the kept tensors were made: GPT-2's forward, the logits, 2 a step over 4 steps.
    site = callback.verdict["sites"][0]
    assert site["phase"] == "forward" and "modeling_gpt2.py" in site["origin"]
    assert site["bytes"] == BATCH * SEQ * 50257 * 4 and site["count"] == 2 * 4
    assert "headroom: leak" in caplog.text


def gpt2_without_dropout():
    model = gpt2(positions=128)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # the halves would draw other masks than the whole
    return model


GUARD_STEPS = 2


def guarded_run(tmp_path, budget=None, guard=True, **settings):
    """Two steps of 8 x 128 tokens (unless `settings` say otherwise), where the step's peak is the
    second's head backward (AdamW's state made by the first), over the logits and their gradient
    (at fewer tokens it is the end of backward, where the tied embedding's two gradients are summed:
    halving the batch does not lower that)."""
    callback = HeadroomCallback(guard=guard, leak=False)
    settings = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, **settings}
    trainer = transformers.Trainer(
        model=gpt2_without_dropout(),
        args=arguments(tmp_path, max_steps=GUARD_STEPS, logging_steps=1, **settings),
        train_dataset=rows(8 * GUARD_STEPS, seq=128), callbacks=[callback])
    headroom.cpu_budget(budget)
    try:
        trainer.train()
    finally:
        headroom.cpu_budget(None)
    history = trainer.state.log_history
    out = dict(losses=[h["loss"] for h in history if "loss" in h],
               rates=[h["learning_rate"] for h in history if "loss" in h],
               peak=max(h["headroom/peak_bytes"] for h in logged(trainer)),
               recoveries=[h["headroom/oom_recoveries"] for h in logged(trainer)],
               callback_recoveries=callback.recoveries, micro_batch=callback.micro_batch)
    del trainer, callback
    gc.collect()
    return out


def test_the_guard_absorbs_an_oom_at_the_same_effective_batch(tmp_path, caplog):
    """Under a cpu budget one byte below the unconstrained run's peak, micro-batches of 8 run out of
    memory; the guard splits them and the run finishes with every step's loss within 1e-4 of the
    unconstrained run's, the Trainer's schedule untouched (same steps, same learning rates)."""
    gc.collect()
    free = guarded_run(tmp_path)
    assert free["callback_recoveries"] == 0 and len(free["losses"]) == GUARD_STEPS
    with caplog.at_level(logging.WARNING, logger="headroom"):
        tight = guarded_run(tmp_path, budget=free["peak"] - 1)
    assert tight["callback_recoveries"] >= 1 and sum(tight["recoveries"]) == tight["callback_recoveries"]
    assert tight["micro_batch"] < 8 and tight["peak"] < free["peak"]
    assert "out of memory with micro-batch 8; running the step again as 4 x 2" in caplog.text
    assert tight["rates"] == free["rates"]
    assert tight["losses"] == pytest.approx(free["losses"], rel=1e-4)


def test_without_the_guard_the_run_ends_with_a_plan_that_fits(tmp_path, caplog):
    """The same budget without the guard ends the run; the error names the step and phase and gives
    a plan for the same effective batch as TrainingArguments fields, which fits that budget: the
    Trainer, given them, runs its steps under it."""
    gc.collect()
    free = guarded_run(tmp_path, guard=False)
    budget = free["peak"] - 1
    with caplog.at_level(logging.ERROR, logger="headroom"), pytest.raises(torch.OutOfMemoryError):
        guarded_run(tmp_path, budget=budget, guard=False)
    text = caplog.text
    assert "ran out of memory in" in text and "with micro-batch 8 x 1 accumulated" in text
    assert "the last step that ran: peak" in text
    fields = re.search(r"TrainingArguments\((.*)\)", text)
    assert fields, text
    settings = eval(f"dict({fields.group(1)})")
    assert settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"] == 8
    settings = {k: v for k, v in settings.items() if k not in ("bf16", "fp16", "optim")}
    planned = guarded_run(tmp_path, budget=budget, guard=False, **settings)
    assert len(planned["losses"]) == GUARD_STEPS and planned["peak"] <= budget


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="every=0: accepted"):
        HeadroomCallback(every=0)
