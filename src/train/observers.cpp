#include "train/observers.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "model/hf_weights.h"
#include "model/peft_adapter.h"
#include "train/checkpoint.h"
#include "train/metrics_log.h"
#include "train/step.h"
#include "util/size.h"

namespace headroom {
namespace {

bool due(int64_t step, int64_t every, bool last) { return last || (every > 0 && step % every == 0); }

class EvalObserver final : public StepObserver {
 public:
  explicit EvalObserver(int64_t every) : every_(every) {}
  void after_step(Run& run, StepRecord& rec, bool last) override {
    if (!due(rec.step, every_, last)) return;
    // Without gradients, evaluation at the step's micro-batch needs less than the step did. Should
    // it still run out, the run whose training fits is not ended by its evaluation.
    try {
      rec.eval_loss = evaluate(run, rec.batch);
    } catch (const c10::OutOfMemoryError&) {
      if (!run.config.quiet) fmt::print(stderr, "step {}: evaluation skipped: out of memory\n", rec.step);
    }
  }

 private:
  int64_t every_;
};

class CheckpointObserver final : public StepObserver {
 public:
  CheckpointObserver(std::string dir, int64_t every) : dir_(std::move(dir)), every_(every) {}
  void after_step(Run& run, StepRecord& rec, bool last) override {
    if (due(rec.step, every_, last)) save(run, rec.step);
  }
  void on_stop(Run& run, const StepRecord& last) override {
    if (saved_ != last.step) save(run, last.step);
  }

 private:
  void save(Run& run, int64_t step) {
    const CheckpointInfo info{step, run.config.seed, run.config.steps, optimizer_name(run.config.optimizer),
                              run.model_config.source};
    const bool sliced = run.replicas && run.replicas->sharded();
    if (sliced || run.model_parallel()) {
      // Each rank its own file (its slices, or its stage's or share's parameters); the manifest once
      // all of them are in place.
      save_checkpoint(dir_, info, sliced ? run.replicas->checkpoint_weights() : run.parameters(),
                      run.optimizer->state(), CheckpointShard{run.rank(), run.ranks()});
      if (run.comm) run.comm->barrier();  // (bf16-params alone has no other rank)
      if (run.rank() == 0) write_shard_manifest(dir_, {run.ranks(), shard_level_name(run.shard()), step, run.layout()});
    } else if (run.rank() == 0) {
      // Every rank holds the same state: rank 0 writes it, resumable by any world size.
      save_checkpoint(dir_, info, run.parameters(), run.optimizer->state());
    }
    saved_ = step;
  }

  std::string dir_;
  int64_t every_;
  int64_t saved_ = -1;
};

class MetricsObserver final : public StepObserver {
 public:
  MetricsObserver(const std::string& path, std::optional<int64_t> resumed_at) : log_(path, resumed_at) {}
  void after_step(Run&, StepRecord& rec, bool) override { log_.write(rec); }

 private:
  MetricsLog log_;
};

class ProgressObserver final : public StepObserver {
 public:
  ProgressObserver(int64_t start, int64_t end, int64_t total) : start_(start), end_(end), total_(total) {}
  void after_step(Run&, StepRecord& rec, bool last) override {
    using Clock = std::chrono::steady_clock;
    seconds_ += rec.seconds;
    tokens_ += rec.tokens;
    const auto now = Clock::now();
    if (!(last || rec.step == start_ + 1 || now - last_print_ >= std::chrono::seconds(2))) return;
    last_print_ = now;
    const int64_t done = rec.step - start_;
    const double eta = seconds_ / static_cast<double>(done) * static_cast<double>(end_ - rec.step);
    fmt::print(stderr, "step {:>5}/{}  loss {:.4f}{}  lr {:.2e}  {:.0f} tok/s  mem {} (peak {} in {})  eta {}\n",
               rec.step, total_, rec.loss, rec.eval_loss ? fmt::format("  eval {:.4f}", *rec.eval_loss) : "", rec.lr,
               static_cast<double>(tokens_) / seconds_, format_bytes(rec.live_bytes), format_bytes(rec.peak_bytes),
               phase_name(rec.memory.peak_phase), format_duration(eta));
  }

 private:
  int64_t start_, end_, total_;
  double seconds_ = 0;
  int64_t tokens_ = 0;
  std::chrono::steady_clock::time_point last_print_{};
};

// --save-weights DIR: the trained weights as a Hugging Face checkpoint, at the end and when the run
// is interrupted (rank 0; the other ranks hold the same weights).
class SaveWeightsObserver : public StepObserver {
 public:
  explicit SaveWeightsObserver(std::string dir) : dir_(std::move(dir)) {}
  void after_step(Run& run, StepRecord& rec, bool last) override {
    if (last) save(run, rec);
  }
  void on_stop(Run& run, const StepRecord& last) override { save(run, last); }

 private:
  void save(Run& run, const StepRecord& rec) {
    if (run.rank() != 0) return;
    const RunConfig& c = run.config;
    if (c.finetune.is_lora() && !c.merge_lora) {
      save_peft_adapter(dir_, *run.model, !c.weights.empty() ? c.weights : c.model);
      if (!c.quiet) fmt::print(stderr, "saved the LoRA adapter of step {} to {} (peft format)\n", rec.step, dir_);
      return;
    }
    save_hf_weights(dir_, *run.model, c.merge_lora);
    if (!c.quiet) {
      fmt::print(stderr, "saved the {}weights of step {} to {} (Hugging Face format)\n",
                 c.merge_lora ? "merged " : "", rec.step, dir_);
    }
  }
  std::string dir_;
};

}  // namespace

std::string rank_file(const std::string& path, int rank) {
  if (rank == 0) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / fmt::format("{}.rank{}{}", p.stem().string(), rank, p.extension().string())).string();
}

std::unique_ptr<StepObserver> eval_observer(int64_t every) { return std::make_unique<EvalObserver>(every); }

std::unique_ptr<StepObserver> checkpoint_observer(const std::string& dir, int64_t every) {
  return std::make_unique<CheckpointObserver>(dir, every);
}

std::unique_ptr<StepObserver> metrics_observer(const std::string& path, std::optional<int64_t> resumed_at) {
  return std::make_unique<MetricsObserver>(path, resumed_at);
}

std::unique_ptr<StepObserver> progress_observer(int64_t start, int64_t end, int64_t total_steps) {
  return std::make_unique<ProgressObserver>(start, end, total_steps);
}

std::vector<std::unique_ptr<StepObserver>> make_observers(const Run& run, int64_t start,
                                                          std::optional<int64_t> resumed_at) {
  const RunConfig& c = run.config;
  std::vector<std::unique_ptr<StepObserver>> out;
  // A resumed run keeps checkpointing where it resumed from unless told otherwise.
  const std::string checkpoint_dir = !c.checkpoint.empty() ? c.checkpoint : c.resume;
  if (!checkpoint_dir.empty()) out.push_back(checkpoint_observer(checkpoint_dir, c.checkpoint_every));
  if (c.eval_rows > 0) out.push_back(eval_observer(c.eval_every));
  if (!c.save_weights.empty()) out.push_back(std::make_unique<SaveWeightsObserver>(c.save_weights));
  if (!c.metrics.empty()) out.push_back(metrics_observer(rank_file(c.metrics, run.rank()), resumed_at));
  if (!c.quiet && run.rank() == 0) out.push_back(progress_observer(start, c.end_step(), c.steps));
  return out;
}

}  // namespace headroom
