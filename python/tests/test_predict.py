"""estimate and plan for transformers configs: the same objects as the CLI's, and settings a user
can paste."""
import json
import os

import headroom
import pytest
import torch
import transformers
from conftest import ROOT, headroom_cli

PRESETS = os.path.join(ROOT, "configs", "models")


def preset(name):
    with open(os.path.join(PRESETS, name + ".json")) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def test_estimate_accepts_a_dict_a_path_and_a_pretrained_config_alike(tmp_path):
    d = preset("qwen2.5-0.5b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    settings = dict(batch=2, seq=256, precision="bf16-mixed", optimizer="adamw", checkpointing="full")
    from_dict = headroom.estimate(d, **settings)
    from_path = headroom.estimate(str(path), **settings)
    from_dir = headroom.estimate(tmp_path, **settings)
    # transformers 5 rewrites the rotary fields (rope_parameters); the model is the same.
    from_hf = headroom.estimate(transformers.Qwen2Config(**d), **settings)
    (tmp_path / "empty.txt").write_text("")
    cli = json.loads(headroom_cli("estimate", "--model", str(path), "--batch", "2", "--seq", "256", "--precision",
                                  "bf16-mixed", "--checkpointing", "full", "--device", "cpu", "--optimizer-impl", "torch", "--data",
                                  str(tmp_path / "empty.txt"), "--json"))
    assert from_dict["peak_bytes"] == from_path["peak_bytes"] == from_dir["peak_bytes"] == from_hf["peak_bytes"]
    assert from_dict["model"]["params"] == 494_032_768  # Qwen2.5-0.5B's published count
    assert {k: v for k, v in from_path.items() if k != "model"} == {k: v for k, v in cli.items() if k != "model"}


def test_torch_optim_update_adds_its_denominators():
    """torch.optim.AdamW on cpu divides by a new tensor per parameter: at the update, sqrt(v) and the
    quotient of the largest parameter (gpt2's tied embedding, the first one) exist together."""
    d = preset("gpt2")
    wte = 50257 * 768 * 4  # bytes of the tied embedding, hand-computed
    ours = headroom.estimate(d, batch=1, seq=64, optimizer_impl="headroom")["phases"]["optimizer"]
    torchs = headroom.estimate(d, batch=1, seq=64, optimizer_impl="torch")["phases"]["optimizer"]
    extra = torchs - ours
    assert 0 <= 2 * wte - extra < 4096  # less the clipping's small partials, freed before the update
    on_cuda = headroom.estimate(d, batch=1, seq=64, device="cuda", optimizer_impl="torch")
    assert on_cuda["breakdown"]["temporaries"] >= 124_439_808 * 4  # foreach: every parameter's sqrt at once


def test_estimate_errors_name_what_was_wrong(tmp_path):
    with pytest.raises(ValueError, match="model_type 'bert'.*gpt2"):
        headroom.estimate({"model_type": "bert"})
    with pytest.raises(ValueError, match="cannot read it"):
        headroom.estimate(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="--precision"):
        headroom.estimate(preset("gpt2"), precision="fp8")
    with pytest.raises(TypeError, match="accepted"):
        headroom.estimate(42)


def test_plan_equals_the_cli_and_converts_to_settings(tmp_path):
    d = preset("gpt2")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    (tmp_path / "empty.txt").write_text("")
    result = headroom.plan(d, global_batch=16, budget="6GiB", seq=512)
    cli = json.loads(headroom_cli("plan", "--model", str(path), "--data", str(tmp_path / "empty.txt"), "--global-batch",
                                  "16", "--memory-budget", "6GiB", "--seq", "512", "--device", "cpu", "--optimizer-impl", "torch",
                                  "--no-calibrate",
                                  "--json"))
    assert result.plans == cli["plans"]
    best = result.best
    assert best["predicted_peak_bytes"] <= 0.95 * (6 << 30)
    assert best["batch"] * best["accum"] == 16

    settings = best.training_arguments()
    args = settings["training_arguments"]
    assert args["per_device_train_batch_size"] == best["batch"]
    assert args["gradient_accumulation_steps"] == best["accum"]
    assert args["gradient_checkpointing"] == (best["checkpointing"] != "none")
    # transformers itself accepts them.
    ta = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True,
                                        **{k: v for k, v in args.items() if k not in ("bf16", "fp16")})
    assert ta.per_device_train_batch_size == best["batch"]
    assert "TrainingArguments(" in best.training_arguments_code()

    # The CLI prints the same: `plan --emit hf|lightning|torch`, Python source that compiles.
    for emit in ("hf", "lightning", "torch"):
        j = json.loads(headroom_cli("plan", "--model", str(path), "--data", str(tmp_path / "empty.txt"),
                                    "--global-batch", "16", "--memory-budget", "6GiB", "--seq", "512", "--device",
                                    "cpu", "--optimizer-impl", "torch", "--no-calibrate", "--json", "--emit", emit))
        assert j["emit"]["format"] == emit
        compile(j["emit"]["code"], f"plan --emit {emit}", "exec")
        if emit == "lightning":
            assert j["emit"]["settings"] == best.lightning_trainer_kwargs()
            assert j["emit"]["code"] == best.lightning_trainer_code()
    assert j["emit"]["code"] == best.torch_loop("cpu")
    text = headroom_cli("plan", "--model", str(path), "--data", str(tmp_path / "empty.txt"), "--global-batch", "16",
                        "--memory-budget", "6GiB", "--seq", "512", "--device", "cpu", "--optimizer-impl", "torch",
                        "--no-calibrate", "--emit", "hf")
    assert f"per_device_train_batch_size={best['batch']}," in text


