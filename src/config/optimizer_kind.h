// OptimizerKind — which optimizer a run uses (lever 8: optimizer state). The optimizers themselves
// are in optim/; this is the setting, parsed once from the command line or TOML.
#pragma once

#include <string>

namespace headroom {

// adamw8bit: AdamW with blockwise 8-bit moments (optim/quantize8bit.h), bitsandbytes' AdamW8bit.
enum class OptimizerKind { sgd, momentum, adam, adamw, adagrad, adafactor, adamw8bit };

// Every kind, in the order --help lists them.
inline constexpr OptimizerKind kOptimizerKinds[] = {OptimizerKind::sgd,       OptimizerKind::momentum,
                                                    OptimizerKind::adam,      OptimizerKind::adamw,
                                                    OptimizerKind::adagrad,   OptimizerKind::adafactor,
                                                    OptimizerKind::adamw8bit};

const char* optimizer_name(OptimizerKind kind);
// Throws Error naming the accepted values.
OptimizerKind parse_optimizer(const std::string& text);

// Whose update the estimator predicts: headroom's trainer's (in place, no per-parameter
// temporaries), or torch.optim's default as a Python script runs it (cpu: the single-tensor loop;
// cuda: foreach), which divides by a new tensor each step.
enum class OptimizerImpl { headroom, torch };
const char* optimizer_impl_name(OptimizerImpl impl);
// Throws Error naming the accepted values.
OptimizerImpl parse_optimizer_impl(const std::string& text);

// Adam and AdamW hold the same state (two moments per parameter); only their update differs.
inline bool is_adam_family(OptimizerKind k) { return k == OptimizerKind::adam || k == OptimizerKind::adamw; }

}  // namespace headroom
