// Run — everything one training run holds, built by make_run() from a RunConfig: the device, the
// model and its optimizer, the data, fp16's loss scaler, the memory probe and monitor, the learning
// rate schedule. The trainer, the static-graph trial, fit's trials, the doctor's trials and the
// benchmarks all start from it, so they train the same thing the same way.
//
// Building a Run sets process-wide state (on cpu the BudgetAllocator is installed, counting or, with
// --allocator caching, serving from a fresh caching heap whose cache goes back when the Run ends; the budget;
// on cuda allocation history when a snapshot or leak origins are asked for); destroying it undoes
// them. Not thread-safe; one Run at a time per process. Not movable: the monitor refers into it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "config/model_config.h"
#include "config/run_config.h"
#include "data/text_dataset.h"
#include "dist/communicator.h"
#include "dist/data_parallel.h"
#include "dist/pipeline.h"
#include "dist/tensor_parallel_group.h"
#include "memory/memory_monitor.h"
#include "memory/memory_probe.h"
#include "memory/oom_report.h"
#include "model/causal_lm.h"
#include "optim/optimizer.h"
#include "train/lr_schedule.h"
#include "train/precision.h"

namespace headroom {

struct Run {
  Run(const RunConfig& config, const c10::Device& device);
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  RunConfig config;
  c10::Device device;
  std::unique_ptr<MemoryProbe> probe;  // first: on cpu it installs the counting allocator
  // Under torchrun with more than one rank: the job's collectives, and what the step does with them.
  std::unique_ptr<Communicator> comm;
  // --precision bf16-params on one process (or one data-parallel rank of a stage or share): FSDP2's
  // policy through a group of one (the replicas' communicator then).
  std::unique_ptr<Communicator> alone;
  ModelConfig model_config;
  std::optional<TextDataset> data;
  std::unique_ptr<CausalLM> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<DataParallel> replicas;  // with comm; before the model in destruction (its hooks)
  // --pipeline P: this rank's stage; with more ranks than stages, `replicas` works over the ranks that
  // hold the same stage. Rank r holds stage r / D as data-parallel rank r % D of D = ranks / P.
  std::unique_ptr<Communicator> pipeline_comm, data_comm;
  std::unique_ptr<Pipeline> pipeline;
  // --tensor-parallel T: the T ranks that split each layer with this one (ranks t·1 .. neighbours:
  // rank r holds share r % T, as data-parallel rank r / T of D = ranks / T); `data_comm` then holds
  // the ranks of its share.
  std::unique_ptr<Communicator> tensor_comm;
  std::unique_ptr<TensorParallelGroup> tensor;
  std::optional<LossScaler> scaler;  // fp16-mixed
  std::unique_ptr<MemoryMonitor> monitor;
  LrSchedule schedule;
  ForwardOptions forward;  // the training forward: attention path, dropout on, checkpointing

  // --inject-leak: what the planted leak keeps alive.
  std::vector<at::Tensor> leaked_outputs;
  at::Tensor leaked_loss;
  // A mixture of experts: this step's routing skew so far (model/experts.h), reset as it is recorded.
  double routing_skew = 0;

  const std::vector<NamedTensor>& parameters() const { return model->parameters(); }
  // The model is split over ranks (pipeline stages, tensor parallel): an out-of-memory on one rank
  // ends it, the others stopping when they lose contact with it.
  bool model_parallel() const { return pipeline || tensor; }
  // The flags that split the model over the ranks ("--pipeline 2 --pipeline-split 0:12,12:24",
  // "--tensor-parallel 2"); "" when nothing does.
  std::string layout() const;
  int rank() const { return comm ? comm->rank() : 0; }
  int ranks() const { return comm ? comm->size() : 1; }
  // The shard level the step runs at: --shard's, or full for bf16-params (FSDP2's policy, alone too).
  ShardLevel shard() const { return replicas ? replicas->level() : config.shard; }
  // The data-parallel ranks, which split the global batch's rows (a pipeline's stages do not).
  int data_rank() const { return replicas ? replicas->comm().rank() : 0; }
  int data_ranks() const { return replicas ? replicas->comm().size() : 1; }
  // cuda with RunConfig::leak_origins: allocations are tagged with their step and phase.
  bool records_origins() const { return origins_; }
  // --offload optimizer: host memory at its peak since the probe's last reset (cpu: the host pool),
  // else what the optimizer's host tensors hold (cuda: pinned memory the probe does not see).
  int64_t host_bytes() const;

 private:
  bool history_ = false, origins_ = false;  // cuda recording this run switched on
};

// A run, or why it could not be built: an out-of-memory while allocating the weights and the
// optimizer state (OomReport::during_setup). Throws Error for bad input (the config, the model,
// the data, a device that is not there).
struct MadeRun {
  std::unique_ptr<Run> run;
  std::optional<OomReport> oom;
};
MadeRun make_run(const RunConfig& config);

}  // namespace headroom
