"""headroom's AdamW with 8-bit states against bitsandbytes' AdamW8bit (its cpu build), on the same
tensors: the same dynamic quantisation maps, and parameters that follow float32 AdamW as closely as
bitsandbytes' do. bitsandbytes quantises its optimizer states in blocks of 256 values; headroom in
blocks of 2048, as the issue that asked for it specifies, which costs 4 bytes of absmax per 2048
values instead of per 256."""
import headroom
import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
from headroom import _core  # noqa: E402

BETAS, EPS, WD, LR = (0.9, 0.95), 1e-8, 0.1, 1e-3


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_maps_are_bitsandbytes(signed):
    ours = torch.tensor(_core.dynamic_map(signed))
    theirs = torch.sort(bnb.functional.create_dynamic_map(signed=signed)).values
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-9)


def test_the_update_follows_adamw_as_bitsandbytes_does():
    torch.manual_seed(0)
    start = torch.randn(64, 512)  # 32768 values: 16 of headroom's blocks, 128 of bitsandbytes'
    direction = torch.randn(64, 512)
    grads = [(direction + torch.randn(64, 512)) * torch.linspace(0.01, 1, 512) for _ in range(50)]
    ours, theirs, reference = (start.clone().requires_grad_(True) for _ in range(3))
    mine = _core.Optimizer("adamw8bit", [ours], weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    bnb_opt = bnb.optim.AdamW8bit([theirs], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    torch_opt = torch.optim.AdamW([reference], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in grads:
        for p in (ours, theirs, reference):
            p.grad = g.clone()
        mine.step(LR)
        bnb_opt.step()
        torch_opt.step()
    with torch.no_grad():
        moved = (reference - start).norm()
        ours_off = ((ours - reference).norm() / moved).item()
        theirs_off = ((theirs - reference).norm() / moved).item()
        between = ((ours - theirs).norm() / moved).item()
    print(f"deviation from torch's AdamW, relative to how far it moved: headroom {ours_off:.4f}, "
          f"bitsandbytes {theirs_off:.4f}; between them {between:.4f}")
    assert ours_off < 0.05 and theirs_off < 0.05
    assert ours_off < 2 * theirs_off + 0.01  # no worse than bitsandbytes by more than its own error
    # The state: 2 bytes per value and an absmax per block each, ours per 2048 values, theirs per 256.
    state = mine.state()
    assert state["p0.state1"].dtype == torch.uint8 and state["p0.absmax1"].numel() == 32768 // 2048
    theirs_state = bnb_opt.state[theirs]
    assert theirs_state["state1"].dtype == torch.uint8 and theirs_state["absmax1"].numel() == 32768 // 256
    assert mine.state_bytes() == 2 * 32768 + 2 * 4 * (32768 // 2048) + 4


def test_the_any_model_estimate_of_bitsandbytes_adamw8bit_matches_its_measured_step():
    """A user's own model with bitsandbytes' AdamW8bit through `import headroom`: the 8-bit update is
    bitsandbytes' own operator, whose cpu kernel dequantises every state to float32 and back; the
    trace opens it, so the optimizer phase's peak is predicted as measured, and the state it counts
    is what the optimizer really holds after a step."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=1,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      vocab_size=151936, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    inputs = {"input_ids": ids, "labels": ids}

    made = []

    def make(params):
        made.append(bnb.optim.AdamW8bit(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD))
        return made[-1]

    predicted = headroom.estimate(model, inputs, optimizer=make)
    measured = headroom.measure(model, inputs, optimizer=make)
    assert predicted["peak_phase"] == measured["peak_phase"] == "optimizer"
    assert abs(predicted["peak_bytes"] - measured["peak_bytes"]) <= 0.01 * measured["peak_bytes"]
    # The state, counted independently: the state tensors of the optimizer that measure's real
    # steps ran (made last; the estimate's, first, had fake ones).
    opt = made[-1]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # the quantisation maps are shared
                for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    held = sum(storages.values())
    # Less the two 256-value float32 maps, which AdamW8bit makes when it is constructed, not in a step.
    assert predicted["breakdown"]["optimizer"] == held - 2 * 256 * 4
