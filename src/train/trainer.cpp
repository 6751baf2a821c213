#include "train/trainer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "device/cuda_adapter.h"
#include "train/checkpoint.h"
#include "train/observers.h"
#include "train/oom_guard.h"
#include "train/run.h"
#include "util/atomic_file.h"
#include "util/dir_lock.h"
#include "util/error.h"
#include "util/interrupt.h"
#include "util/json.h"
#include "util/size.h"
#include "util/stats.h"

namespace headroom {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The fields whose values differ between two config.json objects ("" when none), for messages.
std::string config_difference(const nlohmann::json& a, const nlohmann::json& b) {
  std::vector<std::string> seen, differences;
  auto consider = [&](const std::string& key) {
    if (key == "_source" || std::find(seen.begin(), seen.end(), key) != seen.end()) return;
    seen.push_back(key);
    const auto va = a.contains(key) ? a.at(key) : nlohmann::json();
    const auto vb = b.contains(key) ? b.at(key) : nlohmann::json();
    if (va != vb)
      differences.push_back(fmt::format("{}: checkpoint {}, this run {}", key, dump_json(va), dump_json(vb)));
  };
  for (const auto& [key, value] : a.items()) consider(key);
  for (const auto& [key, value] : b.items()) consider(key);
  if (differences.size() > 4) differences.resize(4);
  return fmt::format("{}", fmt::join(differences, "; "));
}

// Every file of the checkpoint in `dir`: its ranks' files in rank order (as its manifest lists
// them, each checked to be at the manifest's step), or its one file.
std::vector<CheckpointTensors> read_rank_files(const std::string& dir, const std::optional<ShardManifest>& manifest) {
  const int files = manifest ? manifest->ranks : 1;
  std::vector<CheckpointTensors> parts;
  for (int k = 0; k < files; ++k) {
    parts.push_back(read_checkpoint_tensors(
        dir, manifest ? std::optional<CheckpointShard>(CheckpointShard{k, files}) : std::nullopt));
    if (manifest && parts.back().info.step != manifest->step) {
      fail("--resume: '{}' is at step {} but its manifest says step {}: a save was cut short; the files do not form "
           "one checkpoint",
           checkpoint_file(dir, CheckpointShard{k, files}), parts.back().info.step, manifest->step);
    }
  }
  return parts;
}

const at::Tensor* find_tensor(const std::vector<NamedTensor>& list, const std::string& name) {
  for (const auto& t : list) {
    if (t.name == name) return &t.tensor;
  }
  return nullptr;
}

// Parameter `p` whole: from the first file, or (--shard full) each file's slice of it put together
// in rank order; undefined when the checkpoint has no weight of its shape.
at::Tensor whole_weight(const std::vector<CheckpointTensors>& parts, const std::optional<ShardManifest>& manifest,
                        const NamedTensor& p) {
  const at::Tensor* w = find_tensor(parts.front().model, p.name);
  at::Tensor whole;
  if (w != nullptr && w->sizes().equals(p.tensor.sizes())) {
    whole = *w;
  } else if (w != nullptr && w->dim() == 1 && manifest && manifest->shard == shard_level_name(ShardLevel::full)) {
    std::vector<at::Tensor> pieces;
    for (const auto& part : parts) {
      if (const at::Tensor* t = find_tensor(part.model, p.name)) pieces.push_back(*t);
    }
    whole = at::cat(pieces);
    if (whole.numel() != p.tensor.numel()) whole = at::Tensor();
  }
  return whole;
}

// The weights, each copied into this run's own layout: the parameter whole, or its slice at --shard full.
void load_weights(Run& run, const std::vector<CheckpointTensors>& parts, const std::optional<ShardManifest>& manifest,
                  const std::string& dir) {
  const std::vector<NamedTensor> weights = run.replicas ? run.replicas->checkpoint_weights() : run.parameters();
  for (size_t i = 0; i < weights.size(); ++i) {
    const NamedTensor& p = run.parameters()[i];
    const at::Tensor whole = whole_weight(parts, manifest, p);
    if (!whole.defined()) {
      fail("--resume: '{}' has no weight '{}' of this run's shape: it was written for a different model", dir, p.name);
    }
    const at::Tensor target = weights[i].tensor.detach();
    if (target.sizes().equals(p.tensor.sizes())) {
      target.copy_(whole.view(p.tensor.sizes()));
    } else {
      const auto slice = run.replicas->slice_of(p.name);
      target.copy_(whole.reshape(-1).narrow(0, slice->first, slice->second));
    }
  }
}

// Optimizer state tensor `s`, put together whole from the files' slices in rank order, then cut to
// this rank's slice; a step counter or a statistic of the whole parameter is taken as it is.
void load_optimizer_state(Run& run, const std::vector<CheckpointTensors>& parts, const NamedTensor& s,
                          const std::string& dir) {
  std::vector<at::Tensor> pieces;
  for (const auto& part : parts) {
    if (const at::Tensor* t = find_tensor(part.optimizer, s.name)) pieces.push_back(t->reshape(-1));
  }
  if (pieces.empty()) fail("--resume: '{}' holds no optimizer state '{}'; it was written for another model", dir, s.name);
  at::Tensor target = s.tensor;
  // A step counter, or a statistic of the whole parameter (adafactor's factored moments): the same
  // in every file that holds the parameter.
  if (target.dim() == 0 || run.optimizer->whole_parameter_state(s.name)) {
    if (pieces.front().numel() != target.numel()) {
      fail("--resume: optimizer state '{}' in '{}' has {} elements, this run's {}: a different model", s.name, dir,
           pieces.front().numel(), target.numel());
    }
    target.copy_(pieces.front().view(target.sizes()));
    return;
  }
  const std::string param = s.name.substr(0, s.name.rfind('.'));
  const auto slice = run.replicas ? run.replicas->slice_of(param)
                                  : std::optional<std::pair<int64_t, int64_t>>({0, target.numel()});
  const at::Tensor whole = at::cat(pieces);
  if (!slice || slice->first + slice->second > whole.numel() || slice->second != target.numel()) {
    fail("--resume: optimizer state '{}' in '{}' does not cover its parameter ({} elements): a different model",
         s.name, dir, whole.numel());
  }
  target.view(-1).copy_(whole.narrow(0, slice->first, slice->second));
}

// Loads --resume's checkpoint into the run, checking that it belongs to this run; returns the
// number of steps it had completed.
// A checkpoint of another layout (written by another number of ranks, or another shard level, or
// unsharded into a sharded run): the weights from its first file (every file holds them whole,
// except at --shard full, whose files' slices are put together in rank order); each optimizer state
// tensor put together whole from the files' slices, in rank order, then cut to this rank's slice
// (step counters and whole-parameter statistics are taken as they are). Every rank reads every file.
CheckpointInfo load_resharded(Run& run, const std::optional<ShardManifest>& manifest) {
  const std::string& dir = run.config.resume;
  const std::vector<CheckpointTensors> parts = read_rank_files(dir, manifest);
  const CheckpointInfo& info = parts.front().info;
  const std::string wanted = optimizer_name(run.config.optimizer);
  if (!info.optimizer.empty() && info.optimizer != wanted) {
    fail("--resume: the checkpoint was trained with --optimizer {}, this run has --optimizer {}; pass --optimizer {}",
         info.optimizer, wanted, info.optimizer);
  }
  const c10::NoGradGuard no_grad;
  load_weights(run, parts, manifest, dir);
  for (const auto& s : run.optimizer->state()) load_optimizer_state(run, parts, s, dir);
  if (!run.config.quiet && run.rank() == 0) {
    fmt::print(stderr, "note: re-sharded the checkpoint of {} to {} rank{} with --shard {}\n",
               manifest ? fmt::format("{} ranks (--shard {})", manifest->ranks, manifest->shard)
                        : std::string("one process"),
               run.ranks(), run.ranks() == 1 ? "" : "s", shard_level_name(run.config.shard));
  }
  return info;
}

CheckpointInfo load_for_resume(Run& run) {
  const RunConfig& cfg = run.config;
  const std::optional<ShardManifest> manifest = read_shard_manifest(cfg.resume);
  const bool sharded = run.replicas && run.replicas->sharded();
  const char* level = shard_level_name(run.shard());
  // Split over ranks, each rank's file holds only its stage's or share's state: the same layout
  // resumes it, rank by rank.
  if ((run.model_parallel() || (manifest && !manifest->layout.empty())) &&
      (!manifest || manifest->ranks != run.ranks() || manifest->shard != level || manifest->layout != run.layout())) {
    auto layout = [](int ranks, const std::string& flags, const std::string& shard) {
      return fmt::format("{} rank{} with {}{}--shard {}", ranks, ranks == 1 ? "" : "s", flags, flags.empty() ? "" : " ",
                         shard);
    };
    fail("--resume: '{}' was saved by {}, and this run is {}; a checkpoint split over ranks resumes only in the "
         "layout that saved it; accepted: that layout",
         cfg.resume, manifest ? layout(manifest->ranks, manifest->layout, manifest->shard) : "one process",
         layout(run.ranks(), run.layout(), level));
  }
  if (!sharded && !run.model_parallel()) {
    // The whole state in checkpoint.hrc, or a sharded checkpoint put together again.
    if (manifest && !std::filesystem::exists(checkpoint_file(cfg.resume))) return load_resharded(run, manifest);
    return load_checkpoint(cfg.resume, run.parameters(), run.optimizer->state());
  }
  if (!manifest || manifest->ranks != run.ranks() || manifest->shard != level) return load_resharded(run, manifest);
  const CheckpointInfo info =
      load_checkpoint(cfg.resume, sharded ? run.replicas->checkpoint_weights() : run.parameters(),
                      run.optimizer->state(), CheckpointShard{run.rank(), run.ranks()});
  if (info.step != manifest->step) {
    fail("--resume: '{}' is at step {} but its manifest says step {}: a save was cut short; the files do not form "
         "one checkpoint",
         checkpoint_file(cfg.resume, CheckpointShard{run.rank(), run.ranks()}), info.step, manifest->step);
  }
  return info;
}

int64_t resume(Run& run) {
  const RunConfig& cfg = run.config;
  const CheckpointInfo info = load_for_resume(run);
  if (info.seed != cfg.seed) {
    fail("--resume: the checkpoint was trained with --seed {}, this run has --seed {}; pass --seed {}", info.seed,
         cfg.seed, info.seed);
  }
  if (!info.optimizer.empty() && info.optimizer != optimizer_name(cfg.optimizer)) {
    fail("--resume: the checkpoint was trained with --optimizer {}, this run has --optimizer {}; pass --optimizer {}",
         info.optimizer, optimizer_name(cfg.optimizer), info.optimizer);
  }
  const std::string differs = config_difference(info.model, run.model_config.source);
  if (!differs.empty()) {
    fail(
        "--resume: the checkpoint was trained with a different model config ({}); resume with the same --model and "
        "--set",
        differs);
  }
  if (info.step >= cfg.end_step()) {
    fail("--resume: the checkpoint is at step {}, which is already at or past --{} {}; raise it to train further",
         info.step, cfg.stop_at > 0 ? "stop-at" : "steps", cfg.end_step());
  }
  if (info.total_steps != cfg.steps && !cfg.quiet) {
    fmt::print(
        stderr,
        "note: the checkpoint's schedule was {} steps, this run's is {}; the learning rate follows the new one\n",
        info.total_steps, cfg.steps);
  }
  return info.step;
}

void announce(const Run& run, int64_t start) {
  const RunConfig& c = run.config;
  const TextDataset& data = *run.data;
  const std::string where =
      run.device.is_cuda() ? run.device.str() : fmt::format("cpu ({} threads)", at::get_num_threads());
  const std::string ranks =
      run.pipeline ? fmt::format(" x {} pipeline stages{}{} (this rank: layers {}..{}{})", run.pipeline->stages(),
                                 run.tensor ? fmt::format(" x {} tensor-parallel ranks", run.tensor->ranks()) : "",
                                 run.replicas ? fmt::format(" x {} ranks each (--shard {})", run.data_ranks(),
                                                            shard_level_name(c.shard))
                                              : "",
                                 run.pipeline->layers().first, run.pipeline->layers().end - 1,
                                 run.tensor ? fmt::format(", share {}", run.tensor->rank()) : "")
      : run.tensor ? fmt::format(" x {} tensor-parallel ranks{} (this rank: share {})", run.tensor->ranks(),
                                 run.replicas ? fmt::format(" x {} data-parallel (--shard {})", run.data_ranks(),
                                                            shard_level_name(c.shard))
                                              : "",
                                 run.tensor->rank())
      : run.comm   ? fmt::format(" x {} ranks (--shard {})", run.ranks(), shard_level_name(c.shard))
                   : "";
  fmt::print(stderr,
             "headroom train: {} ({}, {:.2f}M params{}) on {}, {} ({} K tokens); batch {} x accum {}{} x seq {}, {}, "
             "{}, checkpointing {}, steps {}..{}{}\n",
             run.model_config.name, family_name(run.model_config.family), run.model->num_parameters() / 1e6,
             c.finetune.full() ? std::string()
                               : fmt::format(", {:.2f}M trained: --finetune {}",
                                             run.model->num_trainable_parameters() / 1e6, c.finetune.name()),
             where, data.origin(), (data.train_tokens() + data.eval_tokens()) / 1000, c.batch, c.accum, ranks, c.seq,
             precision_name(c.precision), run.optimizer->name(), c.checkpointing.name(), start + 1, c.steps,
             c.memory_budget ? fmt::format(", memory budget {}", format_bytes(*c.memory_budget)) : "");
}

// The record of a step the guard completed; the step's time includes waiting for the device.
StepRecord record_step(Run& run, int64_t step, const GuardedStep& g, Clock::time_point started) {
  if (run.device.is_cuda()) cuda_synchronize();
  StepRecord r;
  r.memory = run.monitor->end_step();
  r.seconds = seconds_since(started);
  r.step = step + 1;
  r.loss = g.outcome.loss;
  r.tokens = run.config.batch * run.config.accum * run.config.seq * run.data_ranks();
  if (run.comm) r.rank = run.rank();
  r.peak_bytes = r.memory.peak;
  r.live_bytes = run.probe->live_bytes();
  r.reserved_bytes = r.memory.reserved;
  r.peak_reserved_bytes = r.memory.peak_reserved;
  r.peak_inactive_split_bytes = r.memory.peak_inactive_split;
  if (run.optimizer->offloaded() || run.forward.offload) {
    r.host_peak_bytes = r.memory.host_peak ? *r.memory.host_peak : run.host_bytes();
  }
  r.lr = run.schedule.at(step);
  r.grad_norm = g.outcome.grad_norm;
  r.batch = g.micro;
  r.accum = g.accum;
  r.oom_recoveries = g.recoveries;
  r.skipped = g.outcome.skipped;
  if (run.scaler) r.loss_scale = run.scaler->scale_value();
  if (run.model_config.moe) r.routing_skew = run.routing_skew;
  run.routing_skew = 0;
  return r;
}

// Ends a run whose loss is no longer a number: at once, or with fp16's loss scaler (which skips
// overflowing steps and backs off) after 5 non-finite steps in a row.
class DivergenceWatch {
 public:
  explicit DivergenceWatch(Precision precision) : patience_(precision == Precision::fp16_mixed ? 5 : 1) {}
  std::optional<Divergence> after(const StepRecord& r) {
    // Without loss scaling a non-finite gradient norm has already reached the weights in this
    // step's update, even when the loss (computed before it) was finite.
    if (patience_ == 1 && !r.skipped && !std::isfinite(r.grad_norm)) return Divergence{r.step, r.step, r.grad_norm};
    if (std::isfinite(r.loss)) {
      run_ = 0;
      return std::nullopt;
    }
    if (run_++ == 0) since_ = r.step;
    if (run_ < patience_) return std::nullopt;
    return Divergence{r.step, since_, r.loss};
  }

