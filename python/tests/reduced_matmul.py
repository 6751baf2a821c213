"""The Python tests' bf16 and fp16 matrix products on the cpu, through float32 (imported by conftest).

A cpu without AVX-512 has no oneDNN path for a bf16 or fp16 matmul, and LibTorch's fallback loop is
slow where the product is untransposed: a linear's input gradient, grad @ weight (Qwen3's head at 64
tokens, 64 x 151,936 x 1,024: 97 s against 0.37 s in float32, measured on an AMD EPYC). The C++ test
programs link src/testing/reduced_precision_matmul.cpp for this; these are the same registrations
for the pytest processes: aten::mm and aten::addmm on the cpu compute a bf16/fp16 product of 2-D
operands BLAS reads in place in float32, in numpy memory that no c10 allocator (so not the counting
allocator) sees, rounded once into a result allocated as LibTorch's kernel allocates it. Everything
else goes to LibTorch's own out= kernels, into the same one result tensor.
"""
import warnings

import numpy as np
import torch

_REDUCED = (torch.bfloat16, torch.float16)


def _in_place(t: torch.Tensor) -> bool:
    if t.dim() != 2 or t.numel() == 0:
        return False
    rows, cols = t.stride()
    return (cols == 1 and rows >= max(1, t.size(1))) or (rows == 1 and cols >= max(1, t.size(0)))


def _through_float(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype in _REDUCED and b.dtype == a.dtype and _in_place(a) and _in_place(b)
            and not a.is_conj() and not b.is_conj())


# Float32 scratch kept between products, one buffer per operand: fresh pages cost the first copy
# into them twenty times the copy itself (Qwen3's head: 1.8 s against 0.09 s).
_SCRATCH = {}

# In small pages: NumPy asks the kernel for transparent huge pages on its large arrays, and where
# the kernel compacts memory to find them (defrag "madvise", this machine's) the scratch's first
# pages cost far more than they save. Qwen3-30B-A3B's widths (test_anymodel.py's mixture of
# experts, pure bf16): its first backward 21.7 s, 18 s of it in the kernel, against 3.8 s.
_set_madvise_hugepage = getattr(getattr(getattr(np, "_core", None) or np.core, "multiarray", None),
                                "_set_madvise_hugepage", None)  # NumPy's own switch, private
if _set_madvise_hugepage is not None:
    _set_madvise_hugepage(False)


def _float(shape, role: str) -> torch.Tensor:
    n = int(np.prod(shape))
    buffer = _SCRATCH.get(role)
    if buffer is None or buffer.size < n:
        buffer = _SCRATCH[role] = np.empty(n, dtype=np.float32)
    return torch.from_numpy(buffer[:n]).view(tuple(shape))


def _float_copy(t: torch.Tensor, role: str) -> torch.Tensor:
    """A float32 copy in t's own layout (a transposing copy is twenty times slower), which BLAS
    reads transposed in place."""
    if t.stride(1) != 1:  # column-major (_in_place): copied as its transpose, row by row
        return _float_copy(t.t(), role).t()
    return _float(t.shape, role).copy_(t)


def _result(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty((a.size(0), b.size(1)), dtype=a.dtype, device=a.device)


def _mm(a, b):
    out = _result(a, b)
    if not _through_float(a, b):
        return torch.ops.aten.mm.out(a, b, out=out)
    out32 = _float(out.shape, "out")
    torch.ops.aten.mm.out(_float_copy(a, "a"), _float_copy(b, "b"), out=out32)
    return out.copy_(out32)


def _addmm(self, a, b, *, beta=1, alpha=1):
    out = _result(a, b)
    if not _through_float(a, b) or self.dtype != a.dtype or self.dim() > 2:
        return torch.ops.aten.addmm.out(self, a, b, beta=beta, alpha=alpha, out=out)
    out32 = _float(out.shape, "out").copy_(self.expand(out.shape))
    out32.addmm_(_float_copy(a, "a"), _float_copy(b, "b"), beta=beta, alpha=alpha)
    return out.copy_(out32)


_LIBRARY = torch.library.Library("aten", "IMPL")
with warnings.catch_warnings():  # LibTorch's warning that a kernel is replaced: expected here
    warnings.simplefilter("ignore")
    _LIBRARY.impl("mm", _mm, "CPU")
    _LIBRARY.impl("addmm", _addmm, "CPU")
