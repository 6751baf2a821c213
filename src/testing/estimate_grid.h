// The estimator's accuracy grid, shared by its test and its benchmark: every family (shrunk), every
// precision, optimizer, checkpointing policy and attention path, several micro-batches, sequence
// lengths and accumulations — 40 configurations of `train`.
#pragma once

#include <fmt/format.h>

#include <string>
#include <vector>

#include "config/run_config.h"
#include "model/test_models.h"

namespace headroom::testing {

inline std::vector<RunConfig> accuracy_grid() {
  struct Variant {
    int64_t batch, seq, accum;
    const char *precision, *attention, *optimizer, *checkpointing;
  };
  const std::vector<Variant> variants = {
      {4, 32, 1, "fp32", "flash", "adamw", "none"},           {2, 64, 1, "fp32", "math", "sgd", "none"},
      {2, 32, 1, "bf16-mixed", "flash", "adam", "selective"}, {2, 32, 1, "fp16-mixed", "math", "momentum", "full"},
      {2, 32, 1, "bf16", "flash", "adafactor", "every:2"},    {8, 16, 2, "fp32", "flash", "adagrad", "none"},
      {1, 64, 1, "fp32", "flash", "adamw", "full"},           {3, 32, 2, "bf16-mixed", "math", "adamw", "none"},
  };
  std::vector<RunConfig> grid;
  for (const auto& m : shrunk_models()) {
    for (const auto& v : variants) {
      RunConfig cfg;
      cfg.model = m.preset;
      cfg.overrides = m.overrides;
      cfg.batch = v.batch;
      cfg.seq = v.seq;
      cfg.accum = v.accum;
      cfg.precision = v.precision;
      cfg.attention = v.attention;
      cfg.optimizer = v.optimizer;
      cfg.checkpointing = v.checkpointing;
      cfg.device = "cpu";
      grid.push_back(cfg);
    }
  }
  return grid;
}

inline std::string describe(const RunConfig& c) {
  return fmt::format("{} b{} s{} a{} {} {} {} {}", c.model, c.batch, c.seq, c.accum, c.precision, c.attention,
                     c.optimizer, c.checkpointing);
}

}  // namespace headroom::testing
