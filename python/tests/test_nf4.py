"""headroom's NF4 (--base-weights nf4) against bitsandbytes' (its cpu build): the same 16 code values,
and the same packed codes and absmax for the same weight in blocks of 64 — what transformers' QLoRA
(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")) stores."""
import os

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
from headroom import _core  # noqa: E402


def test_the_code_is_bitsandbytes_nf4():
    theirs = bnb.functional.get_4bit_type("nf4", device="cpu").tolist()
    assert _core.nf4_code() == pytest.approx(theirs, abs=2e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_quantises_as_bitsandbytes_does(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(256, 512) * 0.02).to(dtype)
    codes, absmax = _core.nf4_quantise(weight)
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    assert torch.equal(absmax, state.absmax.float())
    assert torch.equal(codes, packed.reshape(-1))


def test_import_headroom_estimates_qlora_and_offload_for_a_config():
    """The Python entry points take the same settings as the flags: an NF4 base's weights shrink by
    the bytes worked out by hand, and an offloaded optimizer's state moves to host_bytes."""
    import headroom

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "qwen3-0.6b.json")
    common = dict(batch=1, seq=16, precision="bf16", finetune="lora:r=8,targets=q,v", optimizer_impl="headroom")
    dense = headroom.estimate(path, **common)
    nf4 = headroom.estimate(path, base_weights="nf4", **common)
    # 28 layers of q, k, v, o, gate, up, down: 2 bytes a value dense, 1/2 + 4/64 in NF4.
    n = 28 * (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072)
    assert dense["breakdown"]["weights"] - nf4["breakdown"]["weights"] == 2 * n - (n // 2 + 4 * (n // 64))
    offloaded = headroom.estimate(path, offload="optimizer", **common)
    # On the host: each trained value's copy, gradient and two AdamW moments (bf16: 2 bytes each), and
    # a float32 step counter for each of the 28 layers' 2 adapters of 2 matrices.
    trained = offloaded["model"]["trainable_params"]
    assert offloaded["host_bytes"] == trained * (2 + 2 + 2 * 2) + 28 * 2 * 2 * 4
    assert dense["host_bytes"] == 0
