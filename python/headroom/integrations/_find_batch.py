"""FindBatch: Lightning's batch-size finder done as ``headroom fit`` does it — the largest micro-batch
that fits, in the fewest real trial steps, seeded by headroom's estimate when it can make one.

::

    from headroom.integrations.lightning import FindBatch
    trainer = lightning.Trainer(callbacks=[FindBatch()])
    with headroom.cpu_budget("8GiB"):   # on the cpu: the card to fit; on cuda: the card's free memory
        trainer.fit(module)             # module.batch_size: the largest that fits, then trained with it

Before training starts (``on_fit_start``) it searches with :func:`headroom.find_max_batch`: each
trial sets the batch-size attribute, builds the train loader, takes its first batch and runs one
training step on it (``training_step``, backward and the first optimizer's update) under the
budget; when the optimizer holds no state yet, one update at batch 1 makes it first, so that every
trial measures a step like the ones that follow the first. When the LightningModule holds a
transformers model (or ``config=`` is given) and the estimate can be made, the estimate seeds the
search (the Trainer's precision, the optimizer, the sequence length, the frozen parameters); the
trials then correct it. Afterwards the weights, the optimizer's state and torch's random state are
those from before the search (saved to a file beside the Trainer's checkpoints, not kept in
memory), the attribute holds the size found, and the fit trains with it.

Lightning's private parts it uses, as its own ``BatchSizeFinder`` does: ``trainer.fit_loop.
_data_source.is_module()`` (a loader passed straight to ``fit()`` cannot be re-sized), and
``trainer.fit_loop._combined_loader = None`` (and the validation loop's) so that the fit loop builds
its loaders again, at the size found, when it starts. Unlike ``BatchSizeFinder`` it does not build
them itself (``setup_data()``): building one draws from torch's random state, which the search has
just put back, so the fit draws what it would have drawn without the callback. During the trials
``self.log``/``self.log_dict`` do nothing (Lightning refuses them outside its loop). Lightning gives
every callback the module's ``log`` and ``log_dict`` when a fit starts (bound methods, which keep the
module alive as long as the callback): this one lets them go when the fit ends. Tested with
lightning 2.6.
"""
from __future__ import annotations

import collections.abc
import logging
import os
import tempfile
from typing import Any, Callable, Dict, List, Optional

import lightning
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

from .. import _core, format_bytes, parse_size
from ..guard import _rows, find_max_batch
from ._common import LIGHTNING_PRECISIONS, optimizer_name, transformers_model

_log = logging.getLogger("headroom")


class _ShortBatch(torch.OutOfMemoryError):
    """The loader gave fewer rows than asked for: the trial counts as one that does not fit."""


