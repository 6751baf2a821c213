"""Fine-tuning a pretrained checkpoint end to end, with transformers on both sides: transformers
saves a model and a tokenizer; tools/tokenize_corpus.py turns the corpus into the tokenizer's ids; headroom
loads the checkpoint, fine-tunes it on those ids and saves it; transformers loads what headroom
saved, and its loss on the held-out windows headroom evaluated equals headroom's evaluation loss.
Then the bad inputs: a truncated or lying checkpoint, a mis-shaped tensor and ids outside the
vocabulary each end the run with one line and exit 2, and nothing is written."""
import array
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SEQ, EVAL_ROWS, BATCH = 32, 8, 2
BINARY = os.environ.get("HEADROOM_BINARY", os.path.join(ROOT, "build", "headroom"))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")

# Small widths keep a CPU run to seconds; what is tested is that names, layouts and values survive
# the round trip: tied (qwen3) and untied heads, gpt2's transposed Conv1D weights, Mixtral's experts.
CONFIGS = {
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=2, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_head=4, n_layer=2, n_positions=128, bos_token_id=0, eos_token_id=0),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here on the corpus (no hub): 400 ids, an end-of-text among them."""
    out = tmp_path_factory.mktemp("tokenizer")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train([CORPUS], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def tokens(tokenizer_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tokens") / "corpus.bin")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "tokenize_corpus.py"), "--tokenizer", tokenizer_dir,
                           "--out", out, CORPUS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


def read_ids(path):
    with open(path, "rb") as f:
        header = array.array("i")
        header.frombytes(f.read(1024))
        ids = array.array("H" if header[1] == 1 else "I")
        ids.frombytes(f.read())
    return header, torch.tensor(ids.tolist(), dtype=torch.long)


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


def run_headroom(*args):
    return subprocess.run([BINARY, *args], capture_output=True, text=True, timeout=900)


def save_base(family, tmp_path, tokenizer_dir):
    cls = transformers.CONFIG_MAPPING[CONFIGS[family]["model_type"]]
    fields = {k: v for k, v in CONFIGS[family].items() if k != "model_type"}
    config = cls(vocab_size=448, **fields)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    base = str(tmp_path / "base")
    model.save_pretrained(base)
    return base, model


def held_out_loss(model, tokens):
    """The loss over headroom's evaluation windows: the last 10% of the ids, EVAL_ROWS windows of SEQ."""
    _, ids = read_ids(tokens)
    n_eval = int(len(ids) * 0.1)
    tail = ids[len(ids) - n_eval:]
    rows = min((n_eval - 1) // SEQ, EVAL_ROWS)
    windows = torch.stack([tail[r * SEQ:r * SEQ + SEQ + 1] for r in range(rows)])
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                             windows[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_transformers_loads_what_headroom_fine_tuned_and_agrees_on_its_loss(family, tmp_path, tokenizer_dir, tokens):
    base, base_model = save_base(family, tmp_path, tokenizer_dir)
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
    base, _ = save_base("qwen3", tmp_path, tokenizer_dir)
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
