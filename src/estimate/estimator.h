// Estimator — predicts a training step's peak memory without running it (lever 1, before the run).
//
// Not a textbook formula: the step is replayed symbolically (estimate/sim.h) operator by operator
// as the trainer runs it — the same layers, casts and losses as model/causal_lm.cpp and
// train/trainer.cpp — so the prediction holds what LibTorch really holds: weights, autocast's
// low-precision weight copies, gradients as backward produces them, optimizer state, what each
// operator saves for backward, logits and the float32 loss buffers, recompute under checkpointing,
// and the temporaries of backward and of the optimizer step. The peak is the highest point of that
// timeline, with its phase and what it consisted of. A 70B config takes milliseconds: no weight is
// allocated (shapes come from a meta-device model, so they match the trainer's).
//
// The accuracy test (estimator_test.cpp) holds it to the budget allocator's measured peak; when the
// model or the trainer changes and the replay (estimate/*_replay.*) does not, that test fails.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "config/step_settings.h"
#include "estimate/reserved.h"
#include "estimate/sim.h"
#include "memory/allocator_config.h"
#include "memory/phase.h"

namespace headroom {

// What the estimator predicts: a step with its settings (config/step_settings.h, shared whole with
// the run's configuration and the plan), and where it runs.
struct TrainSpec : StepSettings {
  bool cuda = false;
  int64_t dataset_bytes = 0;  // cpu: the corpus, held in host memory as its tokens' bytes
  int dataset_width = 1;      // bytes per token: 1 (a text's bytes), 2 or 4 (a token file's ids)
  // cpu with --weights: the bytes of each checkpoint tensor read, in order (model/hf_weights.h); the
  // base is not initialised then. Empty: every parameter is initialised from the seed.
  std::vector<int64_t> loaded_tensors;
  // A caching allocator's settings (cuda; cpu with --allocator caching): reserved memory is
  // predicted by replaying the step through its policy (estimate/reserved.h). nullopt: not predicted.
  std::optional<AllocatorConfig> caching;
  std::optional<int64_t> budget;  // with caching: the cap the replay runs under (fits by reserved)
  // Data parallel (lever 6): the ranks (the shard level is a StepSettings); the estimate is rank
  // 0's (the rank with the largest slices). batch stays the per-rank micro-batch.
  int64_t world = 1;
  // --pipeline P (StepSettings::pipeline): the stage to predict, 0 to P - 1; -1: every stage, the
  // estimate being the one with the highest peak. `world` counts the data-parallel ranks only.
  int64_t stage = -1;
  // With stage -1: replay every stage (false: only the first of the stages alike in layers and
  // position, which holds the most micro-batches in flight of them and so peaks highest; the
  // planner's shortcut). Estimate::stages then lists the ones replayed.
  bool every_stage = true;
  // The planner's: a step whose allocated peak is over `budget` already cannot fit, and its caching
  // allocator's replay is not made (Estimate::reserved stays nullopt).
  bool reserved_within_budget_only = false;
  // Whether a step peaking at `allocated` bytes skips the caching allocator's replay (above).
  bool skips_reserved(int64_t allocated) const {
    return reserved_within_budget_only && budget && allocated > *budget;
  }
};

struct EstimateItem {
  std::string name;
  sim::Category category;
  int64_t bytes = 0;
  std::string formula;
};

struct Estimate {
  std::string model;
  int64_t params = 0;            // LoRA's adapters included
  int64_t trainable_params = 0;  // those with gradients and optimizer state (--finetune)
  int64_t peak_bytes = 0;
  Phase peak_phase = Phase::idle;
  std::array<int64_t, sim::kCategories> breakdown{};  // at the peak, by category
  std::vector<EstimateItem> items;                    // at the peak, largest first
  // --offload optimizer: host memory at its own peak, and what it held (largest first).
  int64_t host_bytes = 0;
  std::vector<EstimateItem> host_items;
  std::array<int64_t, 6> phase_peaks{};               // indexed by Phase
  // Live bytes by category when the optimizer phase begins: the weights, the whole gradients and
  // the optimizer's state as the update finds them.
  std::array<int64_t, sim::kCategories> at_update{};

  // With a caching allocator: two steps replayed through its policy (reserved, fragmentation).
  std::optional<ReservedReplay> reserved;
  bool cuda = false;  // predicted for a card (the output names what lies outside reserved memory)

  // A mixture of experts: its shape, the routing assumed, and the experts' model states at the
  // peak, apart from the dense ones (they are in the breakdown's weights, gradients, optimizer).
  struct Experts {
    int64_t experts = 0, top_k = 0, sparse_layers = 0;
    std::string routing;  // MoeRouting::name()
    int64_t weights = 0, gradients = 0, optimizer = 0;
    int64_t world = 1;  // data parallel: every rank holds every expert (no expert parallelism)
  };
  std::optional<Experts> experts;
  // --pipeline: every stage's layers and peak, one rank each (the estimate itself is `stage`'s).
  struct Stage {
    int64_t first_layer = 0, end_layer = 0;
    int64_t peak_bytes = 0;
    Phase peak_phase = Phase::idle;
    int64_t in_flight = 0;  // micro-batches whose activations it holds at once (1F1B)
    int64_t stage = 0;
  };
  std::vector<Stage> stages;
  int64_t stage = -1;
  // --pipeline: every stage's layers, as --pipeline-split gave them or, by default, balanced by
  // memory (estimate/pipeline_cut.h): `balanced`, with the cut balancing parameters and its
  // largest stage's peak beside it.
  std::vector<LayerRange> cut;
  bool balanced = false;
  std::vector<LayerRange> by_parameters;
  int64_t by_parameters_peak = 0;

  int64_t category(sim::Category c) const { return breakdown[static_cast<size_t>(c)]; }
  // The highest of the step's phases: peak_bytes unless building the model (its initialisation or
  // load, in `idle`) went higher, which a LoRA step's small footprint can make it.
  int64_t step_peak() const;
  // What the trainer's monitor counts as activations: everything but weights, gradients, optimizer
  // state and other (saved activations, weight copies, logits, loss, temporaries, allocator rounding).
  int64_t step_memory() const;
  // The contract: {"model": {"name", "params", "trainable_params"}, "peak_bytes", "peak_phase", "breakdown": {...}}, plus
  // "items" (name, category, bytes, formula), "phases" (peak per phase) and "host_bytes" (with
  // "host_items" when there are any).
  nlohmann::json to_json() const;
  std::string table() const;
};

Estimate estimate(const ModelConfig& model, const TrainSpec& spec);

struct RunConfig;
// The spec of a run's flags; on cpu the corpus's size is counted too (the trainer holds it).
TrainSpec train_spec(const RunConfig& config);

// The predicted peak of `config`'s step at a given micro-batch (accumulation 1), for seeding `fit`.
std::function<int64_t(int64_t batch)> peak_predictor(const RunConfig& config);

}  // namespace headroom