def _seq_of(batch: Any) -> Optional[int]:
    """The sequence length of a batch: its input ids' last dimension (``input_ids`` in a mapping, else
    the first integer tensor of two or more dimensions)."""
    if isinstance(batch, collections.abc.Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            return int(ids.shape[-1])
        values = list(batch.values())
    elif isinstance(batch, torch.Tensor):
        values = [batch]
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return None
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point() and not v.is_complex():
            return int(v.shape[-1])
    return None


def _cloned(value: Any) -> Any:
    """``value`` with every tensor in it copied (dicts, lists and tuples followed)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cloned(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


class FindBatch(lightning.Callback):
    """``lightning.Trainer(callbacks=[FindBatch()])``: before training, the largest micro-batch whose
    training step fits, set on the module (see the module's documentation).

    ``batch_arg_name``: the attribute holding the train loader's batch size, looked for where
    Lightning's ``BatchSizeFinder`` looks (the LightningModule, its ``hparams``, the datamodule).
    ``budget``: the memory to fit in (bytes, or text such as ``"8GiB"``); by default, on the cpu the
    :class:`headroom.cpu_budget` in force (without one it is an error), on cuda what this process
    holds and the card's free memory. ``limit``: the largest size tried (also at most the dataset's
    rows). ``seq``: the sequence length for the estimate, when the first batch has no input ids.
    ``config``: a transformers config (or its dict) to estimate with, when the module holds no
    transformers model.

    After the search: ``optimal_batch_size``, ``trials`` (the search's steps), ``steps`` (all the
    training steps it ran: the trials, and one update at batch 1 before them when the optimizer held
    no state yet, so that every trial measures a step with it), ``search_log`` (each trial:
    ``{"batch", "fits", "peak_bytes"}``), ``seed`` (what seeded the search, or why nothing did) and
    ``budget_bytes``.
    """

    def __init__(self, batch_arg_name: str = "batch_size", budget: Any = None, limit: int = 4096,
                 seq: Optional[int] = None, config: Any = None):
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"batch_arg_name={batch_arg_name!r}: accepted: the name of the attribute holding the "
                             "batch size, such as 'batch_size'")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit={limit!r}: accepted: the largest batch to try, a whole number, 1 or more")
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
            raise ValueError(f"seq={seq!r}: accepted: None (the first batch's input ids say) or tokens a row, "
                             "1 or more")
        self.batch_arg_name = batch_arg_name
        self.budget = budget
        self.budget_bytes: Optional[int] = None if budget is None else parse_size(budget)
        self.limit = limit
        self.seq = seq
        self.config = config
        self.optimal_batch_size: Optional[int] = None
        self.trials = 0
        self.steps = 0
        self.search_log: List[Dict[str, Any]] = []
        self.seed = ""

    def setup(self, trainer, pl_module, stage: Optional[str] = None) -> None:
        if stage != "fit":
            return
        name = f"FindBatch(batch_arg_name={self.batch_arg_name!r})"
        if trainer.world_size > 1:
            raise ValueError(f"FindBatch with {trainer.world_size} processes: not built for distributed training; "
                             "accepted: one device")
        if not pl_module.automatic_optimization:
            raise ValueError("FindBatch with manual optimization: its training_step runs its own update; accepted: "
                             "automatic optimization (training_step returns the loss)")
        if not trainer.fit_loop._data_source.is_module():
            raise ValueError("FindBatch with a dataloader passed straight to fit(): it cannot be re-sized; accepted: "
                             "train_dataloader() on the LightningModule or a LightningDataModule")
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ValueError(f"{name}: no such attribute on the LightningModule, its hparams or the datamodule; "
                             "accepted: the name of the one of these that holds the train loader's batch size")

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run:
            _log.info("headroom FindBatch: skipped (fast_dev_run)")
            return
        self._search(trainer, pl_module)

    # The pieces of a trial.

    def _hook(self, trainer, pl_module, name: str):
        dm = trainer.datamodule
        return getattr(dm, name) if dm is not None and is_overridden(name, dm) else getattr(pl_module, name)

    def _loader(self, trainer, pl_module, n: int):
        lightning_setattr(pl_module, self.batch_arg_name, n)
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        loader = source.train_dataloader()
        if isinstance(loader, (collections.abc.Mapping, list, tuple)) or \
                type(loader).__name__ == "CombinedLoader":
            raise TypeError(f"FindBatch: train_dataloader() returned a {type(loader).__name__}: accepted: one "
                            "DataLoader (or one iterable of batches)")
        return loader

    def _first_batch(self, trainer, pl_module, n: int) -> Any:
        iterator = iter(self._loader(trainer, pl_module, n))
        try:
            batch = next(iterator)
        except StopIteration:
            raise ValueError("FindBatch: train_dataloader() gave no batch: accepted: a loader with one or "
                             "more") from None
        del iterator  # worker processes, if any, end here
        device = pl_module.device
        batch = self._hook(trainer, pl_module, "on_before_batch_transfer")(batch, 0)
        batch = self._hook(trainer, pl_module, "transfer_batch_to_device")(batch, device, 0)
        return self._hook(trainer, pl_module, "on_after_batch_transfer")(batch, 0)

    def _seeding(self, trainer, pl_module, optimizer, probe: Any, device: str) -> Dict[str, Any]:
        """find_max_batch's predict= from the estimate, or {} (with self.seed saying why not)."""
        config, settings = self.config, {}
        model = transformers_model(pl_module) if config is None else None
        if model is not None:
            config = model.config
            # Frozen parameters, by their Hugging Face names, as estimate's finetune="freeze:..." takes them.
            named = list(model.named_parameters())
            frozen = [name for name, p in named if not p.requires_grad]
            if frozen and len(frozen) < len(named):
                settings["finetune"] = "freeze:" + ",".join(frozen)
        if config is None:
            self.seed = "none: no transformers model in the module (config= names one)"
            return {}
        if hasattr(config, "to_dict"):
            d = config.to_dict()
            if getattr(config, "model_type", None):
                d.setdefault("model_type", config.model_type)
            config = d
        precision = LIGHTNING_PRECISIONS.get(str(trainer.precision))
        if precision is None:
            self.seed = f"none: the estimate has no precision {trainer.precision!r}"
            return {}
        opt = optimizer_name(optimizer) if optimizer is not None else "sgd"
        if opt is None:
            self.seed = f"none: the estimate does not predict {type(optimizer).__name__}'s update"
            return {}
        seq = self.seq or _seq_of(probe)
        if seq is None:
            self.seed = "none: the first batch has no input ids to take the sequence length from (seq= gives it)"
            return {}
        settings.update(seq=seq, precision=precision, optimizer=opt)
        from ..predict import estimate

        try:
            estimate(config, batch=1, device=device, **settings)
        except Exception as e:  # a model headroom cannot estimate: the search measures instead
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.seed = f"none: the estimate failed ({first})"
            return {}
        self.seed = f"the estimate (seq {seq}, {precision}, {opt}" + \
            (f", {len(settings['finetune'].split(','))} parameters frozen)" if "finetune" in settings else ")")

        def predict(n: int) -> int:  # find_max_batch's own config= cannot name the optimizer (its optimizer=)
            return estimate(config, batch=n, device=device, **settings)["peak_bytes"]

        return dict(predict=predict)

    def _given_budget(self, cuda: bool) -> Optional[int]:
        """The budget given, or on the cpu the headroom.cpu_budget in force (cuda: None, the free memory)."""
        budget = self.budget_bytes
        if budget is None and not cuda:
            budget = _core.cpu_budget()
            if budget is None:
                raise ValueError("FindBatch on the cpu needs a budget: accepted: FindBatch(budget='8GiB') or a "
                                 "headroom.cpu_budget in force")
        return budget

    def _limit(self, trainer, pl_module) -> int:
        """The largest batch tried: the limit, or the dataset's length when it has one."""
        limit = self.limit
        loader = self._loader(trainer, pl_module, 1)
        try:
            limit = max(1, min(limit, len(loader.dataset)))
        except (AttributeError, TypeError):  # no dataset, or one without a length: short batches say
            pass
        return limit

    def _batch_maker(self, trainer, pl_module) -> Callable[[int], Any]:
        """A batch of n rows from the loader, refused when it has fewer."""
        def make_batch(n: int) -> Any:
            batch = self._first_batch(trainer, pl_module, n)
            rows = _rows(batch)
            if rows < n:
                raise _ShortBatch(f"the loader gave {rows} rows for a batch of {n}")
            return batch
        return make_batch

    def _search(self, trainer, pl_module) -> None:
        device = pl_module.device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"FindBatch on {device}: accepted: cpu (under a headroom.cpu_budget) or cuda")
        cuda = device.type == "cuda"
        budget = self._given_budget(cuda)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, if any

        modes = {m: m.training for m in pl_module.modules()}
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        directory = trainer.default_root_dir
        os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=".find_batch_", suffix=".pt", dir=directory)
        os.close(fd)
        saved_log = pl_module.__dict__.get("log"), pl_module.__dict__.get("log_dict")
        try:
            torch.save({"model": pl_module.state_dict(),
                        "optimizer": optimizer.state_dict() if optimizer is not None else None}, path)
            pl_module.train()
            pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None

            limit = self._limit(trainer, pl_module)
            probe = self._first_batch(trainer, pl_module, 1)
            seeding = self._seeding(trainer, pl_module, optimizer, probe, str(device))
            del probe
            if not seeding:
                _log.info("headroom FindBatch: unseeded search: %s", self.seed[len("none: "):])
            if cuda and budget is None:
                budget = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)

            make_batch, step_fn = self._batch_maker(trainer, pl_module), _step_fn(trainer, pl_module)
            # The trials measure the steps that follow the first, whose update has made the optimizer's
            # state: when it holds none yet, one update at batch 1 makes it first (undone afterwards).
            self.steps = 0
            warm = True
            if optimizer is not None and not optimizer.state:
                warm = self._warm_up(trainer, pl_module, optimizer, step_fn, cuda, budget)
            result = find_max_batch(step_fn, make_batch, budget=budget, optimizer=optimizer, model=pl_module,
                                    limit=limit, device=str(device), **seeding) if warm else \
                {"max_batch": 0, "trials": 0, "log": []}
            self.steps += int(result["trials"])
        finally:
            for attr, value in zip(("log", "log_dict"), saved_log):
                if value is None:
                    pl_module.__dict__.pop(attr, None)
                else:
                    pl_module.__dict__[attr] = value
            self._restore(pl_module, optimizer, path, rng, cuda_rng, modes)

        self.search_log = result["log"]
        self.trials = int(result["trials"])
        self.budget_bytes = int(budget)
        found = int(result["max_batch"])
        if found < 1:
            raise torch.OutOfMemoryError(
                f"FindBatch: not even a micro-batch of 1 fits in {format_bytes(budget)} "
                f"({self.trials} trial{'s' if self.trials != 1 else ''}): accepted: a larger budget, or a smaller step "
                "(precision, checkpointing, a chunked loss)")
        self.optimal_batch_size = found
        lightning_setattr(pl_module, self.batch_arg_name, found)
        trainer.fit_loop._combined_loader = None  # the fit loop builds it again, at the size found
        trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
        _log.info("headroom FindBatch: %s=%d after %d trial steps (seeded by %s), budget %s",
                  self.batch_arg_name, found, self.trials, self.seed if not self.seed.startswith("none") else "nothing",
                  format_bytes(budget))

    def _warm_up(self, trainer, pl_module, optimizer, step_fn, cuda: bool, budget: int) -> bool:
        """One update at batch 1 under the budget; False when it does not fit."""
        previous = _core.cpu_budget()
        try:
            if not cuda:
                _core.set_cpu_budget(budget)
            self.steps += 1
            step_fn(self._first_batch(trainer, pl_module, 1)).backward()
            optimizer.step()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            if not cuda:
                _core.set_cpu_budget(previous)
            optimizer.zero_grad(set_to_none=True)
            pl_module.zero_grad(set_to_none=True)

    @staticmethod
    def _restore(pl_module, optimizer, path: str, rng, cuda_rng, modes) -> None:
        """Weights, optimizer state, random state and train/eval modes as before the search; what the
        trials left (their optimizer state, gradients) released first."""
        try:
            pl_module.zero_grad(set_to_none=True)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
                optimizer.state.clear()
            if os.path.getsize(path) > 0:
                # Mapped from the file: the weights are copied into the parameters, never held twice.
                saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
                pl_module.load_state_dict(saved["model"])
                if optimizer is not None:
                    # The optimizer keeps what it is given: its own copies, not the file's pages.
                    optimizer.load_state_dict(_cloned(saved["optimizer"]))
                del saved
        finally:
            os.remove(path)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            for m, training in modes.items():
                m.training = training

    def teardown(self, trainer, pl_module, stage: Optional[str] = None) -> None:
        # Lightning's bound log and log_dict: the module is not kept alive by this callback.
        self.__dict__.pop("log", None)
        self.__dict__.pop("log_dict", None)


def _step_fn(trainer, pl_module) -> Callable[[Any], torch.Tensor]:
    """The module's training_step under the trainer's precision: its loss."""
    def step_fn(batch: Any) -> torch.Tensor:
        with trainer.precision_plugin.train_step_context():
            out = pl_module.training_step(batch, 0)
        if isinstance(out, collections.abc.Mapping):
            out = out.get("loss")
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"FindBatch: training_step returned {type(out).__name__}: accepted: the loss, "
                            "or a dict holding it as 'loss'")
        return out
    return step_fn
