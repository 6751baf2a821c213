"""Any model: headroom.estimate(model, inputs) against a real training step of the same model.

The zoo: models of transformers and peft that headroom does not implement itself (none of gpt2,
llama, mistral, qwen2, gpt_neox), each at its published widths and vocabulary with depth shrunk —
an encoder, two encoder-decoders, vision models, a mixture of experts, a peft LoRA decoder,
PyTorch's own nn.TransformerEncoder with a custom loss, bf16 autocast and checkpointing. The
estimate is built on the meta device; the measurement is a plain torch loop over a real copy
(not headroom's step runner, nor its trace), peaks read from headroom's counting allocator.

The bound docs/any-model.md states: the step's peak within 1%, each phase's within 2%. The test holds a
subset of the zoo to it (TESTED); bench/anymodel_zoo.py measures every model.
"""
import gc

import headroom
import peft
import pytest
import torch
import transformers

STEPS = 2
PHASES = ("forward", "backward", "optimizer", "zero_grad")
PEAK_BOUND, PHASE_BOUND = 0.01, 0.02


def ids(batch, seq, vocab, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def lm(config_class, model_class, **config):
    cfg = config_class(**config)
    return (lambda: model_class(cfg)), (lambda: {"input_ids": ids(1, 64, cfg.vocab_size), "labels": ids(1, 64, cfg.vocab_size)})


def qwen3(layers=2, **extra):
    return dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, **extra)


def bert():
    return lm(transformers.BertConfig, transformers.BertForMaskedLM, num_hidden_layers=2)


def t5():
    cfg = transformers.T5Config(d_model=512, d_ff=2048, num_layers=2, num_decoder_layers=2, num_heads=8, vocab_size=32128,
                                  decoder_start_token_id=0, pad_token_id=0)
    return (lambda: transformers.T5ForConditionalGeneration(cfg)), (
        lambda: {"input_ids": ids(2, 64, 32128), "labels": ids(2, 32, 32128, seed=1)})


def bart():
    cfg = transformers.BartConfig(encoder_layers=2, decoder_layers=2)  # bart-large widths (1024), vocab 50,265
    return (lambda: transformers.BartForConditionalGeneration(cfg)), (
        lambda: {"input_ids": ids(1, 64, cfg.vocab_size), "labels": ids(1, 64, cfg.vocab_size, seed=1)})


def vit():
    cfg = transformers.ViTConfig(num_hidden_layers=2, num_labels=1000)  # vit-base: 768 wide, 224 px, 16 px patches
    return (lambda: transformers.ViTForImageClassification(cfg)), (
        lambda: {"pixel_values": torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)),
                 "labels": torch.tensor([3, 7])})


def clip():
    cfg = transformers.CLIPConfig(text_config={"num_hidden_layers": 2}, vision_config={"num_hidden_layers": 2})
    return (lambda: transformers.CLIPModel(cfg)), (
        lambda: {"input_ids": ids(2, 32, 49408), "pixel_values": torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)),
                 "return_loss": True})


def qwen3_moe():
    # Qwen3-30B-A3B's widths and vocabulary, 8 of its 128 experts, top-8 routing of its own.
    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                      num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                      num_experts=8, num_experts_per_tok=2, vocab_size=151936)
    return (lambda: transformers.Qwen3MoeForCausalLM(cfg)), (
        lambda: {"input_ids": ids(1, 64, cfg.vocab_size), "labels": ids(1, 64, cfg.vocab_size)})


def qwen3_lora():
    cfg = transformers.Qwen3Config(**qwen3())

    def make():
        base = transformers.Qwen3ForCausalLM(cfg)
        return peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))

    return make, (lambda: {"input_ids": ids(1, 64, cfg.vocab_size), "labels": ids(1, 64, cfg.vocab_size)})


