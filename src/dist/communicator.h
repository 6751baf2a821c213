// Communicator — the collectives headroom's data-parallel training needs, over PyTorch's own
// distributed engine (c10d: Gloo on cpu, NCCL on cuda). dist/communicator.cpp is the only file that
// includes the process-group headers.
//
// A process learns its place from the environment torchrun (or a hand launch) gives it: RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and TORCHELASTIC_USE_AGENT_STORE (torchrun's
// agent already hosts the TCPStore, so every rank is a client; by hand, rank 0 hosts it). Gloo binds
// to GLOO_SOCKET_IFNAME when set (several nodes), else to this host's address; NCCL reads its own
// NCCL_* variables. Without RANK and WORLD_SIZE a process is alone and nothing here is used.
//
// Every collective blocks until it completes. A peer that died or stopped answering surfaces as an
// Error ("rank R: lost contact with the other ranks during <op> ...") within the timeout, never a
// hang. Not thread-safe; one per process.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace headroom {

// This process's place in the job, from the environment.
struct WorldEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool agent_store = false;  // torchrun's agent hosts the store: connect as a client
  int restart_count = 0;     // torchrun's TORCHELASTIC_RESTART_COUNT: keys of a restarted job are fresh
};

// The job this process belongs to; nullopt when RANK and WORLD_SIZE are not set (a lone process).
// Throws Error naming the variable when one is malformed or inconsistent (RANK >= WORLD_SIZE, a
// missing MASTER_PORT with WORLD_SIZE > 1, ...).
std::optional<WorldEnv> world_from_environment();

enum class ReduceOp { sum, max };

class Communicator {
 public:
  // Joins the job: the store, then the backend for `device` (Gloo for cpu; NCCL for cuda, whose
  // device must be cuda:LOCAL_RANK). `timeout` bounds the rendezvous and every collective.
  Communicator(const WorldEnv& env, const c10::Device& device, std::chrono::milliseconds timeout);
  // A process alone (no torchrun), as a group of one: each collective is what it would be on one rank
  // — a copy (allgather, reduce_scatter) or nothing — and needs no backend. FSDP2's policy on one
  // process (--precision bf16-params) runs through it.
  explicit Communicator(const c10::Device& device);
  // A group of some of `parent`'s ranks, with collectives of its own: `members` are parent ranks, in
  // their order in the new group, this process's among them. Every member makes it with the same
  // `name` (unique in the job) at the same point; ranks outside it do nothing.
  Communicator(const Communicator& parent, const std::vector<int>& members, const std::string& name);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Where its tensors live (cpu for Gloo, this rank's card for NCCL).
  c10::Device device() const;

  // In place, every rank ends with the same result.
  void allreduce(at::Tensor& tensor, ReduceOp op = ReduceOp::sum);
  void broadcast(at::Tensor& tensor, int root);
  // `input` holds size() equal chunks; this rank's `output` (one chunk) gets their sum over ranks.
  void reduce_scatter(at::Tensor& output, at::Tensor& input);
  // `output` holds size() chunks, chunk r being rank r's `input`.
  void allgather(at::Tensor& output, at::Tensor& input);
  void barrier();
  // Point to point, between a pipeline's neighbours. send first waits for the sends before it, then
  // returns at once: the transfer completes in the background, keeping `tensor` alive until the next
  // send or wait_sends() (a neighbour that is itself sending first would otherwise wait for this rank
  // forever). recv blocks until `tensor`, of the right shape and dtype already, holds what rank
  // `src` sent; messages between two ranks arrive in order.
  void send(const at::Tensor& tensor, int dst);
  void recv(at::Tensor& tensor, int src);
  // Waits for every send posted, releasing their tensors.
  void wait_sends();

 private:
  struct Backend;
  template <typename F>
  void run(const char* op, F&& start);
  void join(const c10::Device& device);  // this group's backend, over backend_->store

  WorldEnv env_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Backend> backend_;
};

}  // namespace headroom
