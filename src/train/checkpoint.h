// Checkpoints — a training run's full state in one file, written atomically.
//
// DIR/checkpoint.hrc holds the model's parameters, the optimizer's state tensors and a JSON footer
// (format version, step, seed, schedule length, optimizer, the model config, and per tensor its
// name, dtype, shape, offset and a 64-bit checksum), itself checksummed. Saving writes it atomically
// (util/atomic_file.h), so a crash mid-save leaves the previous checkpoint intact. Loading refuses a
// truncated file, a foreign file, a checksum mismatch (tensors or footer) and a checkpoint of
// another model, each with an Error that says which. Format-1 checkpoints (older headroom: no
// footer checksum, no optimizer name) are still read. The RNG needs no saved state: dropout is seeded from
// (seed, step) at every step, so (seed, step) is the RNG state.
//
// A data-parallel run with sharded state (--shard optimizer|gradients|full) writes one file per rank,
// DIR/rank-R-of-N.hrc, in the same format (the full weights — at full that rank's 1-D slice of each —
// and that rank's slices of the optimizer state), then — after every rank has written its own — rank 0 writes
// DIR/manifest.json naming the world size, the shard level and the step, atomically: a set of files is a checkpoint
// once the manifest says so. The same world size and shard level load their own files; any other layout is re-sharded
// by the trainer from read_checkpoint_tensors(). An unsharded data-parallel run writes DIR/checkpoint.hrc from rank 0
// alone.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "util/named_tensor.h"

namespace headroom {

struct CheckpointInfo {
  int64_t step = 0;  // optimizer steps completed
  uint64_t seed = 0;
  int64_t total_steps = 0;  // the schedule's length when saved
  std::string optimizer;    // its name: adam and adamw hold the same tensors, so the name tells them
                            // apart ("" in a format-1 checkpoint, which did not record it)
  nlohmann::json model;     // the model config.json (with overrides) it was trained with
};

// One rank's file of a sharded checkpoint.
struct CheckpointShard {
  int rank = 0, ranks = 1;
};

// The checkpoint file inside a checkpoint directory (a rank's, for a sharded one).
std::string checkpoint_file(const std::string& dir, std::optional<CheckpointShard> shard = std::nullopt);

// DIR/manifest.json of a sharded checkpoint.
struct ShardManifest {
  int ranks = 0;
  std::string shard;  // the --shard level
  int64_t step = 0;
  // Split over ranks (Run::layout): the flags of the layout that saved it, which alone can resume it;
  // "" for data parallel alone.
  std::string layout;
};
void write_shard_manifest(const std::string& dir, const ShardManifest& manifest);
// nullopt when DIR has none; throws Error when it is unreadable.
std::optional<ShardManifest> read_shard_manifest(const std::string& dir);

// Creates `dir` when missing and checks that a checkpoint can be written into it; throws Error
// naming `flag` (--checkpoint, or --resume when the run writes where it resumed from) and the
// reason (a file in the way, no permission). Run before training, so that a bad path is found
// before the work, not after it.
void check_checkpoint_dir(const std::string& dir, const std::string& flag = "--checkpoint");

void save_checkpoint(const std::string& dir, const CheckpointInfo& info, const std::vector<NamedTensor>& model,
                     const std::vector<NamedTensor>& optimizer, std::optional<CheckpointShard> shard = std::nullopt);

// Every tensor of DIR's checkpoint file (a rank's, for a sharded one), read and verified as
// load_checkpoint does: what re-sharding to another world size starts from.
struct CheckpointTensors {
  CheckpointInfo info;
  std::vector<NamedTensor> model, optimizer;
};
CheckpointTensors read_checkpoint_tensors(const std::string& dir, std::optional<CheckpointShard> shard = std::nullopt);

// Reads DIR's checkpoint and copies its tensors into `model` and `optimizer`, which must have the
// same names and shapes (i.e. the same architecture and optimizer).
CheckpointInfo load_checkpoint(const std::string& dir, const std::vector<NamedTensor>& model,
                               const std::vector<NamedTensor>& optimizer,
                               std::optional<CheckpointShard> shard = std::nullopt);

}  // namespace headroom
