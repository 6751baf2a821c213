#include "train/run.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <filesystem>

#include "config/lever_support.h"
#include "data/token_file.h"
#include "estimate/pipeline_cut.h"
#include "device/cuda_adapter.h"
#include "device/device.h"
#include "memory/allocator_config.h"
#include "memory/budget_allocator.h"
#include "model/hf_weights.h"
#include "model/peft_adapter.h"
#include "optim/offload.h"
#include "util/error.h"
#include "util/files.h"
#include "util/size.h"
#include "util/tensor_bytes.h"

namespace headroom {
namespace {
// Allocator events a cpu snapshot keeps (the latest), as PyTorch's record_memory_history keeps 100,000.
constexpr size_t kHistoryEntries = 100'000;
}  // namespace

Run::Run(const RunConfig& cfg, const c10::Device& dev)
    : config(cfg),
      device(dev),
      probe(make_memory_probe(dev, cfg.allocator == AllocatorKind::caching,
                              cfg.allocator_conf.empty() && !dev.is_cuda() ? allocator_config_from_environment()
                                                                           : cfg.allocator_conf)),
      forward{cfg.attention, /*training=*/true, cfg.checkpointing} {
  history_ = !cfg.memory_snapshot.empty();
  // The snapshot's recorder would replace the origin tagger: one or the other.
  origins_ = cfg.leak_origins && dev.is_cuda() && !history_;
  if (history_ && dev.is_cuda()) cuda_record_memory_history(true);
  if (history_ && !dev.is_cuda()) BudgetAllocator::install().record_history(kHistoryEntries);
  if (origins_) probe->record_origins(true);
}

Run::~Run() {
  try {
    probe->set_budget(std::nullopt);
    probe->set_context(-1, Phase::idle);  // a step an exception left open is not this process's any more
    if (history_ && device.is_cuda()) cuda_record_memory_history(false);
    if (history_ && !device.is_cuda()) BudgetAllocator::install().record_history(0);
    if (origins_) probe->record_origins(false);
  } catch (...) {  // nothing here may throw out of a destructor
  }
}

int64_t Run::host_bytes() const {
  if (const auto pool = probe->host_peak_bytes()) return *pool;
  std::vector<at::Tensor> host = optimizer->host_copies();
  for (const NamedTensor& s : optimizer->state()) host.push_back(s.tensor);
  for (const at::Tensor& t : optimizer->working_memory()) host.push_back(t);
  return storage_bytes(host);
}

namespace {

// Where the run goes: the device asked for, or under torchrun this rank's own card (LOCAL_RANK),
// made the current one.
struct Placement {
  c10::Device device;
  std::optional<WorldEnv> world;  // launched by torchrun
};

Placement place_run(const RunConfig& cfg) {
  c10::Device device = resolve_device(cfg.device);
  // Under torchrun: this rank's place in the job, and on cuda its own card (LOCAL_RANK).
  const std::optional<WorldEnv> world = world_from_environment();
  // Launched by torchrun, even as its only rank: the collectives then run through the backend too
  // (a one-rank NCCL smoke test on a single GPU).
  const bool distributed = world.has_value();
  if (cfg.world_size > 0 && cfg.world_size != (world ? world->world_size : 1)) {
    fail("--world-size {}: this process is one of {} (WORLD_SIZE); launch {} ranks with torchrun --nproc-per-node {} "
         "(or --nnodes), or drop --world-size",
         cfg.world_size, world ? world->world_size : 1, cfg.world_size, cfg.world_size);
  }
  if (distributed && device.is_cuda()) {
    if (world->local_rank >= cuda_device_count()) {
      fail("LOCAL_RANK {} has no CUDA device (this machine has {}); launch at most that many ranks per node "
           "(torchrun --nproc-per-node)",
           world->local_rank, cuda_device_count());
    }
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(world->local_rank));
    cuda_set_device(world->local_rank);
  }
  return {device, world};
}

// The allocator and fault-injection options this device can honour.
void check_allocator_options(const RunConfig& cfg, const c10::Device& device) {
  if (cfg.allocator == AllocatorKind::caching && !device.is_cuda() && cfg.allocator_conf.empty()) {
    parse_allocator_config(allocator_config_from_environment(), "PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF");
  }
  if (!cfg.memory_snapshot.empty() && !device.is_cuda() && cfg.allocator != AllocatorKind::caching) {
    fail(
        "--memory-snapshot needs a caching allocator: --device cuda, or --allocator caching on cpu (the counting "
        "allocator has no segments; its metrics JSONL has the per-phase memory)");
  }
  if (cfg.inject_oom && device.is_cuda())
    fail("--inject-oom works on --device cpu only (it uses the budget allocator)");
}

// The model's config, checked against --seq, then the data: token ids within its vocabulary, or
// bytes, which need a vocabulary of 256 or more.
void load_model_config_and_data(Run& run, const RunConfig& cfg) {
  run.model_config = load_model_config(cfg.model, cfg.overrides);
  const ModelConfig& mc = run.model_config;
  if (cfg.seq > mc.max_positions) {
    fail("--seq {} exceeds {}'s max_position_embeddings {}", cfg.seq, mc.name, mc.max_positions);
  }
  if (!cfg.data_tokens.empty()) {
    const TokenFileInfo info = inspect_token_file(cfg.data_tokens);
    if (info.vocab_size > mc.vocab_size) {
      fail("--data-tokens '{}': tokenised for a vocabulary of {}, and {} has {}; accepted: ids made by this model's "
           "tokenizer",
           info.path, info.vocab_size, mc.name, mc.vocab_size);
    }
    const TokenIds ids = read_token_ids(info);
    if (ids.max_id >= mc.vocab_size) {
      fail("--data-tokens '{}': id {} at position {} is outside {}'s vocabulary of {}; accepted: ids made by this "
           "model's tokenizer",
           info.path, ids.max_id, ids.max_at, mc.name, mc.vocab_size);
    }
    run.data.emplace(ids.raw, info.width, info.path, 0.1, cfg.seq);
    return;
  }
  if (mc.vocab_size < kByteVocabulary) {
    fail("{}: vocab_size {} is smaller than the byte tokenizer's {}; set --set vocab_size=256 or more", mc.name,
         mc.vocab_size, kByteVocabulary);
  }
  run.data.emplace(TextDataset::load(cfg.data, 0.1, cfg.seq));
}

// --pipeline P and --tensor-parallel T: what the layout cannot do, refused before any group is made.
void check_layout(const Run& run, const RunConfig& cfg) {
  const int p = static_cast<int>(cfg.pipeline.stages), t = static_cast<int>(cfg.tensor_parallel);
  const std::string lever = p > 1 && t > 1 ? fmt::format("--pipeline {} x --tensor-parallel {}", p, t)
                            : p > 1       ? fmt::format("--pipeline {}", p)
                                          : fmt::format("--tensor-parallel {}", t);
  if (!run.comm || run.ranks() % (p * t) != 0) {
    fail("{} needs a multiple of {} ranks ({}data-parallel ranks), and this process is one of {}; accepted: torchrun "
         "--nproc-per-node {} (or a multiple)",
         lever, p * t, p > 1 && t > 1 ? "stages x tensor-parallel ranks x " : p > 1 ? "stages x " : "tensor-parallel ranks x ",
         run.ranks(), p * t);
  }
  if (run.ranks() == p * t && cfg.shard != ShardLevel::none) {
    fail("--shard {} with {} on {} ranks: the shard levels split state over the data-parallel ranks of a {}, and "
         "there is one; accepted: --shard none, or more ranks",
         shard_level_name(cfg.shard), lever, run.ranks(), p > 1 ? "stage" : "share");
  }
  if (t == 1) return;
  check_tensor_parallel(run.model_config, t);
  if (cfg.loss.chunked) {
    fail("--loss chunked with --tensor-parallel: not supported yet (the split vocabulary already keeps a rank's "
         "logits to 1/{} of them); accepted: --loss full",
         t);
  }
  if (cfg.optimizer == OptimizerKind::adafactor || cfg.optimizer == OptimizerKind::adamw8bit) {
    fail("--optimizer {} with --tensor-parallel: not supported yet (its statistics span whole matrices or blocks "
         "that the shares cut); accepted: sgd, momentum, adam, adamw, adagrad",
         optimizer_name(cfg.optimizer));
  }
}

// The layers of each stage: --pipeline-split, or the cut balancing the estimator's peaks of the
// stages (estimate/pipeline_cut.h), which `headroom estimate` replays too. Every rank cuts alike.
std::vector<LayerRange> pipeline_cut(const ModelConfig& model, const RunConfig& cfg, int rank) {
  if (!cfg.pipeline.split.empty()) return pipeline_stages(model, cfg.pipeline);
  std::vector<LayerRange> cut;
  std::string why;
  try {
    cut = memory_balanced_cut(model, train_spec(cfg));
    why = "balanced by each stage's estimated peak";
  } catch (const Error& e) {
    cut = pipeline_stages(model, cfg.pipeline);
    why = fmt::format("balanced by parameters, as the estimator cannot replay this run ({})", e.what());
  }
  if (!cfg.quiet && rank == 0) {
    fmt::print(stderr, "headroom train: --pipeline {}: layers cut --pipeline-split {}, {}\n", cfg.pipeline.stages,
               pipeline_split_text(cut), why);
  }
  return cut;
}

// The ranks as P stages x D data-parallel ranks x T tensor-parallel shares, the shares innermost:
// rank r holds share r % T of stage r / (D·T), as data-parallel rank (r / T) % D. A share's T ranks
// are neighbours, inside a node, as their per-block sums want them; then a stage's data-parallel
// ranks, whose transfers are the next largest. Its groups: the T ranks of its stage and data index
// (tensor parallel), the D ranks of its stage and share (data parallel), the P ranks of its data
// index and share (the pipeline).
void place_ranks(Run& run, const RunConfig& cfg) {
  check_layout(run, cfg);
  const int p = static_cast<int>(cfg.pipeline.stages), t = static_cast<int>(cfg.tensor_parallel);
  const int d = run.ranks() / (p * t), r = run.rank();
  const int share = r % t, index = (r / t) % d, stage = r / (t * d);
  auto rank_of = [t, d](int s, int k, int u) { return (s * d + k) * t + u; };
  auto group = [&run](const std::vector<int>& ranks, const std::string& name) {
    return std::make_unique<Communicator>(*run.comm, ranks, name);
  };
  std::vector<int> tensor_ranks, data_ranks, pipeline_ranks;
  for (int u = 0; u < t; ++u) tensor_ranks.push_back(rank_of(stage, index, u));
  for (int k = 0; k < d; ++k) data_ranks.push_back(rank_of(stage, k, share));
  for (int s = 0; s < p; ++s) pipeline_ranks.push_back(rank_of(s, index, share));
  if (t > 1) {
    run.tensor_comm = group(tensor_ranks, fmt::format("tensor_{}_{}", stage, index));
    run.tensor = std::make_unique<TensorParallelGroup>(*run.tensor_comm, cfg.sequence_parallel);
    if (const std::string note = kv_replication_note(run.model_config, t); !note.empty() && !cfg.quiet && r == 0) {
      fmt::print(stderr, "headroom train: --tensor-parallel {}: {}\n", t, note);
    }
  }
  if (d > 1) run.data_comm = group(data_ranks, fmt::format("data_{}_{}", stage, share));
  if (p > 1) {
    Communicator* stages = run.comm.get();
    if (d * t > 1) {
      run.pipeline_comm = group(pipeline_ranks, fmt::format("pipeline_{}_{}", index, share));
      stages = run.pipeline_comm.get();
    }
    run.pipeline =
        std::make_unique<Pipeline>(*stages, pipeline_cut(run.model_config, cfg, r), run.model_config.tie_word_embeddings);
  }
}

// --weights and --save-weights: what this run can honour, checked before anything trains.
void check_weights_options(const RunConfig& cfg, const Run& run) {
  const bool sliced = run.comm && cfg.shard == ShardLevel::full;
  if (sliced && !cfg.weights.empty()) {
    fail("--weights with --shard full: not supported yet (each rank would need the whole checkpoint while it "
         "slices); accepted: --shard gradients or optimizer");
  }
  if (run.model_parallel() && !cfg.save_weights.empty()) {
    // --weights is: each rank reads its stage's tensors and cuts its share.
    const char* lever = run.pipeline ? "--pipeline" : "--tensor-parallel";
    fail("--save-weights with {}: not supported yet (no rank holds the whole model); accepted: --checkpoint (each "
         "rank's part), or {} 1",
         lever, lever);
  }
  if (run.pipeline) {
    if (run.model_config.moe && run.model_config.moe->aux_loss) {
      fail("--pipeline with output_router_logits (a load-balancing loss over every layer): not supported yet; "
           "accepted: --set output_router_logits=false");
    }
  }
  if (run.comm && !cfg.finetune.full()) {
    fail("--finetune {} under torchrun: not supported yet (data parallel reduces every parameter's gradient); "
         "accepted: --finetune full with ranks, or one process",
         cfg.finetune.name());
  }
  if (sliced && !cfg.save_weights.empty()) {
    fail("--save-weights with --shard full: not supported yet; accepted: --shard gradients or optimizer, or "
         "--checkpoint (which saves the slices)");
  }
  if (cfg.save_weights.empty()) return;
  if (!cfg.finetune.is_lora() || cfg.merge_lora) check_hf_savable(run.model_config);
  namespace fs = std::filesystem;
  const fs::path out = fs::absolute(cfg.save_weights).lexically_normal();
  if (!cfg.weights.empty() && out == fs::absolute(cfg.weights).lexically_normal()) {
    fail("--save-weights '{}' is the --weights directory; accepted: another directory (the base checkpoint is kept)",
         cfg.save_weights);
  }
  if (fs::exists(out) && !fs::is_directory(out)) {
    fail("--save-weights '{}': exists and is not a directory", cfg.save_weights);
  }
  const fs::path parent = out.parent_path();
  if (!fs::exists(out) && !fs::is_directory(parent)) {
    fail("--save-weights '{}': its parent '{}' is not a directory", cfg.save_weights, parent.string());
  }
}

// Weights that cannot fit the device at all are refused before a byte is allocated (an allocation
// that large would fail late, or push the machine into swap).
void refuse_weights_beyond_device(const ModelConfig& mc, c10::ScalarType dtype, const c10::Device& device) {
  const int64_t weight_bytes = count_parameters(mc) * static_cast<int64_t>(c10::elementSize(dtype));
  if (const auto available = device_memory_available(device); available && weight_bytes > *available) {
    throw DoesNotFit(fmt::format(
        "{}'s weights alone need {} ({} parameters in {}), and {} has {} available; accepted: a smaller model, "
        "--precision bf16 (2 bytes per weight), or a larger machine",
        mc.name, format_bytes(weight_bytes), count_parameters(mc), c10::toString(dtype), device.str(),
        format_bytes(*available)));
  }
}

// The ranks this one trains with data parallel: every rank, or those of its pipeline stage or
// tensor-parallel share when there are several (null: none).
Communicator* data_parallel_ranks(const Run& run) {
  return run.model_parallel() ? run.data_comm.get() : run.comm.get();
}

// The model's weights; under --shard full (and bf16-params, alone too, unless a checkpoint fills the
// model whole first) the rank's slices of them, which it keeps as the model is built, so that no
// more than one parameter is ever whole (returned; empty otherwise).
std::vector<at::Tensor> build_model(Run& run, const RunConfig& cfg, c10::ScalarType dtype) {
  std::vector<at::Tensor> slices;
  CausalLM::KeepParameter keep;
  const Communicator* data = data_parallel_ranks(run);
  const bool sliced = (data && cfg.shard == ShardLevel::full) ||
                      (cfg.precision == Precision::bf16_params && cfg.weights.empty() && cfg.adapter.empty());
  if (sliced) {
    keep = [&slices, rank = data ? data->rank() : 0, ranks = data ? data->size() : 1](const NamedTensor& p) {
      slices.push_back(DataParallel::weight_slice(p.tensor, rank, ranks));
    };
  }
  // Weights a checkpoint will fill are not drawn first.
  ModelStage stage = run.pipeline ? run.pipeline->model_stage() : ModelStage{};
  if (run.tensor) stage.tensor = run.tensor->slice();
  run.model = std::make_unique<CausalLM>(run.model_config, at::TensorOptions().dtype(dtype).device(run.device),
                                         cfg.seed, keep, cfg.finetune, cfg.weights.empty(), cfg.base_weights, stage);
  if (!cfg.weights.empty()) load_hf_weights(cfg.weights, *run.model);
  if (!cfg.adapter.empty()) load_peft_adapter(cfg.adapter, *run.model);
  return slices;
}

// With ranks, what the step shares with them (taking the weight slices); then the optimizer, over
// this rank's parameters. bf16-params is FSDP2's policy: fully sharded over the data-parallel ranks,
// or over a group of one.
void build_optimizer(Run& run, const RunConfig& cfg, std::vector<at::Tensor> slices) {
  OptimizerOptions options;
  options.weight_decay = cfg.weight_decay_value();
  Communicator* data = data_parallel_ranks(run);
  const bool fsdp = cfg.precision == Precision::bf16_params;
  if (!data && fsdp) {
    run.alone = std::make_unique<Communicator>(run.device);
    data = run.alone.get();
  }
  if (data) {
    FullSharding full;
    if (fsdp) full.compute = compute_dtype(cfg.precision);
    full.reshard_after_forward = cfg.reshard_after_forward;
    run.replicas = std::make_unique<DataParallel>(*data, run.model->parameters(), fsdp ? ShardLevel::full : cfg.shard,
                                                  run.model->parameter_units(), std::move(slices), full);
    DataParallel* replicas = run.replicas.get();
    run.forward.gate = replicas->gate();
    options.sharding = replicas->optimizer_sharding();
    replicas->tag_allocations_with([probe = run.probe.get()](AllocationTag tag) { probe->set_tag(tag); });
  }
  // Frozen parameters have no optimizer state.
  const std::vector<NamedTensor> trained =
      run.replicas ? run.replicas->optimizer_parameters() : run.model->trainable_parameters();
  if (offloads_activations(cfg.offload)) {
    run.forward.offload = std::make_shared<ActivationOffload>(run.model->parameter_tensors());
  }
  run.optimizer = offloads_optimizer(cfg.offload) ? make_offloaded_optimizer(cfg.optimizer, trained, options)
                                                    : make_optimizer(cfg.optimizer, trained, options);
}

// An out-of-memory while allocating the weights or the optimizer state, as the report says it.
OomReport setup_oom_report(const Run& run, const c10::OutOfMemoryError& e, c10::ScalarType dtype) {
  OomReport r;
  r.during_setup = true;
  r.message = first_line(e.what_without_backtrace());
  r.budget = run.probe->budget().value_or(-1);
  const auto event = run.probe->last_oom();
  r.in_use = event ? event->live : run.probe->live_bytes();
  r.requested = event ? event->requested : -1;
  r.breakdown.weights = count_parameters(run.model_config) * static_cast<int64_t>(c10::elementSize(dtype));
  return r;
}

// The weights and the optimizer state, under the budget; an out-of-memory is reported, with what
// had been built released.
std::optional<OomReport> build_model_and_optimizer(Run& run, const RunConfig& cfg, c10::ScalarType dtype) {
  try {
    build_optimizer(run, cfg, build_model(run, cfg, dtype));
  } catch (const c10::OutOfMemoryError& e) {
    OomReport r = setup_oom_report(run, e, dtype);
    run.optimizer.reset();
    run.replicas.reset();
    run.model.reset();
    return r;
  }
  return std::nullopt;
}

// What the monitor's breakdown names: the weights, the gradients, the optimizer state.
TrackedTensors tracked_tensors(Run* r) {
  return TrackedTensors{[r] {
                          std::vector<at::Tensor> weights = r->model->parameter_tensors();
                          if (r->replicas)
                            for (const auto& t : r->replicas->weight_slices()) weights.push_back(t);
                          return weights;
                        },
                        [r] {
                          std::vector<at::Tensor> grads;
                          for (const auto& p : r->parameters()) grads.push_back(p.tensor.grad());
                          if (r->replicas)
                            for (const auto& t : r->replicas->gradient_buffers()) grads.push_back(t);
                          return grads;
                        },
                        [r] {
                          std::vector<at::Tensor> state;
                          if (r->optimizer->offloaded()) return state;  // host memory: not the device's
                          for (const auto& s : r->optimizer->state()) state.push_back(s.tensor);
                          for (const auto& t : r->optimizer->working_memory()) state.push_back(t);
                          return state;
                        }};
}

}  // namespace

