"""Fine-tuning a pretrained checkpoint end to end, with transformers on both sides: transformers
saves a model and a tokenizer; tools/tokenize_corpus.py turns the corpus into the tokenizer's ids; headroom
loads the checkpoint, fine-tunes it on those ids and saves it; transformers loads what headroom
saved, and its loss on the held-out windows headroom evaluated equals headroom's evaluation loss.
Then the bad inputs: a truncated or lying checkpoint, a mis-shaped tensor and ids outside the
vocabulary each end the run with one line and exit 2, and nothing is written."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from finetune_helpers import (BATCH, CONFIGS, CORPUS, EVAL_ROWS, SEQ, held_out_loss, make_tokenizer,  # noqa: E402
                              make_tokens, read_ids, run_headroom, save_base)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokens(tokenizer_dir, tmp_path_factory):
    return make_tokens(tokenizer_dir, str(tmp_path_factory.mktemp("tokens") / "corpus.bin"))


def test_the_tokenizer_tool_writes_an_llmc_file_of_the_tokenizers_ids(tokenizer_dir, tokens):
    header, ids = read_ids(tokens)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (header[0], header[1], header[2], header[3]) == (20240520, 1, len(ids), len(tok))
    assert os.path.getsize(tokens) == 1024 + 2 * len(ids)
    assert ids[-1].item() == tok.eos_token_id
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    # The ids decode to the corpus (pieces are cut at line ends, so the text comes back whole).
    assert tok.decode(ids[:-1].tolist()) == text


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_transformers_loads_what_headroom_fine_tuned_and_agrees_on_its_loss(family, tmp_path, tokenizer_dir, tokens):
    base, base_model = save_base(family, tmp_path / "base")
    tuned = str(tmp_path / "tuned")
    done = run_headroom("train", "--weights", base, "--data-tokens", tokens, "--steps", "4", "--batch", str(BATCH),
                        "--seq", str(SEQ), "--eval-rows", str(EVAL_ROWS), "--lr", "1e-3", "--device", "cpu",
                        "--save-weights", tuned, "--json", "--quiet")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    model = transformers.AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.float32)
    model.eval()
    assert type(model) is type(base_model)
    # Trained: the weights moved from the base's.
    moved = [name for name, p in model.state_dict().items() if not torch.equal(p, base_model.state_dict()[name])]
    assert len(moved) > 0
    theirs = held_out_loss(model, tokens)
    print(f"{family}: transformers {theirs:.6f}, headroom {summary['eval_loss']:.6f}, |diff| {abs(theirs - summary['eval_loss']):.1e}")
    assert abs(theirs - summary["eval_loss"]) < 1e-4
    with open(os.path.join(tuned, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"


def test_bad_checkpoints_and_ids_end_the_run_with_one_line_and_write_nothing(tmp_path, tokenizer_dir, tokens):
    base, _ = save_base("qwen3", tmp_path / "base")
    with open(os.path.join(base, "model.safetensors"), "rb") as f:
        good = f.read()
    header_len = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + header_len])

    def refused(name, data=None, config_edit=None, token_file=tokens):
        d = tmp_path / name
        d.mkdir()
        with open(d / "model.safetensors", "wb") as f:
            f.write(good if data is None else data)
        with open(os.path.join(base, "config.json")) as f:
            config = json.load(f)
        if config_edit:
            config.update(config_edit)
        with open(d / "config.json", "w") as f:
            json.dump(config, f)
        out = tmp_path / (name + "-out")
        done = run_headroom("train", "--weights", str(d), "--data-tokens", token_file, "--steps", "2", "--seq",
                            str(SEQ), "--device", "cpu", "--save-weights", str(out), "--quiet")
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert not out.exists()
        return lines[0]

    assert "truncated" in refused("truncated", good[:len(good) - 100])
    # A header whose offsets run past the data it has.
    lying = dict(header)
    first = next(k for k in lying if k != "__metadata__")
    lying[first] = dict(lying[first], data_offsets=[0, lying[first]["data_offsets"][1] + 4096])
    text = json.dumps(lying).encode()
    assert "'" + first + "'" in refused("lying", len(text).to_bytes(8, "little") + text + good[8 + header_len:])
    # The checkpoint of another width: every tensor mis-shaped for the config it comes with.
    message = refused("shaped", config_edit={"intermediate_size": 96})
    assert "has shape" in message and "needs" in message
    # Ids beyond the model's vocabulary (the tokenizer's 400 ids into a 300-entry model).
    assert "tokenised for a vocabulary of 400" in refused("vocab", config_edit={"vocab_size": 300})
