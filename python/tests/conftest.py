"""Shared by the Python module's tests: headroom is imported before any tensor is made, so that
the counting allocator sees every one; reduced_matmul makes the cpu's bf16 and fp16 matmuls fast
without changing what is allocated, or where the origins of allocations point."""
import os
import subprocess

import headroom  # noqa: F401  (first: counts what the tests allocate)
import pytest
import reduced_matmul  # noqa: F401  (bf16/fp16 cpu matmuls through float32: see its docstring)
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# An allocation's origin is the innermost frame outside torch and headroom (headroom/__init__.py):
# outside reduced_matmul too, whose registrations allocate every cpu matmul's result in Python.
headroom._core.set_skipped_prefixes([os.path.dirname(torch.__file__) + os.sep,
                                     os.path.dirname(headroom.__file__) + os.sep,
                                     os.path.abspath(reduced_matmul.__file__)])


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield
    headroom.cpu_budget(None)
    headroom.inject_cpu_oom(0)


def headroom_cli(*args: str) -> str:
    """Runs the built `headroom` binary (CTest says where: HEADROOM_BINARY) and returns its stdout."""
    binary = os.environ.get("HEADROOM_BINARY", os.path.join(ROOT, "build", "headroom"))
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return done.stdout


def plain_loop_phases(model, vocab_size, optimizer, batch, seq, start, steps=2):
    """Each phase's peak bytes above `start` (live bytes before the model existed) in the last of
    `steps` plain training steps of `model` on random ids (labels = inputs, as transformers' models
    take them), from a Monitor: what the counting allocator measured, not the estimator."""
    ids = torch.randint(0, vocab_size, (batch, seq))
    mon = headroom.Monitor("cpu", model=model, optimizer=optimizer, python_frames=False)
    for _ in range(steps):
        with mon.phase("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with mon.phase("backward"):
            loss.backward()
        with mon.phase("optimizer"):
            optimizer.step()
        with mon.phase("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        loss = None
        record = mon.end_step()
    return {p: record["phases"][p]["peak"] - start for p in ("forward", "backward", "optimizer")}
