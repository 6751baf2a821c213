"""The Python module on a GPU (scripts/gpu-check runs it; nothing here runs without one).

Monitor("cuda") on a torch.nn model with torch.optim.Adam: weights, gradients and optimizer state at
the update against hand-computed bytes, reserved bytes reported; and the update's temporaries
against what the estimator assumes for torch.optim on cuda (foreach: every parameter's sqrt(v) at
once, so the optimizer phase rises by about the parameters' bytes). Prints one JSON line per check.
"""
import json
import sys

import headroom
import torch

IN, HIDDEN, OUT, ROWS = 1024, 4096, 1024, 64
PARAMS = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
PARAM_BYTES = 4 * PARAMS


def main():
    if not torch.cuda.is_available():
        print(json.dumps({"check": "python-cuda", "ok": False, "why": "no cuda device"}))
        return 1
    dev = "cuda"
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # foreach: the default on cuda
    x, y = torch.randn(ROWS, IN, device=dev), torch.randn(ROWS, OUT, device=dev)
    mon = headroom.Monitor(dev, model=model, optimizer=opt)
    for _ in range(3):
        with mon.phase("forward"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        with mon.phase("backward"):
            loss.backward()
        with mon.phase("optimizer"):
            opt.step()
        with mon.phase("zero_grad"):
            opt.zero_grad(set_to_none=True)
        step = mon.end_step(loss=loss)
    update = step["phases"]["optimizer"]
    b = update["breakdown"]
    rise = update["peak"] - update["live_in"]
    checks = {
        "weights": (b["weights"], PARAM_BYTES),
        "gradients": (b["gradients"], PARAM_BYTES),
        # exp_avg and exp_avg_sq; foreach keeps the step counters on the host
        "optimizer": (b["optimizer"], 2 * PARAM_BYTES),
        # foreach sqrt(v) of every parameter at once, each rounded up to the allocator's 512-byte blocks
        "update_rise_over_param_bytes": (rise, PARAM_BYTES),
    }
    ok = True
    for name, (got, want) in checks.items():
        good = abs(got - want) <= max(4096, 0.01 * want)
        ok &= good
        print(json.dumps({"check": f"python-cuda {name}", "measured": got, "expected": want, "ok": good}))
    print(json.dumps({"check": "python-cuda reserved", "reserved_bytes": step.get("reserved_bytes"),
                      "ok": step.get("reserved_bytes", 0) >= step["peak_bytes"]}))
    print(mon.summary())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
