// glibc's malloc in the test program and every process it launches (the command line's runs, the
// ranks): large blocks served from the heap, up to 1 GiB of it kept free at its top, instead of a
// fresh mmap for each. The tests free and remake tensors of hundreds of MB (real vocabularies), and
// faulting their pages in again each time was a third of the suite's processor time; the
// estimator's grid on olmo2 took 48 s, 43 s so, at the same resident peak (12.6 GB).
//
// Set as the program starts: mallopt for this process, the environment for its children; not where
// MALLOC_MMAP_MAX_ is set already (a run's own choice).
#include <malloc.h>

#include <cstdlib>

namespace {

[[maybe_unused]] const bool kTestMalloc = [] {
  if (std::getenv("MALLOC_MMAP_MAX_") != nullptr) return false;  // the run's own choice
  constexpr int kKeptFree = 1 << 30;
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, kKeptFree);
  setenv("MALLOC_MMAP_MAX_", "0", 1);
  setenv("MALLOC_TRIM_THRESHOLD_", "1073741824", 1);
  return true;
}();

}  // namespace
