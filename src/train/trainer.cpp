#include "train/trainer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>

#include "config/model_config.h"
#include "data/text_dataset.h"
#include "device/autocast_adapter.h"
#include "device/cuda_adapter.h"
#include "device/device.h"
#include "estimate/estimator.h"
#include "memory/budget_allocator.h"
#include "memory/cache_policy.h"
#include "memory/memory_monitor.h"
#include "memory/memory_probe.h"
#include "memory/oom_report.h"
#include "model/causal_lm.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/lr_schedule.h"
#include "train/metrics_log.h"
#include "train/precision.h"
#include "train/step_ops.h"
#include "util/error.h"
#include "util/files.h"
#include "util/json.h"
#include "util/size.h"

namespace headroom {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double evaluate(const CausalLM& model, const TextDataset& data, const RunConfig& cfg, const at::Device& device,
                AttentionPath attention, Precision precision) {
  if (cfg.eval_rows == 0) return std::numeric_limits<double>::quiet_NaN();
  c10::NoGradGuard no_grad;
  double loss_sum = 0;
  int64_t tokens = 0;
  for (const Batch& b : data.eval_batches(cfg.batch, cfg.eval_rows)) {
    AutocastScope autocast(device.type(), forward_autocast(precision));
    auto logits = model.forward(b.inputs.to(device), {attention, /*training=*/false});
    loss_sum += token_loss(logits, b.targets.to(device)).item<double>() * static_cast<double>(b.tokens());
    tokens += b.tokens();
  }
  return loss_sum / static_cast<double>(tokens);
}

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

std::vector<at::Tensor> gradients(const std::vector<NamedTensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.tensor.grad().defined()) grads.push_back(p.tensor.grad());
  }
  return grads;
}

// After an OOM inside a step: what was in use and of what it consisted, then release everything the
// failed step held (its activations are already gone with the unwound stack; its gradients are not).
OomReport diagnose_oom(const c10::OutOfMemoryError& e, const MemoryProbe& probe, MemoryMonitor& monitor,
                       const std::vector<NamedTensor>& params) {
  OomReport r;
  r.step = monitor.current_step() + 1;
  r.phase = monitor.last_phase();
  r.message = first_line(e.what_without_backtrace());
  r.budget = probe.budget().value_or(-1);
  r.live_before_step = monitor.step_start_live();
  if (auto event = probe.last_oom()) {
    r.phase = event->phase;
    r.requested = event->requested;
    r.in_use = event->live;
    r.injected = event->injected;
    r.breakdown = monitor.breakdown_at(event->live, event->sequence);
  } else {
    r.in_use = probe.peak_bytes();
    r.breakdown = monitor.breakdown_at(r.in_use, std::nullopt);
  }
  zero_grad(params);
  monitor.abort_step();
  r.live_after_cleanup = probe.live_bytes();
  return r;
}