class Regressor(torch.nn.Module):
    """PyTorch's own encoder, trained with a loss of the user's."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = torch.nn.Linear(1024, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def regressor():
    return Regressor, (lambda: (torch.randn(4, 128, 1024, generator=torch.Generator().manual_seed(0)),))


def mse(output, inputs):
    return output.float().pow(2).mean()


# name, builder, estimate settings, loss_fn
ZOO = [
    ("bert-base (encoder)", bert, {}, None),
    ("bert-base, bf16 autocast", bert, {"precision": "bf16-mixed"}, None),
    ("bert-base, bf16 autocast, checkpointing", bert, {"precision": "bf16-mixed", "checkpointing": "full"}, None),
    ("t5-small (encoder-decoder)", t5, {}, None),
    ("bart-large (encoder-decoder)", bart, {}, None),
    ("vit-base (vision)", vit, {}, None),
    ("clip (text and vision)", clip, {}, None),
    ("qwen3-0.6b widths (tied)", lambda: lm(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **qwen3(5)), {}, None),
    ("qwen3-0.6b widths, checkpointing", lambda: lm(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **qwen3(3)),
     {"checkpointing": "full"}, None),
    ("qwen3-0.6b widths, pure bf16", lambda: lm(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **qwen3(5)),
     {"precision": "bf16"}, None),
    ("qwen3 + peft LoRA r=16 q,v", qwen3_lora, {}, None),
    # Plain SGD: AdamW's update over the untied vocabulary's two 311M-parameter matrices was half of
    # this model's time; AdamW in pure bf16 is the tied qwen3's above.
    ("qwen3-30b-a3b widths, 8 experts (MoE), pure bf16, SGD", qwen3_moe, {"precision": "bf16", "optimizer": "sgd"}, None),
    ("gemma-3-1b widths (sliding and global)", lambda: lm(
        transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        sliding_window=512, layer_types=["sliding_attention", "full_attention"]), {}, None),
    ("phi-3-mini widths (untied)", lambda: lm(
        transformers.Phi3Config, transformers.Phi3ForCausalLM, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064), {}, None),
    ("nn.TransformerEncoder, custom loss", regressor, {}, mse),
]
# The test's subset, one of each kind (an encoder with autocast and checkpointing, an encoder-decoder,
# vision, text and vision, a tied decoder extrapolated from 3 traced blocks, peft LoRA, an untied
# mixture of experts, a user's module and loss); bench/anymodel_zoo.py runs the whole zoo.
TESTED = ["bert-base, bf16 autocast, checkpointing", "t5-small (encoder-decoder)", "vit-base (vision)",
          "clip (text and vision)", "qwen3-0.6b widths, pure bf16", "qwen3 + peft LoRA r=16 q,v",
          "qwen3-30b-a3b widths, 8 experts (MoE), pure bf16, SGD", "nn.TransformerEncoder, custom loss"]
assert set(TESTED) <= {z[0] for z in ZOO}


OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
              "sgd": lambda params: torch.optim.SGD(params, lr=1e-4)}


def optimizer_for(settings):
    """The entry's optimizer (AdamW unless it names another), the same for the loop and the estimate."""
    return OPTIMIZERS[settings.get("optimizer", "adamw")]


def measured(build, make_inputs, settings, loss_fn):
    """A plain loop: the model, AdamW, STEPS steps; each phase's peak above what was live before."""
    gc.collect()
    start = headroom._core.cpu_live_bytes()
    torch.manual_seed(0)
    model = build()
    if settings.get("precision") == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    if settings.get("checkpointing") == "full":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    inputs = make_inputs()
    opt = optimizer_for(settings)([p for p in model.parameters() if p.requires_grad])
    peaks = dict.fromkeys(PHASES, 0)

    def run(phase, fn):
        headroom._core.reset_cpu_peak()
        out = fn()
        peaks[phase] = max(peaks[phase], headroom._core.cpu_peak_bytes() - start)
        return out

    autocast = settings.get("precision") == "bf16-mixed"
    for _ in range(STEPS):
        def forward():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
                return loss_fn(out, inputs) if loss_fn else out.loss
        loss = run("forward", forward)
        run("backward", loss.backward)
        del loss
        run("optimizer", opt.step)
        run("zero_grad", lambda: opt.zero_grad(set_to_none=True))
    del model, opt, inputs
    gc.collect()
    return peaks


