// The test programs' bf16 and fp16 matrix products on the cpu, through float32.
//
// A cpu without AVX-512 (the AMD EPYC machines the suite has run on) has no oneDNN path for a bf16 or
// fp16 matmul: LibTorch falls back to a scalar loop which, for an untransposed product (a
// linear's input gradient, grad @ weight), strides through memory once per multiply-add. Qwen3's
// head at 64 tokens, 64 × 151,936 × 1,024, takes 97 s there against 0.37 s in float32; every
// reduced-precision row of the estimator's grid at a real vocabulary took minutes a step, and the
// suite ran past CI's limit.
//
// Linked into headroom_tests and the accuracy benches only (never the library, the CLI or the
// Python module), this file registers aten::mm, mm.out and addmm for the cpu: a bf16 or fp16
// product of 2-D operands that BLAS reads in place is computed in float32. Each operand is copied
// into memory of its own (std::vector, outside every c10 allocator, so that the budget allocator
// sees exactly what LibTorch's kernel allocates: the result), multiplied by MKL and rounded once
// into the result. That is the oneDNN path's arithmetic (float32 accumulation, one rounding), the
// same on every x86-64 machine, and about 100x faster where it mattered. Anything else (other
// dtypes, strided or empty operands) goes to LibTorch's own cpu kernel. On a cpu with oneDNN's path
// (AVX-512 BF16, AMX: some Xeons) LibTorch's kernel also takes packing scratch from c10 (215,040
// bytes for a 24 × 320 × 48 bf16 product, measured on a Xeon with AMX), which this one does not:
// the suite measures the same bytes on every machine.
#include <ATen/ATen.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace headroom::testing {
namespace {

bool reduced(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

// A 2-D operand a BLAS call reads in place, rows or columns contiguous: LibTorch's kernel copies
// nothing for it either.
bool in_place_layout(const at::Tensor& t) {
  if (t.dim() != 2 || t.numel() == 0) return false;
  const bool rows = t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(1, t.size(1));
  const bool columns = t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(1, t.size(0));
  return rows || columns;
}

bool through_float(const at::Tensor& a, const at::Tensor& b) {
  return a.device().is_cpu() && reduced(a) && b.scalar_type() == a.scalar_type() && in_place_layout(a) &&
         in_place_layout(b) && !a.is_conj() && !b.is_conj();
}

// A float32 tensor over memory no c10 allocator sees, kept between products (one per operand and
// thread): fresh pages cost the first copy into them twenty times the copy itself (Qwen3's head:
// 1.8 s against 0.09 s).
at::Tensor float_scratch(std::vector<float>& memory, at::IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  if (memory.size() < static_cast<size_t>(n)) memory.resize(static_cast<size_t>(n));
  return at::from_blob(memory.data(), sizes, at::TensorOptions().dtype(at::kFloat));
}

// A float32 copy in t's own layout (a transposing copy is twenty times slower), which BLAS reads
// transposed in place.
at::Tensor float_copy(std::vector<float>& memory, const at::Tensor& t) {
  if (t.stride(1) != 1) return float_copy(memory, t.t()).t();  // column-major (in_place_layout)
  at::Tensor f = float_scratch(memory, t.sizes());
  f.copy_(t);
  return f;
}

// a @ b in float32 (with `self`: beta · self + alpha · a @ b), rounded once into out ([a rows,
// b columns], a's dtype).
at::Tensor& float_product(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, const at::Tensor* self = nullptr,
                          const at::Scalar& beta = 1, const at::Scalar& alpha = 1) {
  thread_local std::vector<float> a_memory, b_memory, out_memory;
  const at::Tensor a32 = float_copy(a_memory, a), b32 = float_copy(b_memory, b);
  at::Tensor out32 = float_scratch(out_memory, out.sizes());
  if (self != nullptr) {
    out32.copy_(self->expand(out.sizes()));
    out32.addmm_(a32, b32, beta, alpha);
  } else {
    at::mm_out(out32, a32, b32);
  }
  return out.copy_(out32);
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (!through_float(a, b)) return at::cpu::mm(a, b);
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  return float_product(a, b, out);
}

at::Tensor& mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  if (!through_float(a, b) || out.scalar_type() != a.scalar_type() || out.dim() != 2 || out.size(0) != a.size(0) ||
      out.size(1) != b.size(1)) {
    return at::cpu::mm_outf(a, b, out);
  }
  return float_product(a, b, out);
}

at::Tensor addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  if (!through_float(a, b) || self.scalar_type() != a.scalar_type() || self.dim() > 2) {
    return at::cpu::addmm(self, a, b, beta, alpha);
  }
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  return float_product(a, b, out, &self, beta, alpha);
}

// Registered as the program starts, LibTorch's warning that a kernel is replaced (expected here)
// kept out of every test's output.
struct Registration {
  torch::Library library{torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__};
  Registration() {
    struct Silent : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } silent;
    const c10::WarningUtils::WarningHandlerGuard quiet(&silent);
    library.impl("mm", TORCH_FN(mm));
    library.impl("mm.out", TORCH_FN(mm_out));
    library.impl("addmm", TORCH_FN(addmm));
  }
};
const Registration registration;

}  // namespace
}  // namespace headroom::testing