 private:
  int64_t patience_, run_ = 0, since_ = 0;
};

TrainSummary summarize(const Run& run, int64_t start, const std::vector<StepRecord>& steps, double seconds) {
  TrainSummary s;
  s.params = run.model->num_parameters();
  s.trainable_params = run.model->num_trainable_parameters();
  s.device = run.device.str();
  s.steps = start + static_cast<int64_t>(steps.size());
  s.seconds = seconds;
  s.eval_loss = std::numeric_limits<double>::quiet_NaN();
  double step_seconds = 0;
  int64_t tokens = 0;
  for (const StepRecord& r : steps) {
    s.peak_bytes = std::max(s.peak_bytes, r.peak_bytes);
    if (r.peak_reserved_bytes) s.peak_reserved_bytes = std::max(s.peak_reserved_bytes.value_or(0), *r.peak_reserved_bytes);
    if (r.host_peak_bytes) s.host_bytes = std::max(s.host_bytes.value_or(0), *r.host_peak_bytes);
    step_seconds += r.seconds;
    tokens += r.tokens;
  }
  if (!steps.empty()) {
    s.final_loss = steps.back().loss;
    if (steps.back().eval_loss) s.eval_loss = *steps.back().eval_loss;
  }
  for (const StepRecord& r : steps) {
    if (r.routing_skew) s.routing_skew = std::max(s.routing_skew.value_or(0.0), *r.routing_skew);
  }
  s.tokens_per_s = step_seconds > 0 ? static_cast<double>(tokens) / step_seconds : 0.0;
  if (!run.device.is_cuda() || run.records_origins()) {
    s.surviving = leak_sites(run.probe->live_allocations(), start + 2, s.steps);
  }
  s.memory_table = run.monitor->summary_table();
  s.memory_source = run.probe->source();
  return s;
}

}  // namespace