def test_each_lever_maps_to_its_setting():
    plan = headroom.Plan(batch=2, accum=8, precision="bf16-mixed", checkpointing="every:2", optimizer="adafactor",
                         attention="math", shard="full", world_size=4)
    s = plan.training_arguments()
    assert s["training_arguments"] == {
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8, "bf16": True, "fp16": False,
        "gradient_checkpointing": True, "optim": "adafactor", "fsdp": "full_shard"}
    assert s["model_kwargs"] == {"attn_implementation": "eager"}
    assert any("every layer" in n for n in s["notes"]) and any("torchrun" in n for n in s["notes"])


def test_each_lever_maps_to_its_lightning_setting():
    plan = headroom.Plan(batch=2, accum=8, precision="fp16-mixed", checkpointing="selective", optimizer="adamw",
                         attention="flash", shard="full", world_size=4)
    s = plan.lightning_trainer_kwargs()
    assert s["trainer_kwargs"] == {"precision": "16-mixed", "accumulate_grad_batches": 8, "devices": 4,
                                   "strategy": "fsdp"}
    assert s["module"]["batch_size"] == 2 and s["module"]["gradient_checkpointing"] is True
    assert s["module"]["optimizer"].startswith("torch.optim.AdamW((q for q in self.parameters() if q.requires_grad)")
    assert any("configure_model" in n for n in s["notes"]) and any("every layer" in n for n in s["notes"])
    pure = headroom.Plan(batch=1, accum=1, precision="bf16", checkpointing="none", optimizer="sgd",
                         attention="math", shard="optimizer", world_size=2)
    s = pure.lightning_trainer_kwargs()
    assert s["trainer_kwargs"] == {"precision": "bf16-true", "accumulate_grad_batches": 1, "devices": 2,
                                   "strategy": "deepspeed_stage_1"}
    assert s["model_kwargs"] == {"attn_implementation": "eager", "dtype": "bfloat16"}
    assert s["module"]["gradient_checkpointing"] is False


def test_the_lightning_kwargs_train_with_the_planned_accumulation():
    """lightning.Trainer takes the plan's arguments as they are: micro-batches of the plan's size,
    accumulated, give the update of one whole-batch step (Lightning scales each micro-batch's loss)."""
    import lightning  # pinned in the setup venv (scripts/setup)
    plan = headroom.Plan(batch=2, accum=3, precision="fp32", checkpointing="none", optimizer="sgd",
                         attention="flash", shard="none", world_size=1)
    s = plan.lightning_trainer_kwargs()

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return eval(s["module"]["optimizer"], {"torch": torch, "self": self, "lr": 0.1})

    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    module, whole = Module(), torch.nn.Linear(4, 1)
    whole.load_state_dict(module.lin.state_dict())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=s["module"]["batch_size"])
    trainer = lightning.Trainer(**s["trainer_kwargs"], accelerator="cpu", devices=1, max_steps=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    assert trainer.global_step == 1
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(whole(x), y).backward()
    opt.step()
    torch.testing.assert_close(module.lin.weight, whole.weight)


def test_the_torch_loop_runs_and_accumulates(tmp_path):
    """The emitted loop is Python that runs: on a small model its accumulated update equals one
    whole-batch step's."""
    plan = headroom.Plan(batch=2, accum=3, precision="fp32", checkpointing="none", optimizer="sgd",
                         attention="flash", shard="none", world_size=1)
    code = plan.torch_loop("cpu")

    class Out:
        def __init__(self, loss):
            self.loss = loss

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            return Out(torch.nn.functional.mse_loss(self.lin(x), y))

    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    model, whole = Model(), Model()
    whole.load_state_dict(model.state_dict())
    loader = [{"x": x[i:i + 2], "y": y[i:i + 2]} for i in range(0, 6, 2)]
    exec(code, {"torch": torch, "model": model, "loader": loader, "lr": 0.1})
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    whole(x, y).loss.backward()
    opt.step()
    torch.testing.assert_close(model.lin.weight, whole.lin.weight)


def test_plan_allows_offload_and_8bit_states_as_the_cli_does(tmp_path):
    """`allow=` is `--allow`: with a budget only offloading (the optimizer's state or the saved
    activations) or 8-bit states meet, every plan uses one, the CLI lists the same plans, and the
    torch loop of one that offloads the optimizer builds torchao's CPUOffloadOptimizer."""
    d = preset("gpt2")
    d["n_layer"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    (tmp_path / "empty.txt").write_text("")
    roomy = headroom.plan(d, global_batch=4, budget="64GiB", seq=64, margin=0.0)
    smallest = min(p["predicted_peak_bytes"] for p in roomy.plans)
    assert headroom.plan(d, global_batch=4, budget=smallest - 1, seq=64, margin=0.0).best is None
    result = headroom.plan(d, global_batch=4, budget=smallest - 1, seq=64, margin=0.0, allow=["offload", "adamw8bit"])
    assert result.plans and all(p["offload"] != "none" or p["optimizer"] == "adamw8bit" for p in result.plans)
    cli = json.loads(headroom_cli("plan", "--model", str(path), "--data", str(tmp_path / "empty.txt"), "--global-batch",
                                  "4", "--memory-budget", str(smallest - 1), "--seq", "64", "--device", "cpu",
                                  "--optimizer-impl", "torch", "--margin", "0", "--no-calibrate", "--allow",
                                  "offload,adamw8bit", "--json"))
    assert result.plans == cli["plans"]
    offloaded = next(p for p in result.plans if "optimizer" in p["offload"].split(","))
    code = offloaded.torch_loop("cuda")
    compile(code, "torch loop", "exec")
    assert "torchao.optim.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW" in code
