"""The leak verdict on a Python loop: a planted leak is found with its Python file and line."""
import inspect

import headroom
import torch

LEAK_ELEMENTS = 64 * 1024  # float32: 256 KiB per step


def loop(steps, leak):
    model = torch.nn.Linear(128, 128)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = headroom.Monitor("cpu", model=model, optimizer=opt)
    kept = []
    x = torch.randn(16, 128)
    for _ in range(steps):
        with mon.phase("forward"):
            loss = model(x).square().mean()
            if leak:
                kept.append(torch.ones(LEAK_ELEMENTS))  # the planted leak
        with mon.phase("backward"):
            loss.backward()
        with mon.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        mon.end_step(loss=loss)
    return mon, kept


def test_planted_leak_is_found_with_its_line():
    mon, kept = loop(10, leak=True)
    verdict = mon.leak()
    assert verdict["detected"], verdict["reason"]
    assert abs(verdict["bytes_per_step"] - 4 * LEAK_ELEMENTS) < 1024
    site = verdict["sites"][0]
    line = next(i for i, text in enumerate(inspect.getsource(loop).splitlines()) if "the planted leak" in text)
    where = f"{__file__}:{loop.__code__.co_firstlineno + line} in loop"
    assert site["origin"] == where
    assert site["bytes"] == 4 * LEAK_ELEMENTS
    assert site["phase"] == "forward"
    assert site["count"] == 8  # steps 3..10: the two warm-up steps are not judged
    assert where in site["description"]


def test_a_loop_that_releases_what_it_makes_is_not_a_leak():
    mon, _ = loop(10, leak=False)
    verdict = mon.leak()
    assert not verdict["detected"], verdict["reason"]
    assert verdict["sites"] == []


def test_origins_are_off_when_asked():
    model = torch.nn.Linear(8, 8)
    mon = headroom.Monitor("cpu", model=model, python_frames=False)
    kept = []
    for _ in range(8):
        with mon.phase("forward"):
            kept.append(torch.ones(LEAK_ELEMENTS))
        mon.end_step()
    verdict = mon.leak()
    assert verdict["detected"]
    assert "origin" not in verdict["sites"][0]
