// malloc in the test program and every process it launches (the command line's runs, the ranks):
// freed memory kept for the next allocation instead of given back to the kernel. The tests free and
// remake tensors of hundreds of MB (real vocabularies); memory given back is mapped anew and its
// pages fault in again.
//
// The test program and the command line link jemalloc where it was found (CMakeLists.txt): it is
// told to keep freed pages (decay off; by default it gives them back after 10 s): in this process
// by the `malloc_conf` it reads as it starts, in the children by MALLOC_CONF. One 2-layer
// Qwen3-0.6B-wide train on the command line: 2.1 s of system time instead of 4.1, 7.5-7.9 s
// instead of 9.2-9.6 with glibc's malloc as below.
//
// glibc's (without jemalloc, and the pytest processes' Python): large blocks served from the heap,
// up to 1 GiB of it kept free at its top, instead of a fresh mmap for each (one Qwen3-0.6B-wide
// train: 3.7 M page faults, 1.4 M so, 12.6 s -> 10.1 s; the estimator's grid on olmo2 48 s -> 43 s,
// resident 12.6 -> 12.8 GB).
//
// Set as the program starts: mallopt for this process, the environment for its children; not where
// MALLOC_MMAP_MAX_ or MALLOC_CONF is set already (a run's own choice).
#include <malloc.h>

#include <cstdlib>
#include <string>

#if HEADROOM_WITH_JEMALLOC
// jemalloc reads it before the first allocation; MALLOC_CONF, where set, comes after it and wins.
extern "C" {
[[maybe_unused]] const char* malloc_conf = "dirty_decay_ms:-1,muzzy_decay_ms:-1";
}
#endif

namespace {

[[maybe_unused]] const bool kTestMalloc = [] {
  setenv("MALLOC_CONF", "dirty_decay_ms:-1,muzzy_decay_ms:-1", 0);
  if (std::getenv("MALLOC_MMAP_MAX_") != nullptr) return false;  // the run's own choice
  constexpr int kKeptFree = 1 << 30;
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, kKeptFree);
  setenv("MALLOC_MMAP_MAX_", "0", 1);
  setenv("MALLOC_TRIM_THRESHOLD_", std::to_string(kKeptFree).c_str(), 1);
  return true;
}();

}  // namespace
