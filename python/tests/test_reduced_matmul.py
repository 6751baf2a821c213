"""The tests' bf16/fp16 cpu matmul (reduced_matmul.py) must not change what they measure: its result
and nothing more from the counting allocator (what LibTorch's kernel, its out= form, which the
registrations leave alone, allocates on a cpu without oneDNN's path for the dtype), and the float32
product rounded once."""
import headroom
import pytest
import torch


def peak_of(fn):
    start = headroom._core.cpu_live_bytes()
    headroom._core.reset_cpu_peak()
    out = fn()
    peak = headroom._core.cpu_peak_bytes() - start
    del out
    return peak


def test_the_registrations_are_the_cpu_kernels_the_dispatcher_calls():
    for op in ("aten::mm", "aten::addmm"):
        assert "reduced_matmul.py" in torch._C._dispatch_dump(op), op


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_allocates_what_libtorchs_kernel_does_and_rounds_once(dtype, transposed):
    g = torch.randn(24, 320, dtype=dtype)
    w = torch.randn(320, 48, dtype=dtype)
    if transposed:
        w = w.t().contiguous().t()
    bias = torch.randn(48, dtype=dtype)
    exact = (g.float() @ w.float()).to(dtype)  # float32 in w's own layout, as the registration reads it
    assert torch.equal(g @ w, exact)
    exact_addmm = torch.addmm(bias.float(), g.float(), w.float(), beta=0.5, alpha=2).to(dtype)
    assert torch.equal(torch.addmm(bias, g, w, beta=0.5, alpha=2), exact_addmm)

    def libtorch():
        out = torch.empty(24, 48, dtype=dtype)
        return torch.ops.aten.mm.out(g, w, out=out)
    # Its result and nothing more, as LibTorch's kernel allocates on a cpu without oneDNN's path for
    # the dtype; where oneDNN runs it (AVX-512 BF16, AMX) LibTorch's also takes packing scratch.
    result = 24 * 48 * torch.finfo(dtype).bits // 8
    assert peak_of(lambda: g @ w) == result
    assert peak_of(libtorch) >= result
    assert torch.allclose(libtorch().float(), exact.float(), rtol=2e-2, atol=0.5)
