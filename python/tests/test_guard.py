"""guard and find_max_batch: the C++ guard's rules around a user's step function."""
import copy

import headroom
import pytest
import torch

ROWS, IN, HIDDEN = 8, 64, 1024


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, 1))


def batches(steps):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, 1, generator=g)) for _ in range(steps)]


def step_fn(model):
    return lambda b: torch.nn.functional.mse_loss(model(b[0]), b[1])


def unguarded(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for b in data:
        step_fn(model)(b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_guard_survives_an_injected_oom_and_trains_as_without_it():
    data = batches(4)
    reference = make_model()
    unguarded(reference, data)

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = headroom.Monitor("cpu", model=model, optimizer=opt)
    guard = headroom.Guard(opt, monitor=mon, quiet=True)
    for i, b in enumerate(data):
        if i == 1:
            headroom.inject_cpu_oom(3)  # the third allocation of step 2 fails (in its forward)
        guard(step_fn(model), b)
    assert guard.recoveries == 1
    assert guard.micro_batch == ROWS // 2  # kept lowered for the steps after
    assert [(s["batch"], s["accum"], s["oom_recoveries"]) for s in mon.steps] == [
        (8, 1, 0), (4, 2, 1), (4, 2, 0), (4, 2, 0)]
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_guard_halves_under_a_real_budget_and_gives_up_at_one_row():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rows = 256  # activations (about 12 KiB a row) outweigh the weights and gradients (264 KiB each)
    b = (torch.randn(rows, IN), torch.randn(rows, 1))
    start = headroom._core.cpu_live_bytes()

    def peak(n):  # a step's peak above the start at n rows, measured apart from the guard
        headroom._core.reset_cpu_peak()
        step_fn(model)((b[0][:n], b[1][:n])).backward()
        opt.zero_grad(set_to_none=True)
        return headroom._core.cpu_peak_bytes() - start

    whole, half = peak(rows), peak(rows // 2)
    assert whole - half > (1 << 20)
    with headroom.cpu_budget(start + (whole + half) // 2):  # half fits, the whole does not
        guard = headroom.Guard(opt, quiet=True)
        guard(step_fn(model), b)
        assert (guard.micro_batch, guard.recoveries) == (rows // 2, 1)
    # Room for the guard's own start (the RNG state), not for one row's gradients.
    with headroom.cpu_budget(headroom._core.cpu_live_bytes() + (64 << 10)):
        with pytest.raises(torch.OutOfMemoryError, match="micro-batch 1 does not fit"):
            headroom.Guard(opt, quiet=True)(step_fn(model), b)
        with pytest.raises(torch.OutOfMemoryError, match="the guard is off"):
            headroom.Guard(opt, quiet=True, enabled=False)(step_fn(model), b)


def test_find_max_batch_finds_the_edge():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss = step_fn(model)

    def make(n):
        return (torch.randn(n, IN), torch.randn(n, 1))

    def fits(n, budget):
        with headroom.cpu_budget(budget):
            try:
                loss(make(n)).backward()
                return True
            except torch.OutOfMemoryError:
                return False
            finally:
                opt.zero_grad(set_to_none=True)

    budget = headroom._core.cpu_live_bytes() + (3 << 20)
    result = headroom.find_max_batch(loss, make, budget=budget, optimizer=opt, limit=4096)
    n = result["max_batch"]
    assert n > 1
    assert fits(n, budget) and not fits(n + 1, budget)  # checked apart from the search
    assert len(result["log"]) <= 16  # trials; bisection alone over 4096 would take 12 after a failure
    # Seeded by a prediction (here: the line through two fitting trials of the search above), the
    # search needs only a few trials.
    (b1, p1), (b2, p2) = sorted((t["batch"], t["peak_bytes"]) for t in result["log"] if t["fits"])[-2:]
    seeded = headroom.find_max_batch(loss, make, budget=budget, optimizer=opt,
                                     predict=lambda b: int(p1 + (p2 - p1) * (b - b1) / (b2 - b1)))
    assert seeded["max_batch"] == n and len(seeded["log"]) <= 4, seeded["log"]


def test_batches_of_the_usual_kinds_split_by_rows():
    from collections import namedtuple

    from headroom.guard import _rows, _rows_of
    from transformers import BatchEncoding

    ids = torch.arange(12).reshape(6, 2)
    enc = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones(6, 2)})
    part = _rows_of(enc, 2, 4)
    assert _rows(enc) == 6 and isinstance(part, BatchEncoding)
    assert torch.equal(part["input_ids"], ids[2:4])
    Pair = namedtuple("Pair", "x y")
    pair = _rows_of(Pair(ids, ids + 1), 4, 6)
    assert isinstance(pair, Pair) and torch.equal(pair.y, ids[4:6] + 1)
    with pytest.raises(TypeError, match="accepted"):
        _rows(42)
