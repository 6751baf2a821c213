// What the data-parallel tests (data_parallel*_test.cpp) share: runs described by the flags' names,
// launched on local cpu ranks through torchrun (Gloo over loopback).
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <string>

#include "config/run_config.h"
#include "testing/command.h"

namespace headroom::data_parallel_testing {

inline std::string torchrun() { return (std::filesystem::path(HEADROOM_PYTHON).parent_path() / "torchrun").string(); }

// `settings`: "key=value;key=value" in the flags' names.
inline RunConfig config_of(const std::string& settings) {
  RunConfig cfg;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.eval_rows = 0;
  cfg.threads = 1;
  size_t begin = 0;
  while (begin < settings.size()) {
    size_t end = settings.find(';', begin);
    if (end == std::string::npos) end = settings.size();
    const std::string item = settings.substr(begin, end - begin);
    const size_t eq = item.find('=');
    if (const RunField* f = find_run_field(item.substr(0, eq))) f->set(cfg, item.substr(eq + 1));
    begin = end + 1;
  }
  return cfg;
}

// Launches `ranks` local ranks of `program args` through torchrun; stdout and stderr together.
inline testing::CommandResult launch(int ranks, const std::string& program, const std::string& args,
                                     const std::string& env = "") {
  return testing::run_command(
      fmt::format("env OMP_NUM_THREADS=1 {} {} --standalone --no-python --nproc-per-node {} {} {} 2>&1", env,
                  torchrun(), ranks, program, args));
}

// tiny: llama, untied, vocabulary 256; 2 micro-batches, weight decay and clipping on; momentum, whose
// update is linear in the gradient. (Adam's is not: where a gradient element is a sum that nearly
// cancels, the ranks' order of summation changes it relatively much, and Adam's normalised step
// turns that into a difference of up to the learning rate; its test compares losses.)
inline constexpr const char* kTiny = "model=tiny;steps=3;seq=32;accum=2;lr=0.01;optimizer=momentum;weight-decay=0.1";

}  // namespace headroom::data_parallel_testing
