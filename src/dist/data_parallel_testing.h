// What the data-parallel tests (data_parallel*_test.cpp) share: runs described by the flags' names,
// launched on local cpu ranks through torchrun (Gloo over loopback).
#pragma once

#include <fmt/format.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "config/run_config.h"
#include "dist/local_ranks.h"
#include "testing/command.h"
#include "testing/temp_dir.h"

namespace headroom::data_parallel_testing {

inline std::string torchrun() { return (std::filesystem::path(HEADROOM_PYTHON).parent_path() / "torchrun").string(); }

// `settings`: "key=value;key=value" in the flags' names.
inline RunConfig config_of(const std::string& settings) {
  RunConfig cfg;
  cfg.device = "cpu";
  cfg.quiet = true;
  cfg.eval_rows = 0;
  cfg.threads = 1;
  size_t begin = 0;
  while (begin < settings.size()) {
    size_t end = settings.find(';', begin);
    if (end == std::string::npos) end = settings.size();
    const std::string item = settings.substr(begin, end - begin);
    const size_t eq = item.find('=');
    if (const RunField* f = find_run_field(item.substr(0, eq))) f->set(cfg, item.substr(eq + 1));
    begin = end + 1;
  }
  return cfg;
}

// Launches `ranks` local ranks of `program args` through torchrun (its agent hosts the store);
// stdout and stderr together. The tests whose subject is a run as users launch it (ranks training
// as one process) take this way.
inline testing::CommandResult torchrun_launch(int ranks, const std::string& program, const std::string& args,
                                              const std::string& env = "") {
  return testing::run_command(
      fmt::format("env OMP_NUM_THREADS=1 {} {} --standalone --no-python --nproc-per-node {} {} {} 2>&1", env,
                  torchrun(), ranks, program, args));
}

// Launches `ranks` local ranks of `program args` by hand, each with torchrun's RANK, LOCAL_RANK,
// WORLD_SIZE, LOCAL_WORLD_SIZE and a free loopback MASTER_PORT (rank 0 hosts the store); the first
// to fail ends the others, as torchrun does, and its exit code is the launch's; stdout and stderr
// together. torchrun's own start (a Python that imports torch, and its agent) cost each launch about
// 2 s of cpu, more than the run in most tests here.
inline testing::CommandResult launch(int ranks, const std::string& program, const std::string& args,
                                     const std::string& env = "") {
  std::string script = "pids=''; ";
  const int port = free_loopback_port();
  for (int r = 0; r < ranks; ++r) {
    script += fmt::format(
        "env OMP_NUM_THREADS=1 {} RANK={} LOCAL_RANK={} WORLD_SIZE={} LOCAL_WORLD_SIZE={} MASTER_ADDR=127.0.0.1 "
        "MASTER_PORT={} {} {} & pids=\"$pids $!\"; ",
        env, r, r, ranks, ranks, port, program, args);
  }
  // Each rank's status is waited for once it has gone (bash reaps it and keeps its status); not
  // `wait -n` once per rank: ranks ending together were sometimes reported once, and the last
  // `wait -n`, finding no child left, made the launch's code 127 (seen once in 158 tests).
  script +=
      "rc=0; left=$pids; while [ -n \"$left\" ]; do still=''; for p in $left; do "
      "if kill -0 $p 2>/dev/null; then still=\"$still $p\"; else wait $p; s=$?; "
      "if [ $s -ne 0 ] && [ $rc -eq 0 ]; then rc=$s; kill $pids 2>/dev/null; fi; fi; done; "
      "left=$still; if [ -n \"$left\" ]; then sleep 0.05; fi; done; exit $rc";
  testing::TempDir dir;
  std::ofstream(dir.file("launch.sh")) << script;
  return testing::run_command(fmt::format("bash {} 2>&1", dir.file("launch.sh")));
}

// Two ranks launched by hand (rank 0 hosts the store) training tiny with `flags` and a 10 s
// --dist-timeout; rank 1 gets `signal` (KILL, STOP) once rank 0 has finished a step. What rank 0
// did then: its exit code, the milliseconds it took to end after the signal, its stderr.
struct PeerLoss {
  int rc = -1, ms = -1;
  std::string err, script_out;
};
inline PeerLoss lose_peer(const std::string& flags, const char* signal) {
  testing::TempDir dir;
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  const std::string run = fmt::format(
      "env OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT={} WORLD_SIZE=2 {{}} {} train --device cpu --model "
      "tiny --steps 100000 --seq 32 --batch 2 --eval-rows 0 --quiet --dist-timeout 10 --metrics {} {}",
      port, HEADROOM_BINARY, dir.file("m.jsonl"), flags);
  const std::string script = fmt::format(
      "RANK=0 {} 2>{} & P0=$!; RANK=1 {} 2>/dev/null & P1=$!; "
      // Once rank 0 has finished a step, the other goes.
      "for i in $(seq 600); do [ -s {} ] && break; sleep 0.1; done; kill -{} $P1; "
      "S=$(date +%s%N); wait $P0; RC=$?; E=$(date +%s%N); kill -9 $P1 2>/dev/null; "
      "echo \"rc=$RC ms=$(( (E - S) / 1000000 ))\"",
      fmt::format(fmt::runtime(run), "RANK=0"), dir.file("err"), fmt::format(fmt::runtime(run), "RANK=1"),
      dir.file("m.jsonl"), signal);
  std::ofstream(dir.file("s.sh")) << script;
  PeerLoss out;
  out.script_out = testing::run_command("bash " + dir.file("s.sh")).out;
  std::ifstream e(dir.file("err"));
  out.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  if (std::sscanf(out.script_out.c_str(), "rc=%d ms=%d", &out.rc, &out.ms) != 2) out.rc = out.ms = -1;
  return out;
}

// tiny: llama, untied, vocabulary 256; 2 micro-batches, weight decay and clipping on; momentum, whose
// update is linear in the gradient. (Adam's is not: where a gradient element is a sum that nearly
// cancels, the ranks' order of summation changes it relatively much, and Adam's normalised step
// turns that into a difference of up to the learning rate; its test compares losses.)
inline constexpr const char* kTiny = "model=tiny;steps=3;seq=32;accum=2;lr=0.01;optimizer=momentum;weight-decay=0.1";

}  // namespace headroom::data_parallel_testing
