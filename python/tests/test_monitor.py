"""Monitor: categories against hand-computed bytes; the metrics lines against the CLI's."""
import json

import headroom
import pytest
import torch
from conftest import headroom_cli

IN, HIDDEN, OUT, ROWS = 256, 512, 256, 32
# Hand-computed from the layer sizes: weights and biases of Linear(256, 512) and Linear(512, 256).
PARAMS = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 262,912
PARAM_BYTES = 4 * PARAMS  # float32: 1,051,648
# Adam: exp_avg and exp_avg_sq per parameter tensor, plus a float32 step counter per tensor (4 of them).
ADAM_BYTES = 2 * PARAM_BYTES + 4 * 4


def train(mon, model, opt, data, steps):
    x, y = data
    for _ in range(steps):
        with mon.phase("forward"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        with mon.phase("backward"):
            loss.backward()
        with mon.phase("optimizer"):
            opt.step()
        with mon.phase("zero_grad"):
            opt.zero_grad(set_to_none=True)
        mon.end_step(loss=loss, batch=ROWS)


def test_categories_equal_hand_computed_bytes(tmp_path):
    data = (torch.randn(ROWS, IN), torch.randn(ROWS, OUT))  # live before the steps: "other"
    data_bytes = 4 * ROWS * (IN + OUT)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = headroom.Monitor("cpu", model=model, optimizer=opt, metrics=tmp_path / "m.jsonl")
    train(mon, model, opt, data, 3)
    step = mon.steps[-1]
    update = step["phases"]["optimizer"]["breakdown"]
    assert update["weights"] == PARAM_BYTES
    assert update["gradients"] == PARAM_BYTES
    assert update["optimizer"] == ADAM_BYTES
    assert update["other"] >= data_bytes  # the data, and whatever else the process made before the step
    forward = step["phases"]["forward"]["breakdown"]
    assert forward["gradients"] == 0  # zero_grad(set_to_none) left none
    # Saved for backward at least: the hidden layer's input to ReLU and its output (ROWS x HIDDEN each).
    assert forward["activations"] >= 4 * ROWS * HIDDEN
    assert step["peak_bytes"] >= PARAM_BYTES * 2 + ADAM_BYTES
    assert step["live_bytes"] == step["phases"]["zero_grad"]["live_out"]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[-1] == step
    assert "forward" in mon.summary()


def test_metrics_have_the_cli_fields(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = headroom.Monitor("cpu", model=model, optimizer=opt)
    train(mon, model, opt, (torch.randn(4, 8), torch.randn(4, 8)), 1)
    ours = mon.steps[0]
    headroom_cli("train", "--device", "cpu", "--model", "tiny", "--steps", "1", "--seq", "16", "--batch", "1",
                 "--eval-rows", "0", "--quiet", "--metrics", str(tmp_path / "cli.jsonl"))
    cli = json.loads((tmp_path / "cli.jsonl").read_text().splitlines()[0])
    # Every field the CLI writes but lr and grad_norm (which a loop passes when it wants them), the same way.
    assert set(cli) - {"lr", "grad_norm", "tokens"} <= set(ours)
    assert set(ours) <= set(cli)
    assert set(ours["phases"]["forward"]) == set(cli["phases"]["forward"])
    assert set(ours["phases"]["forward"]["breakdown"]) == set(cli["phases"]["forward"]["breakdown"])


def test_bad_input_is_named():
    mon = headroom.Monitor("cpu")
    with pytest.raises(ValueError, match="phase 'fwd': accepted: data, forward, backward"):
        with mon.phase("fwd"):
            pass
    with mon.phase("forward"):
        with pytest.raises(ValueError, match="phases do not nest"):
            with mon.phase("backward"):
                pass
    with pytest.raises(ValueError, match="device"):
        headroom.Monitor("tpu")
    mon.close()
    with pytest.raises(ValueError, match="closed"):
        mon.end_step()