def estimated(build, make_inputs, settings, loss_fn):
    with torch.device("meta"):
        model = build()
    rest = {k: v for k, v in settings.items() if k != "optimizer"}
    return headroom.estimate(model, make_inputs(), loss_fn=loss_fn, optimizer=optimizer_for(settings), **rest)


_RESULTS = {}


def compared(name):
    if name not in _RESULTS:
        _, builder, settings, loss_fn = next(z for z in ZOO if z[0] == name)
        build, make_inputs = builder()
        est = estimated(build, make_inputs, settings, loss_fn)
        meas = measured(build, make_inputs, settings, loss_fn)
        _RESULTS[name] = (est, meas)
        peak = max(meas.values())
        errs = {p: est["phases"][p] / meas[p] - 1 for p in PHASES if meas[p] > 0}
        print(f"\n| {name} | {est['peak_bytes']:,} | {peak:,} | {est['peak_bytes'] / peak - 1:+.3%} | "
              f"{max(errs.values(), key=abs):+.3%} | {est['traced']['note']} |")
    return _RESULTS[name]


@pytest.mark.parametrize("name", TESTED)
def test_peak_matches_a_real_step(name):
    est, meas = compared(name)
    peak = max(meas.values())
    assert abs(est["peak_bytes"] / peak - 1) <= PEAK_BOUND, (name, est["peak_bytes"], peak)


@pytest.mark.parametrize("name", TESTED)
def test_phase_peaks_match_a_real_step(name):
    est, meas = compared(name)
    for p in PHASES:
        if meas[p] > 0:
            assert abs(est["phases"][p] / meas[p] - 1) <= PHASE_BOUND, (name, p, est["phases"][p], meas[p])


def small_decoder(layers, **extra):
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=151936, **extra)
    with torch.device("meta"):
        return transformers.Qwen3ForCausalLM(cfg)


BATCH = {"input_ids": ids(2, 32, 151936), "labels": ids(2, 32, 151936)}


def same_estimate(short, full):
    for key in ("peak_bytes", "peak_phase", "phases", "breakdown", "reserved_bytes", "flops_per_step"):
        assert short[key] == full[key], key


# Tied and untied with the defaults and with checkpointing; each other setting one way.
@pytest.mark.parametrize("settings,tied", [({}, True), ({}, False), ({"checkpointing": "full"}, True),
                                           ({"checkpointing": "full"}, False), ({"precision": "bf16-mixed"}, True),
                                           ({"precision": "bf16"}, False), ({"device": "cuda"}, True),
                                           ({"optimizer": "sgd"}, False)], ids=str)
def test_identical_blocks_traced_at_three_equal_a_full_depth_trace(settings, tied):
    from headroom.anymodel import estimate_model

    model = small_decoder(7, tie_word_embeddings=tied)
    short = headroom.estimate(model, BATCH, **settings)
    assert short["traced"]["extrapolated"] and short["traced"]["traced_depth"] == 3, short["traced"]
    assert "traced blocks 0-1, 6 (and blocks 0-2, 6 to check), repeated to 7" in short["traced"]["note"]
    full = estimate_model(model, BATCH, extrapolate=False, **settings)
    assert not full["traced"]["extrapolated"]
    same_estimate(short, full)


@pytest.mark.parametrize("settings", [{}, {"precision": "bf16-mixed", "checkpointing": "full"}], ids=str)
def test_blocks_of_two_kinds_traced_one_of_each_neighbourhood_equal_a_full_depth_trace(settings):
    # Gemma 3: five sliding-window layers to one global, at gemma-3-1b's vocabulary.
    from headroom.anymodel import estimate_model

    cfg = transformers.Gemma3TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=14, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=64, vocab_size=262144, sliding_window=16)
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(cfg)
    batch = {"input_ids": ids(1, 32, 262144), "labels": ids(1, 32, 262144)}
    short = headroom.estimate(model, batch, **settings)
    assert short["traced"]["kinds"] == 2 and short["traced"]["traced_depth"] == 8, short["traced"]
    assert "14 blocks of 2 kinds in model.layers: traced blocks 0-6, 13" in short["traced"]["note"]
    same_estimate(short, estimate_model(model, batch, extrapolate=False, **settings))


