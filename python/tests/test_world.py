"""estimate(model, inputs, world_size=N, parallelize=fn): one rank of the user's own FSDP2 (and
FSDP2 x tensor parallel) run, traced under a fake process group, against the same run made real:
torchrun, Gloo, N cpu processes, each rank's peak counted by headroom's allocator (fsdp_step.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import headroom
from world_models import MODELS, _smollm, fsdp_bf16, inputs_for

HERE = os.path.dirname(os.path.abspath(__file__))


# The runs measured: each world size's models in one launch of torchrun, one after another.
RUNS = [("smollm-fsdp-bf16", 2), ("smollm-fsdp-bf16", 4), ("smollm-untied-fsdp-fp32-keep", 2),
        ("smollm-fsdp-bf16-per-op", 2), ("smollm-fsdp2-tp2", 4)]
_MEASURED = {}


def _measured(name: str, ranks: int, tmp_path_factory) -> list:
    if ranks not in _MEASURED:
        names = [n for n, r in RUNS if r == ranks]
        out = tmp_path_factory.mktemp(f"ranks{ranks}")
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(headroom.__file__)),
                                                          os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
        run = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={ranks}",
                              os.path.join(HERE, "fsdp_step.py"), ",".join(names), str(out)],
                             env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        _MEASURED[ranks] = {n: [json.load(open(out / f"{n}.rank{r}.json")) for r in range(ranks)] for n in names}
    return _MEASURED[ranks][name]


@pytest.mark.parametrize("name,ranks", RUNS)
def test_a_ranks_estimate_is_its_measured_peak(name, ranks, tmp_path_factory):
    build, parallelize, settings = MODELS[name]
    measured = _measured(name, ranks, tmp_path_factory)
    with torch.device("meta"):
        model = build()
    for r in sorted({0, ranks - 1}):
        est = headroom.estimate(model, inputs_for(name, torch.device("meta")), world_size=ranks, rank=r,
                                parallelize=parallelize, **settings)
        peak = measured[r]["peak_bytes"]
        print(f"{name} rank {r}/{ranks}: estimate {est['peak_bytes']:,} measured {peak:,} "
              f"({(est['peak_bytes'] - peak) / peak:+.4%})")
        assert abs(est["peak_bytes"] - peak) <= 0.02 * peak
        assert est["world"]["world_size"] == ranks and est["world"]["rank"] == r
    # The model the user handed over is untouched: not sharded, still on the meta device.
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.is_meta and type(p) is torch.nn.Parameter for p in model.parameters())


def test_sharding_divides_what_a_rank_holds_by_the_world():
    """Hand count: a rank's fp32 shard of SmolLM's tied 4-block model and AdamW's two states of it."""
    with torch.device("meta"):
        model = _smollm(layers=4)
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding once
    assert params == 49152 * 576 + 4 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
    for n in (2, 8):
        est = headroom.estimate(model, inputs_for("x", torch.device("meta")), world_size=n, parallelize=fsdp_bf16)
        # Each FSDP unit's parameters are padded to a multiple of n along their first dimension.
        assert est["breakdown"]["weights"] == pytest.approx(4 * params / n, rel=0.01)
        assert est["breakdown"]["optimizer"] == pytest.approx(8 * params / n, rel=0.01)


def test_a_deep_stack_is_traced_shallow_and_repeated_exactly():
    with torch.device("meta"):
        model = _smollm(layers=7)
    inputs = inputs_for("x", torch.device("meta"))
    from headroom.anymodel import estimate_model

    deep = estimate_model(model, inputs, world_size=4, parallelize=fsdp_bf16, extrapolate=False)
    shallow = estimate_model(model, inputs, world_size=4, parallelize=fsdp_bf16)
    assert shallow["traced"]["extrapolated"], shallow["traced"]["note"]
    assert shallow["peak_bytes"] == deep["peak_bytes"] and shallow["phases"] == deep["phases"]


def test_what_cannot_be_traced_at_world_size_is_refused_in_one_line():
    with torch.device("meta"):
        model = _smollm(layers=2)
    inputs = inputs_for("x", torch.device("meta"))
    with pytest.raises(ValueError, match="rank 4: accepted: an integer from 0 to world_size - 1"):
        headroom.estimate(model, inputs, world_size=4, rank=4, parallelize=fsdp_bf16)
    with pytest.raises(ValueError, match=r"mesh_shape \(3, 2\) holds 6 ranks, not world_size 4"):
        headroom.estimate(model, inputs, world_size=4, mesh_shape=(3, 2), parallelize=fsdp_bf16)
    with pytest.raises(TypeError, match="accepted: a function"):
        headroom.estimate(model, inputs, world_size=2, parallelize="fsdp")
    with pytest.raises(TypeError, match="for a torch.nn.Module"):
        headroom.estimate({"model_type": "llama"}, world_size=2, parallelize=fsdp_bf16)
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="a process group is already initialised"):
            headroom.estimate(model, inputs, world_size=2, parallelize=fsdp_bf16)
    finally:
        dist.destroy_process_group()
    # The user's own error in parallelize, said with where it happened.
    def broken(m, mesh):
        raise ValueError("no such layer")
    with pytest.raises(RuntimeError, match=r"parallelize\(model, mesh\) at world size 2, rank 0: ValueError: no such layer"):
        headroom.estimate(model, inputs, world_size=2, parallelize=broken)
    with pytest.raises(RuntimeError, match="returned a tuple: accepted: the model .or None.; pipeline stages"):
        headroom.estimate(model, inputs, world_size=2, parallelize=lambda m, mesh: (m, m))
    assert not dist.is_initialized()
