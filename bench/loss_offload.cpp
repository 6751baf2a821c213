// The loss and activation levers, measured: for a Qwen3-0.6B-shaped config (1,024 wide, 151,936
// tokens, tied) and a Gemma-3-1B-shaped one (1,152 wide, 262,144 tokens, tied), depth shrunk, one
// sequence of 2,048 tokens, fp32 by default, SGD (the levers act on activations, not on state): the device
// peak (the budget allocator's, step 2 of a real run on the cpu), the host pool's peak, the median
// step time, and headroom's estimate of the peak, for
//   - the loss full and chunked (default chunk);
//   - activations as they are, checkpointed (full), offloaded, and checkpointed and offloaded.
// Ratios are to the first row of each model, measured in the same run.
// Published anchors: Liger's fused linear cross-entropy, more than 4x less memory at a 128k
// vocabulary; Cut Cross-Entropy, Gemma 2 2B's loss from 24 GB to 1 MB; TRL's chunked NLL (256-token
// chunks) 8.29 -> 2.07 GB at about 1.8x the loss time; torchtitan's chunked loss, Qwen3-14B 90.8 ->
// 83.6 GiB; torchtune's activation offload with checkpointing, about 24% less memory at under 1%
// slowdown on Llama-3-8B.
//
// fp32 by default: on a cpu without bf16 instructions (AVX2 only) the bf16 matmul that backward runs
// over the vocabulary is pathological (measured here: 51 s for [24 x 151,936] x [151,936 x 1,024]
// in bf16 against 0.4 s in float32), for the full loss and the chunked one alike.
//
//   build/bench_loss_offload [layers] [seq] [precision] [model,...]
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "estimate/estimator.h"
#include "train/trainer.h"
#include "util/size.h"

using namespace headroom;

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 2;
  const int64_t seq = argc > 2 ? std::atoll(argv[2]) : 2048;
  const Precision precision = parse_precision(argc > 3 ? argv[3] : "fp32");
  std::vector<std::string> models = {"qwen3-0.6b", "gemma-3-1b"};
  if (argc > 4) {
    models.clear();
    std::string list = argv[4];
    for (size_t at = 0; at <= list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      models.push_back(list.substr(at, comma - at));
      at = comma + 1;
    }
  }
  struct Setting {
    const char* label;
    const char* loss;
    const char* checkpointing;
    const char* offload;
  };
  const std::vector<Setting> settings = {
      {"loss full", "full", "none", "none"},
      {"loss chunked", "chunked", "none", "none"},
      {"checkpointing full", "chunked", "full", "none"},
      {"offload activations", "chunked", "none", "activations"},
      {"checkpointing + offload", "chunked", "full", "activations"},
  };
  for (const std::string& model : models) {
    std::printf("\n%s, %d layers, batch 1 x seq %lld, %s, sgd, cpu (rows after the first: chunked loss)\n", model.c_str(),
                layers, static_cast<long long>(seq), precision_name(precision));
    std::printf("%-26s %12s %9s %10s %12s %10s %9s\n", "setting", "peak", "estimate", "vs first", "host", "step s",
                "vs first");
    int64_t first_peak = 0;
    double first_time = 0;
    for (const Setting& s : settings) {
      RunConfig cfg;
      cfg.model = model;
      cfg.overrides = {fmt::format("num_hidden_layers={}", layers)};
      cfg.batch = 1;
      cfg.seq = seq;
      cfg.precision = precision;
      cfg.optimizer = OptimizerKind::sgd;
      cfg.loss = parse_loss(s.loss);
      cfg.checkpointing = parse_checkpoint_policy(s.checkpointing);
      cfg.offload = parse_offload(s.offload);
      cfg.device = "cpu";
      cfg.steps = 2;
      cfg.eval_rows = 0;
      cfg.quiet = true;
      const TrainResult r = train(cfg);
      const StepRecord& step = r.steps.at(1);  // the second: its optimizer state exists
      const Estimate e = estimate(load_model_config(cfg.model, cfg.overrides), train_spec(cfg));
      const double secs = step.seconds;
      if (first_peak == 0) {
        first_peak = step.peak_bytes;
        first_time = secs;
      }
      std::printf("%-26s %12s %+8.3f%% %9.2fx %12s %10.2f %8.2fx\n", s.label, format_bytes(step.peak_bytes).c_str(),
                  100.0 * static_cast<double>(e.step_peak() - step.peak_bytes) / static_cast<double>(step.peak_bytes),
                  static_cast<double>(step.peak_bytes) / static_cast<double>(first_peak),
                  format_bytes(step.host_peak_bytes.value_or(0)).c_str(), secs, secs / first_time);
    }
  }
  return 0;
}
