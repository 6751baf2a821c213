"""headroom's native families against transformers' own models: for every bundled preset, the
parameter count headroom reports equals that of transformers' model built from the same config.json
on the meta device (nothing allocated), counted here, apart from headroom. A gemma3 (multimodal)
config is read through its text_config, and counts as the Gemma3ForCausalLM of that text config.
"""
import json
import os

import headroom
import pytest
import torch
import transformers
from conftest import ROOT

PRESETS = ["gpt2", "llama-3.2-1b", "mistral-7b", "qwen2.5-0.5b", "pythia-160m", "qwen3-0.6b", "qwen3-8b",
           "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-1b", "phi-3-mini", "olmo-2-7b", "smollm3-3b"]


def preset_fields(preset):
    with open(os.path.join(ROOT, "configs", "models", preset + ".json")) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def transformers_count(fields):
    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


@pytest.mark.parametrize("preset", PRESETS)
def test_parameter_count_equals_transformers(preset):
    fields = preset_fields(preset)
    path = os.path.join(ROOT, "configs", "models", preset + ".json")
    ours = headroom.estimate(path, batch=1, seq=16)["model"]["params"]
    assert ours == transformers_count(fields)


def test_a_gemma3_config_is_its_text_config(tmp_path):
    text = preset_fields("gemma-3-1b")
    multimodal = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(multimodal))
    assert headroom.estimate(str(path), batch=1, seq=16)["model"]["params"] == transformers_count(text)
