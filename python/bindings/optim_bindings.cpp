// headroom's optimizers (optim/optimizer.h) over Python's tensors, for the tests that hold them to
// the libraries users would otherwise run (bitsandbytes' AdamW8bit), the 8-bit dynamic map, and
// the NF4 code and quantisation (bitsandbytes' quantize_4bit).
#include <pybind11/stl.h>

#include "bindings.h"
#include "config/optimizer_kind.h"
#include "optim/optimizer.h"
#include "optim/quantize8bit.h"
#include "model/nf4.h"

namespace py = pybind11;

namespace headroom::python {

void bind_optim(py::module_& m) {
  m.def(
      "dynamic_map", [](bool is_signed) {
        const auto& map = dynamic_map(is_signed);
        return std::vector<float>(map.begin(), map.end());
      },
      py::arg("signed"), "The 256 values of the 8-bit dynamic quantisation map, ascending.");
  m.def("nf4_code", [] {
    const auto& code = nf4_code();
    return std::vector<float>(code.begin(), code.end());
  }, "The 16 values of the NF4 code, ascending.");
  m.def(
      "nf4_quantise",
      [](const at::Tensor& dense) {
        Nf4Weight w;
        w.sizes = dense.sizes().vec();
        w.codes = at::empty({nf4_code_bytes(dense.numel())}, dense.options().dtype(at::kByte));
        w.absmax = at::empty({nf4_blocks(dense.numel())}, dense.options().dtype(at::kFloat));
        nf4_quantise_into(dense, w);
        return std::make_pair(w.codes, w.absmax);
      },
      py::arg("dense"), "headroom's NF4 quantisation of a weight (blocks of 64): (codes, absmax).");
  py::class_<Optimizer>(m, "Optimizer")
      .def(py::init([](const std::string& kind, const std::vector<at::Tensor>& params, double weight_decay,
                       double beta1, double beta2, double eps) {
             std::vector<NamedTensor> named;
             for (size_t i = 0; i < params.size(); ++i) named.push_back({"p" + std::to_string(i), params[i]});
             OptimizerOptions o;
             o.weight_decay = weight_decay;
             o.beta1 = beta1;
             o.beta2 = beta2;
             o.eps = eps;
             return make_optimizer(parse_optimizer(kind), named, o);
           }),
           py::arg("kind"), py::arg("params"), py::arg("weight_decay") = 0.0, py::arg("beta1") = 0.9,
           py::arg("beta2") = 0.95, py::arg("eps") = 1e-8,
           "headroom's optimizer `kind` over `params` (their .grad is read at each step).")
      .def("step", &Optimizer::step, py::arg("lr"))
      .def("state", [](const Optimizer& o) {
        py::dict out;
        for (const auto& s : o.state()) out[py::str(s.name)] = s.tensor;
        return out;
      })
      .def("state_bytes", &Optimizer::state_bytes);
}

}  // namespace headroom::python