// Each lever that applies, alone and then all together, at micro-batch 1: its predicted peak, and
// whether that fits `budget`.
std::string estimated_levers(const RunConfig& cfg, int64_t budget) {
  struct Change {
    std::string flag;
    std::function<void(RunConfig&)> apply;
  };
  std::vector<Change> changes;
  if (cfg.checkpointing != "full")
    changes.push_back({"--checkpointing full", [](RunConfig& c) { c.checkpointing = "full"; }});
  if (cfg.precision == "fp32") {
    changes.push_back({"--precision bf16-mixed", [](RunConfig& c) { c.precision = "bf16-mixed"; }});
  }
  if (cfg.precision != "bf16") changes.push_back({"--precision bf16", [](RunConfig& c) { c.precision = "bf16"; }});
  if (cfg.attention == "math") changes.push_back({"--attention flash", [](RunConfig& c) { c.attention = "flash"; }});
  if (cfg.optimizer != "sgd" && cfg.optimizer != "adafactor") {
    changes.push_back({"--optimizer adafactor", [](RunConfig& c) { c.optimizer = "adafactor"; }});
  }
  if (cfg.seq >= 32) {
    changes.push_back({fmt::format("--seq {}", cfg.seq / 2), [](RunConfig& c) { c.seq /= 2; }});
  }
  if (changes.empty()) return "";
  const ModelConfig model = load_model_config(cfg.model, cfg.overrides);
  RunConfig one = cfg;
  one.batch = 1;
  one.accum = 1;
  auto peak_of = [&](const RunConfig& c) { return estimate(model, train_spec(c)).peak_bytes; };
  std::vector<std::string> parts;
  RunConfig all = one;
  for (const Change& ch : changes) {
    RunConfig c = one;
    ch.apply(c);
    if (ch.flag != "--precision bf16") ch.apply(all);  // pure bf16 only alone
    const int64_t peak = peak_of(c);
    parts.push_back(fmt::format("{} {} ({})", ch.flag, format_bytes(peak), peak <= budget ? "fits" : "does not fit"));
  }
  const int64_t together = peak_of(all);
  return fmt::format("; by the estimator, at micro-batch 1 with {} of budget: {}; all but pure bf16 together {} ({})",
                     format_bytes(budget), fmt::join(parts, ", "), format_bytes(together),
                     together <= budget ? "fits" : "does not fit");
}

// What would let the step fit, from what held the memory when it failed, with the estimator's
// numbers for each lever when there is a budget.
std::string oom_advice(const OomReport& r, const RunConfig& cfg, int64_t micro, bool updating) {
  std::vector<std::string> levers;
  const Breakdown& b = r.breakdown;
  if (updating) {
    levers.push_back(
        "it ran out during or after the optimizer update, which cannot be run again: a lighter "
        "optimizer leaves the update more room");
  }
  if (b.activations >= std::max({b.weights, b.gradients, b.optimizer})) {
    if (cfg.checkpointing != "full") levers.push_back("--checkpointing full (recompute activations in backward)");
    if (cfg.precision == "fp32") levers.push_back("--precision bf16-mixed (half-size activations)");
    if (cfg.attention == "math") levers.push_back("--attention flash (no score matrix)");
    levers.push_back("a shorter --seq");
  }
  if (b.optimizer >= b.weights && cfg.optimizer != "sgd") {
    levers.push_back("--optimizer adafactor or sgd (less optimizer state)");
  }
  levers.push_back("--precision bf16 (2 bytes per weight, gradient and state value)");
  if (r.budget >= 0) levers.push_back("a larger --memory-budget");
  std::string out = cfg.no_guard ? "the OOM guard is off (--no-guard); " : "";
  if (!cfg.no_guard && micro == 1) out += "micro-batch 1 does not fit either; ";
  out += "levers that reduce this step's memory: " + fmt::format("{}", fmt::join(levers, "; "));
  if (r.budget > 0) out += estimated_levers(cfg, r.budget);
  return out;
}

void arm_injection(const RunConfig::OomInjection& o) {
  BudgetAllocator& a = BudgetAllocator::install();
  if (o.nth > 0) {
    a.fail_nth_allocation(o.nth);
  } else {
    a.fail_allocation_above(o.above_bytes);
  }
}

void write_snapshot(const std::string& path) {
  const std::string pickle = cuda_memory_snapshot_pickle();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) fail("--memory-snapshot: cannot write '{}'", path);
  const bool ok = std::fwrite(pickle.data(), 1, pickle.size(), f) == pickle.size();
  if (std::fclose(f) != 0 || !ok) fail("--memory-snapshot: writing '{}' failed", path);
}

std::string format_eta(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

}  // namespace

double TrainSummary::median_step_seconds() const {
  if (step_seconds.empty()) return 0;
  std::vector<double> t(step_seconds.begin() + (step_seconds.size() > 1 ? 1 : 0), step_seconds.end());
  std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
  return t[t.size() / 2];
}

