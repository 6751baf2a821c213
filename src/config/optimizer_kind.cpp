#include "config/optimizer_kind.h"

#include "util/error.h"

namespace headroom {

const char* optimizer_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::sgd: return "sgd";
    case OptimizerKind::momentum: return "momentum";
    case OptimizerKind::adam: return "adam";
    case OptimizerKind::adamw: return "adamw";
    case OptimizerKind::adagrad: return "adagrad";
    case OptimizerKind::adafactor: return "adafactor";
    case OptimizerKind::adamw8bit: return "adamw8bit";
  }
  return "?";
}

OptimizerKind parse_optimizer(const std::string& text) {
  for (OptimizerKind k : kOptimizerKinds) {
    if (text == optimizer_name(k)) return k;
  }
  fail("--optimizer '{}': accepted: sgd, momentum, adam, adamw, adagrad, adafactor, adamw8bit", text);
}

const char* optimizer_impl_name(OptimizerImpl impl) { return impl == OptimizerImpl::torch ? "torch" : "headroom"; }

OptimizerImpl parse_optimizer_impl(const std::string& text) {
  if (text == "headroom") return OptimizerImpl::headroom;
  if (text == "torch") return OptimizerImpl::torch;
  fail("--optimizer-impl '{}': accepted: headroom, torch", text);
}

}  // namespace headroom
