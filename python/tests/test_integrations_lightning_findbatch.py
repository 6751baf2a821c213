"""FindBatch in Lightning's real Trainer on the cpu under a headroom cpu budget, on a GPT-2-shaped model
(GPT-2's width and vocabulary, one layer): the size it finds fits and one more row does not, by plain
torch steps outside Lightning under the same budget; the search leaves the weights, the optimizer's
state and torch's random state as they were, and the fit trains at the size found; bad input is
refused in one line.

The embedding (tied to the head) is frozen to keep the test fast: fully trained, its two gradients'
sum at the end of backward is the peak of every step under ~700 tokens, and steps past that take
seconds each here. The other parameters train with AdamW."""
import gc
import logging

import headroom
import lightning
import numpy as np
import pytest
import torch
import transformers
from headroom.integrations._find_batch import FindBatch

SEQ, ROWS = 16, 64
BUDGET = "340MiB"  # the answer is about ten rows; one row is about 10.7 MiB


def gpt2():
    config = transformers.GPT2Config(n_layer=1, n_positions=SEQ)  # n_embd 768, vocab 50,257, tied head
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.wte.weight.requires_grad_(False)
    return model


def tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50257, (ROWS, SEQ), generator=g)


def adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt2()
        self.tokens = tokens()
        self.batch_size = 2

    def training_step(self, batch, _):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss)  # Lightning refuses this outside its loop: the search must cope
        return loss

    def configure_optimizers(self):
        return adamw(self.model)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.tokens, batch_size=self.batch_size)


def numpy_copy(value):
    """Copies outside headroom's counting (numpy's memory), so that keeping them moves no budget."""
    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: numpy_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [numpy_copy(v) for v in value]
    return value


def differences(a, b, where=""):
    """Where two numpy_copy trees differ."""
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b) else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [where + " (keys)"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return [where + " (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


class Before(lightning.Callback):
    """Before FindBatch: one real update (so that the optimizer holds state worth restoring), then
    copies of the weights, the optimizer's state and torch's random state."""

    def on_fit_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0].optimizer if hasattr(trainer.optimizers[0], "optimizer") \
            else trainer.optimizers[0]
        pl_module.model(input_ids=pl_module.tokens[:1], labels=pl_module.tokens[:1]).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.weights = numpy_copy(pl_module.state_dict())
        self.optimizer = numpy_copy(optimizer.state_dict())
        self.rng = torch.get_rng_state().numpy().copy()


class After(lightning.Callback):
    """After FindBatch: the random state at once; the weights and the optimizer's state when training
    starts; the rows of every batch trained on."""

    def __init__(self, before):
        self.before = before
        self.rows = []

    def on_fit_start(self, trainer, pl_module):
        self.rng_equal = np.array_equal(torch.get_rng_state().numpy(), self.before.rng)

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self.weight_differences = differences(self.before.weights, numpy_copy(pl_module.state_dict()), "weights")
        self.optimizer_differences = differences(self.before.optimizer, numpy_copy(optimizer.state_dict()),
                                                 "optimizer")
        self.optimizer_steps = [float(s["step"]) for s in optimizer.state_dict()["state"].values()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append(batch.shape[0])


def trainer_for(tmp_path, callbacks, max_steps=1):
    return lightning.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, default_root_dir=str(tmp_path), callbacks=callbacks)


def plain_step_fits(n):
    """One plain torch step (forward, backward, AdamW's update) at n rows under the budget, the
    optimizer's state made by an update before it as in the Lightning run."""
    model = gpt2()
    model.train()
    optimizer = adamw(model)
    data = tokens()
    model(input_ids=data[:1], labels=data[:1]).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    batch = data[:n].clone()
    try:
        with headroom.cpu_budget(BUDGET):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            loss = None
            optimizer.step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, optimizer
        gc.collect()


def test_find_batch_finds_the_largest_that_fits_and_leaves_the_run_as_it_was(tmp_path, caplog):
    """(a) the size found fits and one more row does not, by plain steps outside Lightning; (b) after
    the search the weights, the optimizer's state (one update's) and torch's random state are as
    before, and the fit trains at the size found; the search was seeded by the estimate."""
    gc.collect()
    module = Module()
    before = Before()
    find = FindBatch()
    after = After(before)
    trainer = trainer_for(tmp_path, [before, find, after])
    with caplog.at_level(logging.INFO, logger="headroom"), headroom.cpu_budget(BUDGET):
        trainer.fit(module)
    found = find.optimal_batch_size
    assert found is not None and 4 <= found <= 32, find.search_log
    assert find.trials == len(find.search_log) >= 2
    assert find.steps == find.trials  # the optimizer held state already: no update before the trials
    assert find.seed.startswith("the estimate"), find.seed
    assert find.budget_bytes == headroom.parse_size(BUDGET)
    assert module.batch_size == found
    # (b)
    assert after.rng_equal
    assert after.weight_differences == []
    assert after.optimizer_differences == []
    assert after.optimizer_steps and set(after.optimizer_steps) == {1.0}  # the one update before, not the trials'
    assert after.rows == [found]
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"batch_size={found} after {find.trials} trial steps" in m and "budget 340 MiB" in m
               for m in messages), messages
    assert not list(tmp_path.glob(".find_batch_*"))  # the saved state is gone
    log = find.search_log
    # Lightning gives every callback the module's log and log_dict (bound methods): the callback too
    # keeps the module alive.
    del trainer, module, before, after, find
    gc.collect()
    # (a)
    assert plain_step_fits(found), (found, log)
    assert not plain_step_fits(found + 1), (found, log)

class Tiny(lightning.LightningModule):
    def __init__(self, **attributes):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        for name, value in attributes.items():
            setattr(self, name, value)

    def training_step(self, batch, _):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=getattr(self, "batch_size", 2))


@pytest.mark.parametrize("case", ["no attribute", "loader to fit", "no budget"])
def test_find_batch_refuses_bad_input_in_one_line(tmp_path, case):
    module = Tiny(rows=2) if case == "no attribute" else Tiny(batch_size=2)
    trainer = trainer_for(tmp_path, [FindBatch()])
    loader = torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=2)
    with pytest.raises(ValueError) as error:
        trainer.fit(module, loader if case == "loader to fit" else None)
    message = str(error.value)
    assert "\n" not in message and "accepted:" in message, message
    expected = {"no attribute": ["batch_arg_name='batch_size'", "no such attribute", "hparams", "datamodule"],
                "loader to fit": ["passed straight to fit()", "train_dataloader()"],
                "no budget": ["needs a budget", "headroom.cpu_budget"]}[case]
    assert all(part in message for part in expected), message


def test_find_batch_without_an_estimate_searches_unseeded_up_to_the_dataset(tmp_path, caplog):
    """A config the estimate refuses: the search runs unseeded and says why; it stops at the
    dataset's rows (8), which all fit."""
    module = Tiny(batch_size=2)
    find = FindBatch(config={"model_type": "no_such_family"}, seq=4)
    with caplog.at_level(logging.INFO, logger="headroom"), headroom.cpu_budget("1GiB"):
        trainer_for(tmp_path, [find]).fit(module)
    assert find.seed.startswith("none: the estimate failed"), find.seed
    assert "unseeded search: the estimate failed" in caplog.text
    assert find.optimal_batch_size == module.batch_size == 8
    assert max(t["batch"] for t in find.search_log) == 8
    assert find.steps == find.trials + 1  # SGD held no state: one update at batch 1 before the trials