class Stack(torch.nn.Module):
    """Linear blocks of one class, with and without bias in no repeating order: no shorter stack
    holds every block's neighbours."""

    def __init__(self, biased):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(256, 256, bias=b) for b in biased)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def test_blocks_without_a_repeating_neighbourhood_are_traced_whole_and_said_so():
    with torch.device("meta"):
        model = Stack([False, True, True, False, False, False, True, False])
    out = headroom.estimate(model, (torch.randn(8, 256),), loss_fn=lambda o, i: o.sum())
    assert not out["traced"]["extrapolated"] and out["traced"]["kinds"] == 2
    assert "traced at full depth (no shorter stack holds every block's neighbours)" in out["traced"]["note"]


def test_a_first_block_without_input_gradient_is_a_kind_of_its_own():
    # nn.TransformerEncoder's first layer gets the user's tensor, which needs no gradient: it
    # allocates less than the layers after it (and its last feeds the loss directly): the shallow
    # stack keeps the first, two blocks after it, and the last.
    from headroom.anymodel import estimate_model

    layer = torch.nn.TransformerEncoderLayer(256, 4, 512, batch_first=True, dropout=0.0)
    with torch.device("meta"):
        model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)
    x = (torch.randn(2, 64, 256),)
    short = headroom.estimate(model, x, loss_fn=mse)
    assert "traced blocks 0-3, 7 (and blocks 0-4, 7 to check), repeated to 8" in short["traced"]["note"], short["traced"]
    same_estimate(short, estimate_model(model, x, loss_fn=mse, extrapolate=False))


def test_frozen_parameters_get_no_gradient_and_no_state():
    model = small_decoder(2)
    full = headroom.estimate(model, BATCH)
    for p in model.model.embed_tokens.parameters():
        p.requires_grad_(False)
    frozen = headroom.estimate(model, BATCH)
    embed = 151936 * 256 * 4
    assert frozen["model"]["trainable_params"] == full["model"]["trainable_params"] - 151936 * 256
    # AdamW's two states of the embedding, and its gradient, are gone from the update.
    assert full["phases"]["optimizer"] - frozen["phases"]["optimizer"] >= 3 * embed


def test_an_update_that_allocates_nothing_peaks_at_what_is_live():
    """Plain SGD on the cpu updates in place: its phase has no allocation, and its peak is the
    weights, their gradients and the input, by hand."""
    with torch.device("meta"):
        model = torch.nn.Linear(1024, 1024)
    out = headroom.estimate(model, (torch.randn(8, 1024),), loss_fn=lambda o, i: o.sum(), optimizer="sgd")
    weights = 4 * (1024 * 1024 + 1024)
    assert out["phases"]["optimizer"] == 2 * weights + 4 * 8 * 1024


def test_nothing_is_left_on_the_model():
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = {"input_ids": ids(2, 16, 512), "labels": ids(2, 16, 512)}
    headroom.estimate(model, batch, checkpointing="full")
    headroom.measure(model, batch)
    assert not model.training and not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and "forward" not in m.__dict__
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not getattr(p, "_is_fake", False) and type(p.data) is torch.Tensor for p in model.parameters())
    # and it trains normally afterwards
    opt = torch.optim.AdamW(model.parameters())
    model.train()
    model(**batch).loss.backward()
    opt.step()


def test_a_model_without_a_loss_is_told_what_to_pass():
    with pytest.raises(ValueError, match="without a loss"):
        headroom.estimate(small_decoder(2), {"input_ids": ids(1, 8, 151936)})


def test_inputs_that_do_not_fit_get_the_models_own_error_with_what_headroom_was_doing():
    with pytest.raises(Exception, match="headroom.estimate: tracing Qwen3ForCausalLM"):
        # labels one token longer than the sequence: transformers' loss refuses the shapes
        headroom.estimate(small_decoder(2), {"input_ids": ids(1, 8, 151936), "labels": ids(1, 9, 151936)})


def test_a_model_needs_its_inputs():
    with pytest.raises(ValueError, match="inputs are needed"):
        headroom.estimate(small_decoder(2))