std::string Run::layout() const {
  std::string out;
  if (pipeline) {
    out = fmt::format("--pipeline {} --pipeline-split {}", pipeline->stages(), pipeline_split_text(pipeline->ranges()));
  }
  if (tensor) out += fmt::format("{}--tensor-parallel {}", out.empty() ? "" : " ", tensor->ranks());
  return out;
}

MadeRun make_run(const RunConfig& cfg) {
  validate(cfg);
  const Placement placement = place_run(cfg);
  const c10::Device& device = placement.device;
  check_allocator_options(cfg, device);

  if (!device.is_cuda()) at::set_num_threads(cpu_threads_for_run(cfg.threads));
  auto run = std::make_unique<Run>(cfg, device);
  if (placement.world) {
    run->comm = std::make_unique<Communicator>(*placement.world, device, std::chrono::seconds(cfg.dist_timeout));
  }
  load_model_config_and_data(*run, cfg);
  if (cfg.pipeline.stages > 1 || cfg.tensor_parallel > 1) place_ranks(*run, cfg);
  const Communicator* data = data_parallel_ranks(*run);
  check_lever_support(cfg, run->model_config, data ? data->size() : 1);
  check_weights_options(cfg, *run);

  const c10::ScalarType dtype = parameter_dtype(cfg.precision);
  refuse_weights_beyond_device(run->model_config, dtype, device);
  // The budget applies from here: the model and optimizer state must fit in it too.
  run->probe->set_budget(cfg.memory_budget);
  if (std::optional<OomReport> oom = build_model_and_optimizer(*run, cfg, dtype)) return {nullptr, std::move(*oom)};
  if (cfg.precision == Precision::fp16_mixed) run->scaler.emplace(device);
  run->schedule = LrSchedule{cfg.lr, cfg.min_lr_ratio, cfg.warmup_steps(), cfg.steps};
  run->monitor = std::make_unique<MemoryMonitor>(*run->probe, tracked_tensors(run.get()));
  return {std::move(run), std::nullopt};
}

}  // namespace headroom