TrainSummary train(const RunConfig& cfg) {
  validate(cfg);
  const at::Device device = resolve_device(cfg.device);
  const AttentionPath attention = parse_attention_path(cfg.attention);
  const Precision precision = parse_precision(cfg.precision);
  const ForwardOptions train_forward{attention, /*training=*/true, parse_checkpoint_policy(cfg.checkpointing)};
  if (!cfg.memory_snapshot.empty() && !device.is_cuda()) {
    fail(
        "--memory-snapshot needs --device cuda (it is PyTorch's CUDA allocator history); on cpu the metrics "
        "JSONL has the per-phase memory");
  }
  const auto injection = cfg.oom_injection();
  if (injection && device.is_cuda()) fail("--inject-oom works on --device cpu only (it uses the budget allocator)");
  auto probe = make_memory_probe(device);  // on cpu: installs the counting allocator before anything
  // What this run sets process-wide (a budget, CUDA allocation history) is undone when it ends.
  struct RunGuard {
    MemoryProbe& probe;
    bool history, origins;
    ~RunGuard() {
      try {
        probe.set_budget(std::nullopt);
        if (history) cuda_record_memory_history(false);
        if (origins) probe.record_origins(false);
      } catch (...) {
      }
    }
  } guard{*probe, !cfg.memory_snapshot.empty(), cfg.leak_origins && device.is_cuda() && cfg.memory_snapshot.empty()};
  if (guard.history) cuda_record_memory_history(true);
  if (guard.origins) probe->record_origins(true);  // the snapshot's recorder would replace it

  const ModelConfig model_cfg = load_model_config(cfg.model, cfg.overrides);
  if (model_cfg.vocab_size < kByteVocabulary) {
    fail("{}: vocab_size {} is smaller than the byte tokenizer's {}; set --set vocab_size=256 or more", model_cfg.name,
         model_cfg.vocab_size, kByteVocabulary);
  }
  if (cfg.seq > model_cfg.max_positions) {
    fail("--seq {} exceeds {}'s max_position_embeddings {}", cfg.seq, model_cfg.name, model_cfg.max_positions);
  }
  const TextDataset data = TextDataset::load(cfg.data, 0.1, cfg.seq);

  // The budget applies from here: the model and optimizer state must fit in it too.
  probe->set_budget(cfg.budget_bytes());
  std::optional<CausalLM> model_holder;
  std::unique_ptr<Optimizer> optimizer;
  try {
    model_holder.emplace(model_cfg, at::TensorOptions().dtype(parameter_dtype(precision)).device(device), cfg.seed);
    OptimizerOptions optimizer_options;
    optimizer_options.weight_decay = cfg.weight_decay_value();
    optimizer = make_optimizer(parse_optimizer(cfg.optimizer), model_holder->parameters(), optimizer_options);
  } catch (const c10::OutOfMemoryError& e) {
    OomReport r;
    r.during_setup = true;
    r.message = first_line(e.what_without_backtrace());
    r.budget = probe->budget().value_or(-1);
    const auto event = probe->last_oom();
    r.in_use = event ? event->live : probe->live_bytes();
    r.requested = event ? event->requested : -1;
    r.breakdown.weights =
        count_parameters(model_cfg) * static_cast<int64_t>(c10::elementSize(parameter_dtype(precision)));
    throw OutOfMemory(r);
  }
  CausalLM& model = *model_holder;
  std::optional<LossScaler> scaler;
  if (precision == Precision::fp16_mixed) scaler.emplace(device);
  const LrSchedule schedule{cfg.lr, cfg.min_lr_ratio, cfg.warmup_steps(), cfg.steps};
  const std::vector<NamedTensor>& params = model.parameters();

  MemoryMonitor monitor(*probe, TrackedTensors{[&] { return model.parameter_tensors(); },
                                               [&] {
                                                 std::vector<at::Tensor> grads;
                                                 for (const auto& p : params) grads.push_back(p.tensor.grad());
                                                 return grads;
                                               },
                                               [&] {
                                                 std::vector<at::Tensor> state;
                                                 for (const auto& s : optimizer->state()) state.push_back(s.tensor);
                                                 for (const auto& t : optimizer->working_memory()) state.push_back(t);
                                                 return state;
                                               }});

  int64_t start = 0;
  std::optional<int64_t> resumed_at;
  if (!cfg.resume.empty()) {
    const CheckpointInfo info = load_checkpoint(cfg.resume, params, optimizer->state());
    if (info.seed != cfg.seed) {
      fail("--resume: the checkpoint was trained with --seed {}, this run has --seed {}; pass --seed {}", info.seed,
           cfg.seed, info.seed);
    }
    if (info.total_steps != cfg.steps && !cfg.quiet) {
      fmt::print(stderr,
                 "note: the checkpoint's schedule was {} steps, this run's is {}; the learning rate "
                 "follows the new one\n",
                 info.total_steps, cfg.steps);
    }
    const std::string differs = config_difference(info.model, model_cfg.source);
    if (!differs.empty()) {
      fail(
          "--resume: the checkpoint was trained with a different model config ({}); resume with the same "
          "--model and --set",
          differs);
    }
    start = info.step;
    resumed_at = start;
    const int64_t until = cfg.stop_at > 0 ? cfg.stop_at : cfg.steps;
    if (start >= until) {
      fail("--resume: the checkpoint is at step {}, which is already at or past --{} {}; raise it to train further",
           start, cfg.stop_at > 0 ? "stop-at" : "steps", until);
    }
  }
  const std::string checkpoint_dir = !cfg.checkpoint.empty() ? cfg.checkpoint : cfg.resume;
  MetricsLog metrics = cfg.metrics.empty() ? MetricsLog() : MetricsLog(cfg.metrics, resumed_at);

  if (!cfg.quiet) {
    fmt::print(stderr,
               "headroom train: {} ({}, {:.2f}M params) on {}, {} ({} KB); batch {} x accum {} x seq {}, "
               "{}, {}, checkpointing {}, steps {}..{}{}\n",
               model_cfg.name, family_name(model_cfg.family), model.num_parameters() / 1e6, device.str(), data.origin(),
               (data.train_tokens() + data.eval_tokens()) / 1000, cfg.batch, cfg.accum, cfg.seq,
               precision_name(precision), optimizer->name(), train_forward.checkpoint.name(), start + 1, cfg.steps,
               cfg.budget_bytes() ? fmt::format(", memory budget {}", format_bytes(*cfg.budget_bytes())) : "");
  }

  const int64_t tokens_per_step = cfg.batch * cfg.accum * cfg.seq;
  TrainSummary summary;
  summary.params = model.num_parameters();
  summary.device = device.str();
  summary.steps = start;
  const auto run_start = Clock::now();
  auto last_print = Clock::now() - std::chrono::seconds(10);
  int64_t peak = 0;
  double train_seconds = 0;
  std::optional<double> eval_loss;

  const int64_t end = cfg.stop_at > 0 ? cfg.stop_at : cfg.steps;
  const int64_t global_rows = cfg.batch * cfg.accum;  // sequences per optimizer step, fixed
  int64_t micro = cfg.batch;                          // the guard may lower it; it stays lowered
  bool expandable_segments = false;                   // cuda: switched on once fragmentation caused an OOM
  std::vector<at::Tensor> leaked_outputs;             // --inject-leak keep-outputs
  at::Tensor leaked_total;                            // --inject-leak keep-graph
  for (int64_t step = start; step < end; ++step) {
    const auto t0 = Clock::now();
    seed_step(cfg.seed, step);
    const double lr = schedule.at(step);
    double loss = 0;
    double grad_norm = 0;
    bool skipped = false;
    int64_t recoveries = 0;
    if (injection && injection->step == step + 1) arm_injection(*injection);
    // The OOM guard: an OOM before the update discards the whole accumulation window and runs the
    // same global batch again (same rows, same order) with half the micro-batch and twice the
    // accumulation, until micro-batch 1.
    for (;;) {
      monitor.begin_step(step);
      bool updating = false;
      const int64_t accum = (global_rows + micro - 1) / micro;
      loss = 0;
      try {
        for (int64_t m = 0; m < accum; ++m) {
          at::Tensor inputs, targets, micro_loss;
          {
            auto phase = monitor.phase(Phase::data);
            const Batch b = data.train_batch(cfg.seed, step, m * micro, std::min(micro, global_rows - m * micro));
            inputs = b.inputs.to(device);
            targets = b.targets.to(device);
          }
          {
            auto phase = monitor.phase(Phase::forward);
            AutocastScope autocast(device.type(), forward_autocast(precision));
            const at::Tensor logits = model.forward(inputs, train_forward);
            if (cfg.inject_leak == "keep-outputs") leaked_outputs.push_back(logits.detach());
            micro_loss = token_loss(logits, targets);
            if (cfg.inject_leak == "keep-graph") {
              leaked_total = leaked_total.defined() ? leaked_total + micro_loss : micro_loss;
            }
          }
          // Token-weighted: the sum over micro-batches equals the global batch's mean loss.
          const double weight = static_cast<double>(inputs.numel()) / static_cast<double>(tokens_per_step);
          {
            auto phase = monitor.phase(Phase::backward);
            at::Tensor weighted = micro_loss * weight;
            // A planted keep-graph leak retains each step's graph, as the "fix" for backward
            // complaining about the summed losses' freed graph does.
            (scaler ? scaler->scale(weighted) : weighted)
                .backward({}, /*retain_graph=*/cfg.inject_leak == "keep-graph");
          }
          loss += micro_loss.item<double>() * weight;
        }
        {
          auto phase = monitor.phase(Phase::optimizer);
          // fp16: gradients come back to their true scale first; a step with an inf or NaN is skipped.
          skipped = scaler && scaler->unscale(gradients(params));
          if (!skipped) {
            grad_norm = clip_grad_norm(params, cfg.grad_clip);
            updating = true;  // from here a failure may leave parameters half-updated: not retried
            optimizer->step(lr);
          }
          if (scaler) scaler->update();
        }
        {
          auto phase = monitor.phase(Phase::zero_grad);
          zero_grad(params);
        }
        break;
      } catch (const c10::OutOfMemoryError& e) {
        // On cuda, the allocator's state at the failure, before the step's memory is released.
        CacheState cache;
        if (device.is_cuda()) {
          const CudaMemoryStats st = cuda_memory_stats(device.index());
          cache = {st.allocated_bytes, st.reserved_bytes, st.inactive_split_bytes,
                   requested_bytes_of(e.what_without_backtrace()), expandable_segments};
        }
        OomReport report = diagnose_oom(e, *probe, monitor, params);
        if (device.is_cuda() && !cfg.no_guard && !updating) {
          const CacheDecision d = after_oom(cache);
          if (d.action == CacheAction::expandable_segments) {
            // Fragmentation, not size: the same micro-batch again, in expandable segments.
            cuda_set_allocator_settings("expandable_segments:True");
            expandable_segments = true;
            if (!cfg.quiet) {
              fmt::print(stderr,
                         "step {}: out of memory with micro-batch {}: {}; expandable segments on, same "
                         "micro-batch again\n",
                         step + 1, micro, d.reason);
            }
            ++recoveries;
            seed_step(cfg.seed, step);
            continue;
          }
        }
        if (cfg.no_guard || updating || micro == 1) {
          if (injection) BudgetAllocator::install().disarm();
          report.advice = oom_advice(report, cfg, micro, updating);
          throw OutOfMemory(report);
        }
        const int64_t smaller = (micro + 1) / 2;
        if (!cfg.quiet) {
          fmt::print(stderr,
                     "step {}: out of memory in {} with micro-batch {} ({} in use); running the step again "
                     "as {} x {}\n",
                     step + 1, phase_name(report.phase), micro, format_bytes(report.in_use), smaller,
                     (global_rows + smaller - 1) / smaller);
        }
        micro = smaller;
        ++recoveries;
        seed_step(cfg.seed, step);
        if (device.is_cuda()) {
          // Segments cut for the old shapes: returned once if enough of the reservation is idle.
          const CudaMemoryStats st = cuda_memory_stats(device.index());
          if (empty_cache_after_reshape(st.allocated_bytes, st.reserved_bytes)) cuda_empty_cache();
        }
      }
    }
    if (injection && injection->step == step + 1) BudgetAllocator::install().disarm();
    if (device.is_cuda()) cuda_synchronize();
    const StepMemory mem = monitor.end_step();

    StepRecord rec;
    rec.step = step + 1;
    rec.loss = loss;
    rec.tokens = tokens_per_step;
    rec.seconds = seconds_since(t0);
    rec.peak_bytes = mem.peak;
    rec.live_bytes = probe->live_bytes();
    rec.lr = lr;
    rec.grad_norm = grad_norm;
    rec.batch = micro;
    rec.accum = (global_rows + micro - 1) / micro;
    rec.oom_recoveries = recoveries;
    rec.peak_phase = std::string(phase_name(mem.peak_phase));
    rec.skipped = skipped;
    if (scaler) rec.loss_scale = scaler->scale_value();
    rec.phases = mem.to_json();
    const bool last = step + 1 == end;
    // The checkpoint first: a failure in evaluation must not cost the run its state.
    if (!checkpoint_dir.empty() && (last || (cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0))) {
      CheckpointInfo info{step + 1, cfg.seed, cfg.steps, model_cfg.source};
      save_checkpoint(checkpoint_dir, info, params, optimizer->state());
    }
    if (last || (cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0)) {
      eval_loss = evaluate(model, data, cfg, device, attention, precision);
      rec.eval_loss = eval_loss;
    }
    metrics.write(rec);
    train_seconds += rec.seconds;
    summary.step_seconds.push_back(rec.seconds);
    summary.live_series.push_back({rec.step, rec.live_bytes, mem.peak - mem.phases[0].live_in});
    peak = std::max(peak, rec.peak_bytes);
    summary.steps = step + 1;
    summary.final_loss = loss;
    if (!cfg.quiet && (last || seconds_since(last_print) >= 2.0 || step == start)) {
      last_print = Clock::now();
      const int64_t done = step + 1 - start;
      const double tok_s = static_cast<double>(done * tokens_per_step) / train_seconds;
      const double eta = train_seconds / static_cast<double>(done) * static_cast<double>(end - step - 1);
      fmt::print(stderr, "step {:>5}/{}  loss {:.4f}{}  lr {:.2e}  {:.0f} tok/s  mem {} (peak {} in {})  eta {}\n",
                 step + 1, cfg.steps, loss, rec.eval_loss ? fmt::format("  eval {:.4f}", *rec.eval_loss) : "", lr,
                 tok_s, format_bytes(rec.live_bytes), format_bytes(rec.peak_bytes), rec.peak_phase, format_eta(eta));
    }
  }
  summary.seconds = seconds_since(run_start);
  if (!device.is_cuda() || guard.origins) summary.surviving = leak_sites(probe->live_allocations(), start + 2, end);
  summary.peak_bytes = peak;
  const int64_t ran = summary.steps - start;
  summary.tokens_per_s = ran > 0 ? static_cast<double>(ran * tokens_per_step) / train_seconds : 0.0;
  if (!eval_loss) eval_loss = evaluate(model, data, cfg, device, attention, precision);  // resumed at the end already
  summary.eval_loss = *eval_loss;
  summary.memory_table = monitor.summary_table();
  summary.memory_source = probe->source();
  if (!cfg.memory_snapshot.empty()) write_snapshot(cfg.memory_snapshot);
  return summary;
}

}  // namespace headroom
