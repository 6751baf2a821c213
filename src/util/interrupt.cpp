#include "util/interrupt.h"

#include <fmt/format.h>
#include <signal.h>

#include <atomic>
#include <csignal>

namespace headroom {
namespace {

std::atomic<int> g_requested{0};

extern "C" void on_interrupt(int signal) {
  if (g_requested.load() != 0) {
    // The second one: the default action, now.
    std::signal(signal, SIG_DFL);
    std::raise(signal);
    return;
  }
  g_requested.store(signal);
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction action {};
  action.sa_handler = on_interrupt;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

int interrupt_requested() { return g_requested.load(std::memory_order_relaxed); }

void throw_if_interrupted(const std::string& where) {
  if (const int s = interrupt_requested()) {
    throw Interrupted(s, fmt::format("interrupted by {} {}", signal_name(s), where));
  }
}

const char* signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT (Ctrl-C)";
    case SIGTERM: return "SIGTERM";
  }
  return "a signal";
}

}  // namespace headroom
