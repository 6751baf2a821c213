"""headroom inside your own PyTorch training script.

The same C++ core as the ``headroom`` command line, for a loop you wrote yourself::

    import headroom                      # before building the model: cpu tensors are counted from here on
    mon = headroom.Monitor("cpu", model=model, optimizer=opt)
    with mon.phase("forward"):
        loss = model(**batch).loss
    with mon.phase("backward"):
        loss.backward()
    ...
    mon.end_step(loss=loss)
    print(mon.summary()); print(mon.leak())

* :class:`Monitor` — live and peak bytes per step and phase, by category (weights, gradients,
  optimizer state, activations, other); metrics as JSON lines; the leak verdict, with where in your
  Python code the surviving allocations were made (cpu).
* :func:`cpu_budget` — make the cpu behave like a card of a given size: an unchanged script raises
  ``torch.OutOfMemoryError`` where that card would.
* :class:`Guard` / :func:`guard` — keep a run alive: on out-of-memory, the same global batch again
  in half-size micro-batches, accumulated. :func:`find_max_batch` — the largest batch that fits.
* :func:`chunked_cross_entropy` — the LM head and the loss a chunk of tokens at a time, never the
  whole logits; :func:`offload_activations` — what autograd saves, in host memory until backward.
* :func:`analyze_snapshot` — diagnose a PyTorch memory snapshot (``torch.cuda.memory._dump_snapshot``)
  safely, as ``headroom analyze`` does: peaks and what was live, iterations and leaks, fragmentation,
  OOMs; a dict like the CLI's ``--json``.
* :func:`estimate`, :func:`plan` — predict a configuration's peak, and the fastest one that fits,
  for a transformers config, or for any ``torch.nn.Module`` with its inputs (its own training step,
  traced on fake tensors); :func:`measure` — that step run for real on the cpu, counted;
  :meth:`Plan.training_arguments` and :meth:`Plan.torch_loop` turn a plan into settings.

Importing headroom installs its counting allocator as the cpu allocator of this process: cpu
tensors made before the import are not counted (their bytes are missing from live and peak).
"""
import os as _os

import torch as _torch  # loads libtorch before the extension that links it

from . import _torch_check

_torch_check.check(_torch.__version__)
try:
    from . import _core
except ImportError as _e:  # a torch whose symbols the extension does not find: say which torches
    if "undefined symbol" not in str(_e):
        raise
    raise ImportError(_torch_check.mismatch_message(_torch_check.built_against(), _torch.__version__)
                      + f" ({_e})") from None

_core.install_cpu_allocator()
# Where an allocation was made: the innermost frame outside torch's package and this one.
_core.set_skipped_prefixes([_os.path.dirname(_torch.__file__) + _os.sep, _os.path.dirname(__file__) + _os.sep])

from .analyze import analyze_snapshot  # noqa: E402
from .budget import cpu_budget, inject_cpu_oom  # noqa: E402
from .guard import Guard, find_max_batch, guard  # noqa: E402
from .monitor import Monitor  # noqa: E402
from .plans import Plan, PlanResult  # noqa: E402
from .predict import estimate, plan  # noqa: E402
from .measure import measure_model as measure  # noqa: E402
from .loss import chunked_cross_entropy  # noqa: E402
from .offload import offload_activations  # noqa: E402

__all__ = [
    "Monitor",
    "analyze_snapshot",
    "cpu_budget",
    "inject_cpu_oom",
    "Guard",
    "guard",
    "find_max_batch",
    "estimate",
    "measure",
    "plan",
    "Plan",
    "PlanResult",
    "chunked_cross_entropy",
    "offload_activations",
    "parse_size",
    "format_bytes",
]


def parse_size(size) -> int:
    """Bytes in ``size``: an int, or text such as ``"8GiB"``, ``"512MB"``, ``"1.5G"``."""
    if isinstance(size, bool):
        raise TypeError("size: accepted: bytes as an int, or text such as '8GiB'")
    if isinstance(size, int):
        return size
    if isinstance(size, str):
        return _core.parse_size(size)
    raise TypeError(f"size {size!r}: accepted: bytes as an int, or text such as '8GiB'")


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: ``"1.50 GiB"``."""
    return _core.format_bytes(int(n))
