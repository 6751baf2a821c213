"""LoRA and frozen weights against peft and transformers.

- The trainable parameter count headroom estimates for `--finetune lora:r=R,targets=...` equals
  peft's: get_peft_model over transformers' own model of the same config.json, on the meta device,
  with the target modules peft users write for that family (listed here by hand), counted here.
- A LoRA fine-tune saved as a peft adapter loads with PeftModel.from_pretrained, and transformers +
  peft give the held-out loss headroom evaluated; merged (--merge-lora) it loads as a plain
  checkpoint with the same loss; and headroom loads peft's adapter back (--adapter).
- An adapter for another base is refused with one line, exit 2, and nothing written.
"""
import json
import os

import headroom
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from conftest import ROOT, plain_loop_phases  # noqa: E402
from finetune_helpers import (BATCH, EVAL_ROWS, SEQ, held_out_loss, make_tokenizer, make_tokens,  # noqa: E402
                              run_headroom, save_base)

ALL = "q,k,v,o,gate,up,down"
# peft's target_modules for headroom's roles, as a peft user writes them for each family.
PEFT_TARGETS = {
    ("llama-3.2-1b", "q,v"): ["q_proj", "v_proj"],
    ("llama-3.2-1b", ALL): ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ("qwen3-0.6b", "q,v"): ["q_proj", "v_proj"],
    ("qwen3-0.6b", ALL): ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ("phi-3-mini", "q,v"): ["qkv_proj"],
    ("phi-3-mini", ALL): ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    ("gpt2", "q,v"): ["c_attn"],
    ("gpt2", ALL): ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"],
    # A mixture of experts: the attention (headroom refuses LoRA on the experts for now).
    ("qwen3-30b-a3b", "q,k,v,o"): ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def preset_path(preset):
    return os.path.join(ROOT, "configs", "models", preset + ".json")


def peft_trainable(preset, r, targets):
    with open(preset_path(preset)) as f:
        fields = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("preset,targets", sorted(PEFT_TARGETS))
def test_trainable_parameters_equal_peft(preset, targets):
    ours = headroom.estimate(preset_path(preset), batch=1, seq=16, finetune=f"lora:r=16,alpha=32,targets={targets}")
    print(f"{preset} targets={targets}: headroom {ours['model']['trainable_params']:,} trainable")
    theirs = peft_trainable(preset, 16, PEFT_TARGETS[(preset, targets)])
    assert ours["model"]["trainable_params"] == theirs
    assert ours["model"]["trainable_params"] < ours["model"]["params"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    tokenizer = make_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return make_tokens(tokenizer, str(tmp_path_factory.mktemp("tokens") / "corpus.bin"))


LORA = "lora:r=4,alpha=8,dropout=0.1,targets=" + ALL


def fine_tune(base, tokens, out, *extra):
    done = run_headroom("train", "--weights", base, "--data-tokens", tokens, "--finetune", LORA, "--steps", "4",
                        "--batch", str(BATCH), "--seq", str(SEQ), "--eval-rows", str(EVAL_ROWS), "--lr", "1e-2",
                        "--device", "cpu", "--save-weights", out, "--json", "--quiet", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_peft_loads_the_adapter_and_agrees_on_the_loss(family, tmp_path, tokens):
    base, base_model = save_base(family, tmp_path / "base")
    summary = fine_tune(base, tokens, str(tmp_path / "adapter"))
    assert 0 < summary["trainable_params"] < summary["params"]
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    model.eval()
    trainable = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert trainable == summary["trainable_params"]
    # B starts at zero: trained, the adapter moved the model.
    assert abs(held_out_loss(model, tokens) - held_out_loss(base_model.eval(), tokens)) > 1e-3
    assert abs(held_out_loss(model, tokens) - summary["eval_loss"]) < 1e-4

    merged = fine_tune(base, tokens, str(tmp_path / "merged"), "--merge-lora")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert abs(held_out_loss(plain, tokens) - merged["eval_loss"]) < 1e-4

    # headroom reads peft's adapter back: a step at a vanishing learning rate evaluates it as it is.
    done = run_headroom("train", "--weights", base, "--data-tokens", tokens, "--finetune", LORA, "--adapter",
                        str(tmp_path / "adapter"), "--steps", "1", "--lr", "1e-12", "--batch", str(BATCH), "--seq",
                        str(SEQ), "--eval-rows", str(EVAL_ROWS), "--device", "cpu", "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    assert abs(json.loads(done.stdout.strip().splitlines()[-1])["eval_loss"] - summary["eval_loss"]) < 1e-4


def test_an_adapter_for_another_base_is_refused(tmp_path, tokens):
    base, _ = save_base("qwen3", tmp_path / "base")
    fine_tune(base, tokens, str(tmp_path / "adapter"))
    wider, _ = save_base("qwen3", tmp_path / "wider", hidden_size=96)
    out = tmp_path / "out"
    done = run_headroom("train", "--weights", wider, "--data-tokens", tokens, "--finetune", LORA, "--adapter",
                        str(tmp_path / "adapter"), "--steps", "1", "--seq", str(SEQ), "--device", "cpu",
                        "--save-weights", str(out), "--quiet")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "has shape" in lines[0] and "another base" in lines[0], done.stderr
    assert not out.exists()
    # Another rank than --finetune's.
    done = run_headroom("train", "--weights", base, "--data-tokens", tokens, "--finetune", "lora:r=8", "--adapter",
                        str(tmp_path / "adapter"), "--steps", "1", "--seq", str(SEQ), "--device", "cpu", "--quiet")
    assert done.returncode == 2 and "the adapter has r=4" in done.stderr


def test_the_any_model_estimate_of_a_peft_model_matches_its_measured_step():
    """A user's own peft model through `import headroom`: the trace sees which parameters require grad
    (no gradients or AdamW state for the frozen base), and predicts the step a real run measures."""
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                                      num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 32000, (2, 128))
    inputs = {"input_ids": ids, "labels": ids}
    predicted = headroom.estimate(model, inputs, optimizer="adamw")
    assert predicted["model"]["trainable_params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    measured = headroom.measure(model, inputs, optimizer="adamw")
    assert abs(predicted["peak_bytes"] - measured["peak_bytes"]) <= 0.01 * measured["peak_bytes"]
    # Far below the same model trained whole: the base has no gradients and no optimizer state.
    for p in model.parameters():
        p.requires_grad_(True)
    whole = headroom.estimate(model, inputs, optimizer="adamw")
    assert predicted["peak_bytes"] < whole["peak_bytes"] - 2 * 4 * 38_000_000


@pytest.mark.parametrize("tied,finetune", [(True, "lora"), (False, "lora"), (True, "freeze")],
                         ids=["tied-lora", "untied-lora", "tied-frozen-embedding"])
def test_the_estimate_of_a_fine_tune_is_peft_and_transformers_measured_step(tied, finetune):
    """Llama-3.2-1B's widths and vocabulary (2 layers, 1 x 128 tokens, fp32), tied and untied: peft's
    LoRA on q and v (AdamW over the adapters), or transformers' model with its embedding frozen (SGD),
    measured in a plain loop by the counting allocator; headroom's estimate of the same config and
    --finetune, each phase within 1%."""
    import gc
    with open(preset_path("llama-3.2-1b")) as f:
        fields = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    fields.update(num_hidden_layers=2, tie_word_embeddings=tied)
    config = transformers.LlamaConfig(**fields)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    setting = "lora:r=16,alpha=8,targets=q,v" if finetune == "lora" else "freeze:embed_tokens.weight"
    optimizer = "adamw" if finetune == "lora" else "sgd"
    predicted = headroom.estimate(config, batch=1, seq=128, precision="fp32", optimizer=optimizer, attention="flash",
                                  finetune=setting)
    gc.collect()
    start = headroom._core.cpu_live_bytes()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if finetune == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    else:
        model.model.embed_tokens.weight.requires_grad_(False)  # the head too, when tied
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4) if finetune == "lora" else torch.optim.SGD(trained, lr=1e-4)
    measured = plain_loop_phases(model, config.vocab_size, opt, 1, 128, start)
    for phase, bytes_ in measured.items():
        error = (predicted["phases"][phase] - bytes_) / bytes_
        print(f"\n{'tied' if tied else 'untied'} {finetune:>6} {phase:>9}: estimate {predicted['phases'][phase]:>14,}  "
              f"measured {bytes_:>14,}  error {100 * error:+.3f}%", end="")
        assert abs(error) <= 0.01, (phase, predicted["phases"][phase], bytes_)
    # And what estimate prints as the run's peak is that step's (the model's construction is below it).
    assert predicted["peak_bytes"] == max(predicted["phases"].values())