std::string Divergence::message() const {
  return fmt::format(
      "training diverged: the loss or the gradient norm is {} at step {}{}; likely causes: a learning rate too high "
      "(--lr), no "
      "gradient clipping (--grad-clip 0), a config field that breaks the numerics (rope_theta 0, a tiny "
      "layer_norm_eps), fp16 overflow; the checkpoint, if any, is from before it",
      // NaN's sign bit is whatever the arithmetic left (it differs between CPUs): "nan" always.
      std::isnan(loss) ? std::string("nan") : fmt::format("{}", loss), step,
      since < step ? fmt::format(" (not finite since step {})", since) : "");
}

double TrainResult::median_step_seconds() const {
  std::vector<double> t;
  for (const StepRecord& r : steps) t.push_back(r.seconds);
  return median_after_warmup(t);
}

std::vector<StepLive> TrainResult::live_series() const {
  std::vector<StepLive> out;
  for (const StepRecord& r : steps) out.push_back({r.step, r.live_bytes, r.transient_bytes()});
  return out;
}

int64_t TrainResult::peak_or_failure_bytes() const {
  if (oom) return oom->in_use + std::max<int64_t>(0, oom->requested);
  return summary.peak_bytes;
}

TrainResult train(const RunConfig& cfg) {
  TrainResult result;
  MadeRun made = make_run(cfg);
  if (!made.run) {
    result.oom = std::move(made.oom);
    return result;
  }
  Run& run = *made.run;
  // The directory checkpoints go to (where it resumed from, unless told otherwise): checked and
  // locked before anything reads or trains, so that a bad path or a second run is found now.
  std::optional<DirLock> lock;
  if (const std::string& dir = !cfg.checkpoint.empty() ? cfg.checkpoint : cfg.resume; !dir.empty()) {
    const bool resuming_only = cfg.checkpoint.empty();
    // A --resume directory that is not there is resume()'s error to give, not one to create.
    if (!resuming_only || std::filesystem::is_directory(dir)) {
      check_checkpoint_dir(dir, resuming_only ? "--resume" : "--checkpoint");
      // One job, one lock: rank 0 holds it for all the ranks.
      if (run.rank() == 0) lock.emplace(dir, resuming_only ? "--resume" : "--checkpoint");
    }
  }
  const int64_t start = cfg.resume.empty() ? 0 : resume(run);
  const auto resumed_at = cfg.resume.empty() ? std::nullopt : std::optional<int64_t>(start);
  const auto observers = make_observers(run, start, resumed_at);
  if (!cfg.quiet && run.rank() == 0) announce(run, start);
  if (!cfg.quiet && !run.comm && cfg.shard != ShardLevel::none) {
    fmt::print(stderr, "note: --shard {} has no effect in a lone process; launch ranks with torchrun --nproc-per-node N\n",
               shard_level_name(cfg.shard));
  }

  const auto started = Clock::now();
  const int64_t end = cfg.end_step();
  OomGuard guard(run);
  DivergenceWatch watch(cfg.precision);
  for (int64_t step = start; step < end; ++step) {
    const auto step_started = Clock::now();
    const GuardedStep g = guard.run(step);
    if (g.oom) {
      result.oom = g.oom;
      break;
    }
    StepRecord record = record_step(run, step, g, step_started);
    if ((result.diverged = watch.after(record))) {
      result.steps.push_back(std::move(record));  // kept in the result; no observer sees it (no checkpoint of it)
      break;
    }
    for (const auto& o : observers) o->after_step(run, record, step + 1 == end);
    result.steps.push_back(std::move(record));
    // Data-parallel ranks stop together: a signal that reached one of them between steps stops all.
    const int signal = run.replicas ? run.replicas->agree(interrupt_requested()) : interrupt_requested();
    if (step + 1 < end && signal) {
      result.interrupted = signal;
      for (const auto& o : observers) o->on_stop(run, result.steps.back());
      break;
    }
  }
  result.summary = summarize(run, start, result.steps, seconds_since(started));
  result.summary.rank = run.rank();
  result.summary.ranks = run.ranks();
  // Every rank ends here together (an OOM, a divergence and an interrupt are agreed on), except
  // after an OOM inside the update, where the others are waiting in a collective.
  // A pipeline's stage (or a tensor-parallel share) that ran out of memory leaves the others inside
  // their schedules.
  if (run.comm && !(result.oom && (result.oom->during_update || run.model_parallel()))) {
    at::Tensor mine = at::full({1}, result.summary.peak_bytes, at::kLong);
    at::Tensor all = at::empty({run.ranks()}, at::kLong);
    run.comm->allgather(all, mine);
    for (int64_t i = 0; i < run.ranks(); ++i) result.summary.rank_peak_bytes.push_back(all[i].item<int64_t>());
  }
  // The allocator's history, with the failure in it when there was one.
  if (!cfg.memory_snapshot.empty()) {
    write_file_atomically(rank_file(cfg.memory_snapshot, run.rank()), run.probe->snapshot_pickle(),
                          "--memory-snapshot");
  }
  return result;
}

}  // namespace headroom
