"""Any model, the rest of the API: plan(model) against real steps, measure, a forward that needs
values, an optimizer the user brings, and `python -m headroom` for configs outside the native
families (its JSON, its bad input)."""
import json
import os
import subprocess
import sys

import headroom
import pytest
import torch
import transformers

from conftest import ROOT


def ids(batch, seq, vocab, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def qwen3(layers=2, vocab=151936):
    return transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, vocab_size=vocab)


def test_plan_of_a_model_fits_when_run():
    # BERT at bert-base widths: the plan's micro-batch, run for real under the counting allocator,
    # stays under the budget, and one micro-batch more than the plan's would not have fitted.
    cfg = transformers.BertConfig(num_hidden_layers=2)
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(cfg)
    batch = {"input_ids": ids(1, 128, cfg.vocab_size), "labels": ids(1, 128, cfg.vocab_size)}
    budget = 2 * 2**30
    result = headroom.plan(model, batch, global_batch=16, budget=budget, margin=0.0)
    best = result.best
    assert best is not None and best["batch"] * best["accum"] == 16
    assert best["predicted_peak_bytes"] <= budget
    rows = {"input_ids": ids(best["batch"], 128, cfg.vocab_size), "labels": ids(best["batch"], 128, cfg.vocab_size)}
    run = headroom.measure(model, rows, precision=best["precision"], checkpointing=best["checkpointing"],
                           accum=best["accum"])
    assert run["peak_bytes"] <= budget, (run["peak_bytes"], best)
    assert abs(run["peak_bytes"] / best["predicted_peak_bytes"] - 1) < 0.01
    args = best.training_arguments()["training_arguments"]
    assert args["per_device_train_batch_size"] == best["batch"]
    assert args["gradient_accumulation_steps"] == best["accum"]
    # Every plan is the largest divisor of 16 that fits at its settings: the next divisor does not.
    for p in result.plans:
        if p["batch"] < 16:
            larger = 2 * p["batch"]
            over = headroom.estimate(model, {k: ids(larger, 128, cfg.vocab_size) for k in ("input_ids", "labels")},
                                     precision=p["precision"], checkpointing=p["checkpointing"])
            assert over["peak_bytes"] > budget, (p, over["peak_bytes"])


def test_plan_with_nothing_that_fits_says_the_smallest_peak():
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(qwen3())
    result = headroom.plan(model, {"input_ids": ids(1, 64, 151936), "labels": ids(1, 64, 151936)},
                           global_batch=4, budget="64MiB")
    assert result.plans == [] and result["smallest_peak"]["bytes"] > 64 * 2**20


