#include "estimate/step_replay.h"

#include <algorithm>
#include <deque>
#include <map>
#include <vector>

#include "estimate/cuda_workspace.h"
#include "estimate/reserved.h"
#include "memory/phase.h"

namespace headroom::replay {
namespace {

using sim::Category;
using sim::Param;
using sim::Ref;
using sim::Tensor;

// Bytes of an element of what the optimizer updates: the weights' dtype (bf16-params: float32).
int master_bytes(const TrainSpec& s) { return static_cast<int>(c10::elementSize(parameter_dtype(s.precision))); }

}  // namespace

StepReplay::StepReplay(const ModelConfig& c, const TrainSpec& s)
    : LayerReplay(c, s),
      dp_(mem_, s_, params_, order_, master_bytes(s), ew_),
      optimizer_(mem_, s_, params_, order_, dp_, master_bytes(s)) {
  if (s.cuda) {
    mem_.set_rounding(512, mem_.label("allocator rounding", Category::allocator,
                                      "the CUDA caching allocator rounds every block up to 512 bytes"));
  }
  // full: the weights are this rank's slices, all-gathered unit by unit as the layers use them.
  if (dp_.fully_sharded()) set_gate(&dp_);
}

Estimate StepReplay::run() {
  setup();
  // Optimizer state, made when the optimizer is constructed (before the first step).
  const std::vector<Ref> state = optimizer_.make_state(*shapes_);
  if (s_.cuda) reserve_cublas_workspace();
  // --shard full on several ranks, a model whole on each: before the first step, a one-row micro-batch
  // whose gradients are dropped (train/step.h's rehearse_collectives). Not part of the step; what it
  // leaves cached is.
  if (dp_.fully_sharded() && s_.world > 1 && s_.pipeline.stages == 1 && s_.tensor_parallel == 1) {
    micro_batch(1);
    zero_grad_phase();
  }
  step_begin_ = mem_.events().size();
  if (s_.pipeline.stages > 1) {
    pipeline_schedule();
  } else {
    micro_batch(s_.batch);
    if (s_.accum > 1) micro_batch(s_.batch);  // the second sees the first's gradients
  }
  const CategoryBytes at_update = optimizer_phase();
  zero_grad_phase();
  Estimate e = result(at_update, step_begin_);
  step_end_ = mem_.events().size();  // what run()'s own buffers release as it returns is not the step's
  return e;
}

void StepReplay::setup() {
  if (!s_.cuda && s_.dataset_bytes > 0) load_corpus();
  construct_model();
  dp_.prepare(*shapes_);
}

// As TextDataset loads it: the whole corpus, then its train and held-out parts cloned out of it
// (10% held out), then the whole freed. Live bytes end where they began; a caching allocator's
// blocks do not.
void StepReplay::load_corpus() {
  const int lbl = mem_.label("dataset", Category::other, "the corpus in host memory, its tokens' bytes");
  const int64_t n = s_.dataset_bytes, w = s_.dataset_width;
  const int64_t held_out = static_cast<int64_t>(static_cast<double>(n / w) * 0.1) * w;
  Ref all = mem_.allocate(n, lbl);
  dataset_ = mem_.allocate(n - held_out, lbl);
  dataset_eval_ = mem_.allocate(held_out, lbl);
}

// cuBLAS's workspace (estimate/cuda_workspace.h), made here, before the step, so that a replayed
// second step does not make another.
void StepReplay::reserve_cublas_workspace() {
  workspace_ = mem_.allocate(kCublasWorkspaceBytes,
                             mem_.label("cuBLAS workspace", Category::allocator, kCublasWorkspaceFormula));
}

void StepReplay::micro_batch(int64_t rows) {
  const int64_t t = s_.seq;
  const int batch_lbl = mem_.label("batch", Category::other, "token ids, B·(T+1) int64, and the targets' copy");
  const int loss_lbl = mem_.label("loss buffers", Category::loss,
                                  stage_.tensor.whole()
                                      ? "float32 log-softmax kept for backward, B·T·vocab × 4, and its gradient"
                                      : "float32 softmax of this rank's vocabulary rows kept for backward, "
                                        "B·T·vocab/T × 4, and its gradient");
  mem_.set_phase(Phase::data);
  dp_.start_micro_batch();
  Ref batch = mem_.allocate(rows * (t + 1) * 8, batch_lbl);
  backward_phase(forward_phase(rows, batch_lbl, loss_lbl));
}

void StepReplay::pipeline_schedule() {
  const int64_t rows = s_.batch, t = s_.seq;
  // What passes between stages, per micro-batch (sequence parallel: a share's part of the tokens).
  const int64_t activation = rows * t * c_.hidden_size / (stage_.tensor.splits_sequence() ? stage_.tensor.ranks : 1);
  const int64_t stages = s_.pipeline.stages, stage = s_.stage;
  const bool first = stage_.embeddings, last = stage_.head;
  const int batch_lbl = mem_.label("batch", Category::other, "token ids, B·(T+1) int64, and the targets' copy");
  const int loss_lbl = mem_.label("loss buffers", Category::loss,
                                  stage_.tensor.whole()
                                      ? "float32 log-softmax kept for backward, B·T·vocab × 4, and its gradient"
                                      : "float32 softmax of this rank's vocabulary rows kept for backward, "
                                        "B·T·vocab/T × 4, and its gradient");
  const int received = act("received activations", "--pipeline: the previous stage's output, B·T·hidden, per "
                                                    "micro-batch in flight");
  const int transit = mem_.label("pipeline transfers", Category::communication,
                                 "--pipeline: an output's gradient received, B·T·hidden, and the last tensor sent");
  // What the stage keeps of a micro-batch from its forward to its backward.
  struct InFlight {
    std::vector<sim::Graph::Node> nodes;
    Tensor input, output;
    Ref batch;
  };
  std::deque<InFlight> in_flight;
  Ref sent;  // held until the next send (dist/communicator.h)
  auto send = [&](Ref r) { sent = std::move(r); };
  // Past its warm-up the stage repeats one forward and one backward: two of them show the cycle whole
  // (the second with the gradients the first left), and the cool-down holds fewer micro-batches.
  const int64_t micro_batches = std::min(s_.accum, stages - stage + 1);
  for (const PipelineSlot& slot : one_f_one_b(stage, stages, micro_batches)) {
    if (slot.forward) {
      mem_.set_phase(Phase::data);
      InFlight f;
      Ref batch = mem_.allocate(rows * (t + 1) * 8, batch_lbl);
      mem_.set_phase(Phase::forward);
      if (!first) f.input = make(activation, ew_, received, true);
      if (last) {
        f.output = forward_phase(rows, batch_lbl, loss_lbl, &f.input);
      } else {
        std::map<const Param*, Tensor> cache;
        cache_ = &cache;
        f.output = trunk(rows, &f.input);
        cache_ = nullptr;
        send(f.output.buf);
      }
      // The embedding keeps the token ids, the loss the targets; a middle stage lets them go.
      if (first || last) f.batch = std::move(batch);
      f.nodes = g_->take_nodes();
      in_flight.push_back(std::move(f));
      continue;
    }
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    g_->restore_nodes(std::move(f.nodes));
    if (last) {
      dp_.start_micro_batch();
      backward_phase(std::move(f.output));
    } else {
      mem_.set_phase(Phase::backward);
      Ref grad = mem_.allocate(activation * ew_, transit);
      dp_.start_micro_batch();
      g_->backward(f.output, grad);
      dp_.after_backward();
      f.output = Tensor{};
    }
    // The input's gradient to the previous stage, alive until the next send.
    if (!first) {
      send(std::move(f.input.slot->grad));
      f.input = Tensor{};
    }
  }
  sent.reset();
  Ref loss_sum = mem_.allocate(8, tmp_);  // the last stage's loss, summed over the stages
}

Tensor StepReplay::forward_phase(int64_t rows, int batch_lbl, int loss_lbl, const Tensor* input) {
  const int64_t tokens = rows * s_.seq, vocab = stage_.tensor.vocab(c_.vocab_size).size;
  mem_.set_phase(Phase::forward);
  std::map<const Param*, Tensor> cache;
  cache_ = &cache;
  Tensor loss = s_.loss.chunked ? chunked_loss(trunk(rows, input), head(), tokens,
                                                chunk_tokens(s_.loss, tokens, vocab, c_.hidden_size), batch_lbl, loss_lbl)
                 : stage_.tensor.whole() ? token_loss(forward(rows, input), tokens, vocab, batch_lbl, loss_lbl)
                                         : parallel_token_loss(forward(rows, input), tokens, vocab, batch_lbl, loss_lbl);
  if (!aux_.empty()) {
    // The router's load-balancing loss (model/experts.h), from each sparse layer's statistics,
    // added to the loss.
    Tensor aux = make(1, 4, mem_.label("router load-balancing loss", Category::loss), true);
    std::vector<Tensor> parts;
    for (const Tensor& t : aux_) parts.push_back(meta(t));
    g_->record({&aux}, {}, [this, parts](const std::vector<Ref>&) {
      std::vector<sim::Emit> e;
      for (const Tensor& t : parts) e.push_back(grad_to(t));
      return e;
    });
    aux_.clear();
    aux_refs_.clear();
    loss = add(loss, aux, loss_lbl);
  }
  cache.clear();
  cache_ = nullptr;
  return loss;
}

void StepReplay::backward_phase(Tensor loss) {
  mem_.set_phase(Phase::backward);
  Tensor root = scale(loss, tmp_);
  if (s_.precision == Precision::fp16_mixed) root = scale(root, tmp_);
  loss = Tensor{};
  g_->backward(root);
  root = Tensor{};
  dp_.after_backward();
}

StepReplay::CategoryBytes StepReplay::optimizer_phase() {
  mem_.set_phase(Phase::optimizer);
  CategoryBytes at_update{};
  for (size_t i = 0; i < mem_.labels().size(); ++i) {
    at_update[static_cast<size_t>(mem_.labels()[i].category)] += mem_.live_under(static_cast<int>(i));
  }
  dp_.before_update();
  optimizer_.update_temporaries();
  dp_.after_update();
  return at_update;
}

void StepReplay::zero_grad_phase() {
  mem_.set_phase(Phase::zero_grad);
  for (auto& [name, prm] : params_)
    if (prm.t.slot) prm.t.slot->grad.reset();
  dp_.zero_grad();
}

Estimate StepReplay::result(const CategoryBytes& at_update, size_t step_begin) const {
  Estimate e;
  e.cuda = s_.cuda;
  e.model = c_.name;
  e.params = shapes_->num_parameters();
  e.trainable_params = shapes_->num_trainable_parameters();
  const auto& peak = mem_.peak();
  e.peak_bytes = peak.bytes;
  e.peak_phase = peak.phase;
  e.phase_peaks = mem_.phase_peaks();
  e.at_update = at_update;
  const auto& labels = mem_.labels();
  for (size_t i = 0; i < labels.size(); ++i) {
    const int64_t bytes = i < peak.by_label.size() ? peak.by_label[i] : 0;
    e.breakdown[static_cast<size_t>(labels[i].category)] += bytes;
    if (bytes > 0) e.items.push_back({labels[i].name, labels[i].category, bytes, labels[i].formula});
  }
  const auto& host = mem_.host_peak();
  e.host_bytes = host.bytes;
  for (size_t i = 0; i < host.by_label.size(); ++i) {
    if (host.by_label[i] > 0) e.host_items.push_back({labels[i].name, labels[i].category, host.by_label[i], labels[i].formula});
  }
  std::stable_sort(e.host_items.begin(), e.host_items.end(),
                   [](const EstimateItem& a, const EstimateItem& b) { return a.bytes > b.bytes; });
  if (c_.moe) {
    Estimate::Experts x;
    x.experts = c_.moe->experts;
    x.top_k = c_.moe->top_k;
    for (int64_t i = 0; i < c_.num_layers; ++i) x.sparse_layers += c_.sparse(i) ? 1 : 0;
    x.routing = s_.routing.name();
    x.world = s_.world;
    for (const EstimateItem& item : e.items) {
      if (item.name == "expert weights") x.weights = item.bytes;
      if (item.name == "expert gradients") x.gradients = item.bytes;
      if (item.name == "expert optimizer state") x.optimizer = item.bytes;
    }
    e.experts = x;
  }
  std::stable_sort(e.items.begin(), e.items.end(),
                   [](const EstimateItem& a, const EstimateItem& b) { return a.bytes > b.bytes; });
  if (s_.caching && !s_.skips_reserved(e.peak_bytes)) e.reserved = replay_reserved(mem_.events(), step_begin, kReservedSteps, *s_.caching, s_.budget);
  return e;
}

}  // namespace headroom::replay
