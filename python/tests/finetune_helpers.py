"""What the fine-tuning tests share: a tokenizer trained here on the corpus (no hub), the corpus as
its ids (tools/tokenize_corpus.py), small transformers checkpoints, headroom's CLI, and the loss over the
held-out windows headroom evaluates."""
import array
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


def make_tokenizer(out):
    """A byte-level BPE tokenizer trained here on the corpus (no hub): 400 ids, an end-of-text among them."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train([CORPUS], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return str(out)


def make_tokens(tokenizer_dir, out):
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


def run_headroom(*args):
    return subprocess.run([BINARY, *args], capture_output=True, text=True, timeout=900)


def save_base(family, out_dir, **changes):
    """A random transformers model of `family` (CONFIGS, with `changes`), saved by save_pretrained into out_dir."""
    cls = transformers.CONFIG_MAPPING[CONFIGS[family]["model_type"]]
    fields = {k: v for k, v in CONFIGS[family].items() if k != "model_type"}
    fields.update(changes)
    config = cls(vocab_size=448, **fields)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(str(out_dir))
    return str(out_dir), model


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
