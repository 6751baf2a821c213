// Local ranks — this very binary started N times on this machine as a data-parallel job, without
// torchrun: each process gets RANK, LOCAL_RANK, WORLD_SIZE and a free loopback MASTER_PORT (rank 0
// hosts the store), as a hand launch would. The doctor's lever 6 trials use it.
#pragma once

#include <string>
#include <vector>

namespace headroom {

struct LocalRanksResult {
  std::vector<int> exit_codes;  // per rank; -1: it did not exit normally (a signal)
  std::string rank0_stdout;
  std::string first_error;  // the last line of the first failing rank's stderr
  bool ok() const;
};

// Runs `args` (e.g. {"train", "--model", "tiny", ...}) as `ranks` processes of the headroom CLI,
// HEADROOM_EXECUTABLE (which the CLI sets to itself when it starts; a program that links the library
// but is not the CLI, such as the tests, sets it or gets an Error), and waits for all of them.
// Throws Error when a process cannot be started.
LocalRanksResult run_local_ranks(int ranks, const std::vector<std::string>& args);

// A loopback port the kernel says is free now (another process may take it before rank 0 binds it:
// rare). Throws Error when there is none.
int free_loopback_port();

}  // namespace headroom