class Gated(torch.nn.Module):
    """A forward that needs values: it branches on a tensor's contents (.item())."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(512, 2048)
        self.b = torch.nn.Linear(2048, 512)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.mean().item() > -1.0:  # always true; fake tensors cannot know it
            h = h * 2
        return self.b(h).pow(2).mean()


def test_a_forward_that_needs_values_is_traced_on_real_tensors_and_said_so():
    with torch.device("meta"):
        model = Gated()
    x = (torch.randn(64, 512),)
    est = headroom.estimate(model, x, loss_fn=lambda out, inputs: out)
    assert est["traced"]["method"].startswith("real tensors on the cpu"), est["traced"]
    assert "item" in est["traced"]["method"] or "needs values" in est["traced"]["method"]
    run = headroom.measure(model, x, loss_fn=lambda out, inputs: out)
    assert abs(est["peak_bytes"] / run["peak_bytes"] - 1) < 0.01, (est["peak_bytes"], run["peak_bytes"])


def test_an_optimizer_the_user_brings_is_traced_not_assumed():
    # transformers' Adafactor keeps factored second moments: far less state than AdamW's two
    # full copies. The estimate follows the optimizer the callable makes, checked by a real step.
    from transformers.optimization import Adafactor

    def adafactor(params):
        return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False)

    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(qwen3(vocab=32000))
    batch = {"input_ids": ids(2, 64, 32000), "labels": ids(2, 64, 32000)}
    est = headroom.estimate(model, batch, optimizer=adafactor)
    adamw = headroom.estimate(model, batch, optimizer="adamw")
    params = est["model"]["params"]
    assert est["breakdown"]["optimizer"] < 0.1 * 4 * params
    assert adamw["breakdown"]["optimizer"] >= 2 * 4 * params
    run = headroom.measure(model, batch, optimizer=adafactor)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(est["phases"][phase] / run["phases"][phase] - 1) < 0.02, (phase, est["phases"], run["phases"])


def test_measure_returns_the_estimates_shape():
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(qwen3(vocab=32000))
    out = headroom.measure(model, {"input_ids": ids(1, 32, 32000), "labels": ids(1, 32, 32000)})
    assert set(out) >= {"model", "peak_bytes", "peak_phase", "phases"}
    assert out["model"]["params"] == sum(p.numel() for p in model.parameters())
    assert out["peak_phase"] in ("forward", "backward", "optimizer", "zero_grad")


def run_module(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(headroom.__file__)), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "headroom", *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


def test_python_m_headroom_estimates_a_config_outside_the_native_families(tmp_path):
    # Granite (not native to headroom) at Qwen3-0.6B-like widths and vocabulary.
    config = {"model_type": "granite", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 151936,
              "tie_word_embeddings": True, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
              "architectures": ["GraniteForCausalLM"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = run_module("estimate", "--model", str(tmp_path), "--set", "num_hidden_layers=4", "--batch", "2",
                      "--seq", "64", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    # Counted independently: tied embeddings once, per layer q/k/v/o, the SwiGLU MLP and two norms,
    # and the final norm.
    h, inner, q, kv = 1024, 3072, 16 * 64, 8 * 64
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inner + 2 * h
    assert out["model"]["params"] == 151936 * h + 4 * per_layer + h
    assert out["model"]["name"] == "GraniteForCausalLM"
    # fp32 weights, as the native families train (not the config's bf16)
    assert out["breakdown"]["weights"] == 4 * out["model"]["params"]
    assert out["peak_bytes"] > 0 and out["reserved_bytes"] >= out["peak_bytes"]
    small = run_module("estimate", "--model", str(path), "--set", "num_hidden_layers=4", "--batch", "2", "--seq", "64",
                       "--memory-budget", "1GiB", "--json")
    assert small.returncode == 1 and json.loads(small.stdout)["fits"] is False


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/config.json"], "cannot read it"),
    (["--model", "{cfg}", "--set", "oops"], "--set 'oops': accepted: key=value"),
    (["--model", "{cfg}", "--precision", "fp8"], "precision 'fp8': accepted: fp32, bf16-mixed, fp16-mixed, bf16"),
    (["--model", "{cfg}", "--batch", "0"], "--batch 0: accepted: a positive whole number"),
    (["--model", "{bad}"], "does not know model_type 'nosuch'"),
])
def test_python_m_headroom_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 1}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "nosuch"}))
    done = run_module("estimate", *[a.format(cfg=cfg, bad=bad) for a in args])
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.startswith("headroom:")]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_accumulation_traces_two_micro_batches_and_holds_for_four():
    # The second micro-batch finds the first's gradients (the tied 94 MB embedding's among them):
    # the peak rises over accum=1, and a real step of four micro-batches peaks where two do.
    cfg = transformers.BertConfig(num_hidden_layers=2)
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(cfg)
    batch = {"input_ids": ids(2, 128, cfg.vocab_size), "labels": ids(2, 128, cfg.vocab_size)}
    one, four = headroom.estimate(model, batch, accum=1), headroom.estimate(model, batch, accum=4)
    run = headroom.measure(model, batch, accum=4)
    assert four["peak_bytes"] > one["peak_bytes"]
    assert abs(four["peak_bytes"] / run["peak_bytes"] - 1) < 0.01, (four["peak_bytes"], run["peak_bytes"])
    assert four["flops_per_step"] == 4 * one["flops_per_step"]


def measured_llama_step(config, inputs):
    """A plain loop's peak over two steps (bf16 weights, AdamW), above what was live before the model."""
    import gc
    gc.collect()
    start = headroom._core.cpu_live_bytes()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak = 0
    for _ in range(2):
        headroom._core.reset_cpu_peak()
        loss = model(**inputs).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = max(peak, headroom._core.cpu_peak_bytes() - start)
    return peak


@pytest.mark.parametrize("positions", ["derived", "passed", "packed"])
def test_a_model_without_a_kv_cache_is_traced_on_the_path_its_step_takes(positions):
    # Without a KV cache or an attention mask, transformers asks whether the position ids pack
    # several sequences into a row; on fake tensors it skips the question and builds a mask every
    # layer keeps, which the real step (one sequence a row) does not. The trace answers as the real
    # step does: no mask for positions the model derives or an arange passed, the mask for packed ones.
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, use_cache=False)
    tokens = ids(2, 512, 1000)
    inputs = {"input_ids": tokens, "labels": tokens}
    if positions == "passed":
        inputs["position_ids"] = torch.arange(512).unsqueeze(0).expand(2, -1)
    if positions == "packed":
        inputs["position_ids"] = torch.cat([torch.arange(256), torch.arange(256)]).unsqueeze(0).expand(2, -1)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    est = headroom.estimate(model, inputs, precision="bf16")["peak_bytes"]
    real = measured_llama_step(config, inputs)
    assert abs(est / real - 1) <= 0.001, (positions, est, real)
