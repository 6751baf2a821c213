"""The loss and activation levers in a user's own loop, against transformers' own model:

* ``headroom.chunked_cross_entropy`` over a Qwen3 model's final hidden states and its tied head
  gives the loss transformers computes (``labels=``) and the same parameter gradients, at the real
  width and vocabulary (one layer), in float32 and under bf16 autocast;
* ``headroom.offload_activations`` leaves a step's gradients bitwise unchanged, moves what the
  layers save into the host pool and lowers the device's peak.
"""
import pytest
import torch

import headroom
from headroom import _core

transformers = pytest.importorskip("transformers")


def qwen3(tied=True):
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=1,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                   tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("tied,mixed", [(True, False), (False, False), (False, True)])
def test_chunked_cross_entropy_is_transformers_loss(tied, mixed):
    """float32: within 1e-5. bf16 autocast: the loss within 1e-5, the gradients within one bf16
    rounding (the cpu's bf16 matmuls round by call shape; a few tokens, as its bf16 matmul over the
    151,936-long vocabulary is slow)."""
    model = qwen3(tied)
    rows, seq = (1, 9) if mixed else (2, 33)
    ids = torch.randint(151936, (rows, seq))
    labels = ids.clone()
    labels[-1, :3] = -100  # left out of the mean, as transformers leaves them
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        theirs = model(input_ids=ids, labels=labels).loss
    theirs.backward()
    full = grads(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        hidden = model.model(input_ids=ids).last_hidden_state
        # transformers shifts inside its loss: position t predicts label t + 1
        ours = headroom.chunked_cross_entropy(hidden[:, :-1], model.lm_head.weight, labels[:, 1:],
                                              chunk=3 if mixed else 24)
    ours.backward()
    chunked = grads(model)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert full.keys() == chunked.keys()
    tolerance = 1e-2 if mixed else 1e-5
    for name, g in full.items():
        rel = ((chunked[name] - g).norm() / g.norm()).item()
        assert rel < tolerance, f"{name}: |chunked - full| / |full| = {rel}"


def test_chunked_cross_entropy_refuses_bad_shapes():
    with pytest.raises(ValueError, match="accepted: weight"):
        headroom.chunked_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="positive"):
        headroom.chunked_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.long), chunk=0)


def test_offload_activations_keeps_gradients_and_moves_saved_tensors_to_the_host_pool():
    cfg = transformers.Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    ids = torch.randint(1024, (4, 128))

    def step(offload):
        _core.reset_cpu_peak()
        base = _core.cpu_live_bytes()
        host = _core.cpu_host_live_bytes()
        if offload:
            with headroom.offload_activations():
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        held_on_host = _core.cpu_host_live_bytes() - host
        loss.backward()
        return grads(model), _core.cpu_peak_bytes() - base, held_on_host

    plain, plain_peak, plain_host = step(False)
    moved, moved_peak, moved_host = step(True)
    for name, g in plain.items():
        assert torch.equal(moved[name], g), name
    assert plain_host == 0
    assert moved_host > 0
    assert moved_peak < plain_peak


class _Blocks(torch.nn.Module):
    """A user's own module: residual MLP blocks, a 32,000-token head; each lever switchable."""

    def __init__(self, chunked=False, offload=False):
        super().__init__()
        self.chunked, self.offload = chunked, offload
        self.emb = torch.nn.Embedding(32000, 256)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)) for _ in range(3))
        self.head = torch.nn.Linear(256, 32000, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            if self.offload:
                with headroom.offload_activations():
                    h = h + block(h)
            else:
                h = h + block(h)
        if self.chunked:
            return headroom.chunked_cross_entropy(h[:, :-1], self.head.weight, ids[:, 1:], chunk=64)
        return torch.nn.functional.cross_entropy(self.head(h[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.mark.parametrize("chunked,offload", [(False, False), (True, False), (False, True)])
def test_the_any_model_estimate_predicts_both_levers(chunked, offload):
    """headroom.estimate of a module that uses either lever is its measured step's peak, and each
    lever lowers it."""
    ids = torch.randint(32000, (4, 257))
    peaks = {}
    for c, o in {(False, False), (chunked, offload)}:
        torch.manual_seed(0)
        model = _Blocks(c, o)
        kwargs = dict(loss_fn=lambda out, batch: out, optimizer="sgd")
        e = headroom.estimate(model, ids, **kwargs)["peak_bytes"]
        m = headroom.measure(model, ids, **kwargs)["peak_bytes"]
        assert e == pytest.approx(m, rel=1e-3), (c, o)
        peaks[(c, o)] = m
    if chunked or offload:
        assert peaks[(chunked, offload)] < peaks[(False, False)]
