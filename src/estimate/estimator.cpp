#include "estimate/estimator.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "config/lever_support.h"
#include "config/run_config.h"
#include "data/embedded.h"
#include "data/token_file.h"
#include "dist/pipeline_schedule.h"
#include "model/hf_weights.h"
#include "device/device.h"
#include "estimate/pipeline_cut.h"
#include "estimate/stage_replays.h"
#include "estimate/step_replay.h"
#include "model/tensor_parallel.h"
#include "util/error.h"
#include "util/size.h"

namespace headroom {

int64_t Estimate::step_peak() const {
  int64_t peak = 0;
  for (Phase p : kStepPhases) peak = std::max(peak, phase_peaks[static_cast<size_t>(p)]);
  return peak;
}

int64_t Estimate::step_memory() const {
  return peak_bytes - category(sim::Category::weights) - category(sim::Category::gradients) -
         category(sim::Category::optimizer) - category(sim::Category::other);
}

nlohmann::json Estimate::to_json() const {
  nlohmann::json j;
  j["model"] = {{"name", model}, {"params", params}, {"trainable_params", trainable_params}};
  j["peak_bytes"] = peak_bytes;
  j["peak_phase"] = std::string(phase_name(peak_phase));
  nlohmann::json b = nlohmann::json::object();
  for (int c = 0; c < sim::kCategories; ++c) b[sim::category_name(static_cast<sim::Category>(c))] = breakdown[c];
  j["breakdown"] = b;
  nlohmann::json items_json = nlohmann::json::array();
  for (const auto& i : items) {
    items_json.push_back(
        {{"name", i.name}, {"category", sim::category_name(i.category)}, {"bytes", i.bytes}, {"formula", i.formula}});
  }
  j["items"] = items_json;
  j["host_bytes"] = host_bytes;
  if (!host_items.empty()) {
    nlohmann::json host = nlohmann::json::array();
    for (const auto& i : host_items) {
      host.push_back(
          {{"name", i.name}, {"category", sim::category_name(i.category)}, {"bytes", i.bytes}, {"formula", i.formula}});
    }
    j["host_items"] = host;
  }
  nlohmann::json phases = nlohmann::json::object();
  for (Phase p : kStepPhases) phases[std::string(phase_name(p))] = phase_peaks[static_cast<size_t>(p)];
  j["phases"] = phases;
  if (experts) {
    j["experts"] = {{"experts", experts->experts},
                    {"top_k", experts->top_k},
                    {"sparse_layers", experts->sparse_layers},
                    {"routing", experts->routing},
                    {"weights_bytes", experts->weights},
                    {"gradients_bytes", experts->gradients},
                    {"optimizer_bytes", experts->optimizer},
                    {"replicated_on_ranks", experts->world}};
  }
  if (!stages.empty()) {
    nlohmann::json each = nlohmann::json::array();
    for (const Stage& st : stages) {
      each.push_back({{"stage", st.stage},
                      {"first_layer", st.first_layer},
                      {"end_layer", st.end_layer},
                      {"peak_bytes", st.peak_bytes},
                      {"peak_phase", std::string(phase_name(st.peak_phase))},
                      {"micro_batches_in_flight", st.in_flight}});
    }
    j["pipeline"] = {{"stage", stage},
                     {"stages", each},
                     {"split", pipeline_split_text(cut)},
                     {"cut", balanced ? "balanced by memory" : "given"}};
    if (balanced && by_parameters_peak > 0) {
      j["pipeline"]["by_parameters"] = {{"split", pipeline_split_text(by_parameters)},
                                        {"peak_bytes", by_parameters_peak}};
    }
  }
  if (cuda) {
    // What nvidia-smi shows beyond PyTorch's reserved memory: not predicted, named with its source.
    j["outside_reserved"] = nlohmann::json::array(
        {{{"name", "CUDA context"},
          {"bytes", nullptr},
          {"source", "the driver's per-process context and loaded kernels (lazily, CUDA_MODULE_LOADING=LAZY); "
                     "device- and driver-specific: nvidia-smi's used memory minus torch.cuda.memory_reserved() "
                     "(scripts/gpu-check prints it)"}},
         {{"name", "cuBLAS/cuBLASLt workspaces"},
          {"bytes", 0},
          {"source", "inside reserved: PyTorch allocates them through the caching allocator (the cuBLAS "
                     "workspace item above)"}}});
  }
  if (reserved) {
    j["peak_reserved_bytes"] = reserved->peak_reserved;
    j["reserved"] = {{"peak_reserved_bytes", reserved->peak_reserved},
                     {"peak_allocated_block_bytes", reserved->peak_allocated},
                     {"peak_inactive_split_bytes", reserved->peak_inactive_split},
                     {"segments", reserved->segments},
                     {"out_of_memory_under_budget", reserved->oom}};
  }
  return j;
}

std::string Estimate::table() const {
  std::string out = fmt::format("{:<26} {:>11} {:>6}  {}\n", "at the peak", "bytes", "share", "why this size");
  for (const auto& i : items) {
    out += fmt::format("{:<26} {:>11} {:>5.1f}%  {}\n", i.name, format_bytes(i.bytes),
                       100.0 * static_cast<double>(i.bytes) / static_cast<double>(std::max<int64_t>(peak_bytes, 1)),
                       i.formula);
  }
  out += fmt::format("{:<26} {:>11} {:>6}  in {}\n", "peak", format_bytes(peak_bytes), "100%", phase_name(peak_phase));
  if (peak_phase == Phase::idle) {
    out += fmt::format("{:<26} {:>11} {:>6}  the peak above is while the model is built (its weights drawn), before "
                       "the first step, which train's metrics do not count\n",
                       "a step's own peak", format_bytes(step_peak()), "");
  }
  for (const auto& i : host_items) {
    out += fmt::format("{:<26} {:>11} {:>6}  {}\n", i.name, format_bytes(i.bytes), "host", i.formula);
  }
  if (host_bytes > 0) {
    out += fmt::format("{:<26} {:>11} {:>6}  not on the device: what --offload keeps in host memory, at its own peak\n",
                       "host memory", format_bytes(host_bytes), "host");
  }
  for (const Stage& st : stages) {
    out += fmt::format("{:<26} {:>11} {:>6}  layers {}..{}, {} micro-batch{} in flight, peak in {}{}\n",
                       fmt::format("pipeline stage {}", st.stage), format_bytes(st.peak_bytes), "", st.first_layer,
                       st.end_layer - 1, st.in_flight, st.in_flight == 1 ? "" : "es", phase_name(st.peak_phase),
                       st.stage == stage ? "; the table above is this stage's" : "");
  }
  if (!cut.empty()) {
    out += fmt::format("{:<26} {:>11} {:>6}  --pipeline-split {}{}\n", "pipeline cut", "-", "", pipeline_split_text(cut),
                       balanced ? ": balanced by each stage's estimated peak (the default)" : ": as given");
    if (balanced && by_parameters_peak > 0 && by_parameters != cut) {
      out += fmt::format("{:<26} {:>11} {:>6}  --pipeline-split {}: balancing parameters instead, its largest stage "
                         "would peak at this\n",
                         "cut by parameters", format_bytes(by_parameters_peak), "", pipeline_split_text(by_parameters));
    }
  }
  if (experts) {
    const std::string assumed =
        experts->routing == "balanced" ? "balanced: each expert takes tokens·top_k/experts"
        : experts->routing == "worst"  ? "worst: top_k experts take every token"
                                       : fmt::format("skew {}: the busiest expert takes {}x a balanced share",
                                                     experts->routing, experts->routing);
    out += fmt::format("experts: {} of {} per token in {} layers; routing assumed {} (--moe-routing balanced, worst "
                       "or a skew measured by train); expert weights {}, gradients {}, optimizer state {} at the peak",
                       experts->top_k, experts->experts, experts->sparse_layers, assumed, format_bytes(experts->weights),
                       format_bytes(experts->gradients), format_bytes(experts->optimizer));
    if (experts->world > 1) {
      out += fmt::format("; replicated on each of {} ranks (no expert parallelism)", experts->world);
    }
    out += "\n";
  }
  if (cuda) {
    out += fmt::format("{:<26} {:>11} {:>6}  {}\n", "outside reserved", "-", "",
                       "the CUDA context (driver and kernels; device-specific, not predicted): nvidia-smi shows it "
                       "on top of reserved");
  }
  if (reserved && reserved->oom) {
    out += fmt::format("{:<26} {:>11} {:>6}  caching allocator: out of segments under the budget, with this much "
                       "reserved ({} of it free inside split segments at most)\n",
                       "reserved at the failure", format_bytes(reserved->peak_reserved), "",
                       format_bytes(reserved->peak_inactive_split));
  } else if (reserved) {
    out += fmt::format("{:<26} {:>11} {:>6}  caching allocator: segments held, {} above the peak (of which {} free "
                       "inside split segments at most)\n",
                       "peak reserved", format_bytes(reserved->peak_reserved), "",
                       format_bytes(reserved->peak_reserved - peak_bytes), format_bytes(reserved->peak_inactive_split));
  }
  return out;
}

namespace {
// What the step's replay cannot take (or train refuses), as one line each.
void check_step(const ModelConfig& model, const TrainSpec& spec) {
  if (spec.seq > model.max_positions) {
    fail("--seq {} exceeds {}'s max_position_embeddings {}", spec.seq, model.name, model.max_positions);
  }
  if (model.moe && model.moe->aux_loss) {
    for (int64_t i = 0; i < model.num_layers; ++i) {
      if (model.sparse(i) && spec.checkpointing.whole_layer(i)) {
        fail("output_router_logits (the router's load-balancing loss) with --checkpointing {} is not supported, as "
             "train refuses it; accepted: --checkpointing none or selective, or --set output_router_logits=false",
             spec.checkpointing.name());
      }
    }
  }
  if (spec.world > 1 && !spec.finetune.full()) {
    fail("--finetune {} with --world-size {}: not supported yet (train refuses it under torchrun); accepted: "
         "--finetune full with ranks, or one rank",
         spec.finetune.name(), spec.world);
  }
  if (spec.world > 1 && spec.offload != Offload::none) {
    fail("--offload {} with --world-size {}: not supported yet (train refuses it under torchrun); accepted: one rank",
         offload_name(spec.offload), spec.world);
  }
  if (spec.world > 1 && spec.loss.chunked && spec.shard == ShardLevel::full) {
    fail("--loss {} with --shard full: not supported yet (train refuses it); accepted: --loss full, or --shard "
         "optimizer or gradients",
         spec.loss.name());
  }
}

// --pipeline: every stage replayed, one rank each; the estimate is the stage with the highest peak.
// The stages are compared by live bytes (`replays` keeps them: the cut's search made some); a
// caching allocator's replay (reserved memory) is the worst stage's only, made from its kept
// allocations once that stage is known (the others' were never shown).
Estimate worst_stage(const ModelConfig& model, const TrainSpec& spec, StageReplays& replays) {
  const std::vector<LayerRange> ranges = pipeline_stages(model, spec.pipeline);
  std::vector<Estimate> each;
  std::vector<Estimate::Stage> stages;
  const int64_t last = spec.pipeline.stages - 1;
  for (int64_t k = 0; k <= last; ++k) {
    const LayerRange& mine = ranges[static_cast<size_t>(k)];
    // A middle stage after one with as many layers holds fewer micro-batches in flight.
    if (!spec.every_stage && k > 1 && k < last &&
        ranges[static_cast<size_t>(k - 1)].end - ranges[static_cast<size_t>(k - 1)].first == mine.end - mine.first) {
      continue;
    }
    each.push_back(replays.live(model, spec, ranges, k));
    const Estimate& e = each.back();
    // The step's peak and its phase (building the model, in idle, is not part of it).
    Phase phase = Phase::data;
    for (Phase p : kStepPhases) {
      if (e.phase_peaks[static_cast<size_t>(p)] > e.phase_peaks[static_cast<size_t>(phase)]) phase = p;
    }
    stages.push_back({mine.first, mine.end, e.step_peak(), phase, std::min(spec.pipeline.stages - k, spec.accum), k});
  }
  const auto worst = std::max_element(each.begin(), each.end(), [](const Estimate& a, const Estimate& b) {
    return a.step_peak() < b.step_peak();
  });
  const int64_t worst_stage = stages[static_cast<size_t>(worst - each.begin())].stage;
  Estimate out = replays.with_allocator(model, spec, ranges, worst_stage);
  out.stage = worst_stage;
  out.stages = std::move(stages);
  out.cut = ranges;
  return out;
}
}  // namespace

Estimate estimate(const ModelConfig& model, const TrainSpec& spec) {
  if (spec.batch < 1 || spec.accum < 1 || spec.seq < 1) fail("estimate: batch, accum and seq must be at least 1");
  check_lever_support(spec, model, spec.world);
  if (spec.tensor_parallel > 1) {
    check_tensor_parallel(model, spec.tensor_parallel);
    // What train refuses with --tensor-parallel (train/run.cpp), refused here in its words.
    const char* refused = spec.loss.chunked                          ? "--loss chunked"
                          : spec.optimizer == OptimizerKind::adafactor ? "--optimizer adafactor"
                          : spec.optimizer == OptimizerKind::adamw8bit ? "--optimizer adamw8bit"
                          : !spec.finetune.full()                      ? "--finetune other than full"
                          : spec.offload != Offload::none              ? "--offload"
                                                                       : nullptr;
    if (refused) fail("{} with --tensor-parallel: not supported yet (train refuses it)", refused);
  }
  if (spec.pipeline.stages > 1) {
    if (spec.offload != Offload::none || !spec.finetune.full() || spec.base_weights != BaseWeights::dense) {
      fail("--pipeline with --offload, --finetune or --base-weights: not supported yet (train refuses them under "
           "torchrun); accepted: --pipeline 1");
    }
    if (spec.stage >= spec.pipeline.stages) {
      fail("estimate: stage {} of a {}-stage pipeline; accepted: 0 to {}", spec.stage, spec.pipeline.stages,
           spec.pipeline.stages - 1);
    }
    // What every stage's replay would refuse, refused once (StageReplays replays them unchecked).
    check_step(model, spec);
    if (spec.pipeline.split.empty() && spec.stage >= 0) {
      TrainSpec cut = spec;
      cut.pipeline.split = memory_balanced_cut(model, spec);
      Estimate e = estimate(model, cut);
      e.balanced = true;
      return e;
    }
    if (spec.pipeline.split.empty()) {
      // The proposal replayed; the parameters' cut where it peaks no lower (estimate/pipeline_cut.h).
      StageReplays replays;
      const CutProposal proposal = propose_balanced_cut(model, spec, replays);
      TrainSpec cut = spec;
      cut.pipeline.split = proposal.layers;
      Estimate e = worst_stage(model, cut, replays);
      if (proposal.layers != proposal.by_parameters && e.step_peak() >= proposal.by_parameters_peak) {
        cut.pipeline.split = proposal.by_parameters;
        e = worst_stage(model, cut, replays);
      }
      e.balanced = true;
      e.by_parameters = proposal.by_parameters;
      e.by_parameters_peak = proposal.by_parameters_peak;
      return e;
    }
    if (spec.stage < 0) {
      StageReplays replays;
      return worst_stage(model, spec, replays);
    }
  }
  check_step(model, spec);
  replay::StepReplay step(model, spec);
  Estimate e = step.run();
  e.stage = spec.pipeline.stages > 1 ? spec.stage : -1;
  if (spec.pipeline.stages > 1) e.cut = pipeline_stages(model, spec.pipeline);
  return e;
}

namespace {

int64_t corpus_bytes(const std::string& path) {
  if (path.empty()) return static_cast<int64_t>(embedded_corpus().size());
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail("--data '{}': cannot read it ({})", path, ec.message());
  return static_cast<int64_t>(size);
}

}  // namespace

TrainSpec train_spec(const RunConfig& cfg) {
  TrainSpec s;
  s.step() = cfg.step();
  // The data-parallel ranks: a pipeline's stages and the tensor-parallel shares take one rank each.
  s.world = std::max<int64_t>(1, world_size_of(cfg) / (cfg.pipeline.stages * cfg.tensor_parallel));
  // An estimate is for before the GPU is rented: --device cuda needs none here.
  s.cuda = cfg.device.rfind("cuda", 0) == 0 || (cfg.device == "auto" && resolve_device(cfg.device).is_cuda());
  if (!s.cuda && !cfg.weights.empty()) {
    s.loaded_tensors = hf_load_sequence(cfg.weights, load_model_config(cfg.model, cfg.overrides));
  }
  if (!s.cuda && !cfg.data_tokens.empty()) {
    const TokenFileInfo info = inspect_token_file(cfg.data_tokens);
    s.dataset_bytes = info.tokens * info.width;
    s.dataset_width = info.width;
  } else {
    s.dataset_bytes = s.cuda ? 0 : corpus_bytes(cfg.data);
  }
  if (s.cuda || cfg.allocator == AllocatorKind::caching) {
    const std::string settings = cfg.allocator_conf.empty() ? allocator_config_from_environment() : cfg.allocator_conf;
    s.caching = parse_allocator_config(
        settings, cfg.allocator_conf.empty() ? "PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF" : "--allocator-conf");
    s.budget = cfg.memory_budget;
  }
  return s;
}

std::function<int64_t(int64_t)> peak_predictor(const RunConfig& config) {
  const ModelConfig model = load_model_config(config.model, config.overrides);
  TrainSpec spec = train_spec(config);
  spec.accum = 1;
  return [model, spec](int64_t batch) mutable {
    spec.batch = batch;
    return estimate(model, spec).peak_bytes;
  };
}

}  // namespace headroom
