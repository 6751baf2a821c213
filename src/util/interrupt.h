// Interrupts — Ctrl-C (SIGINT) and SIGTERM, turned from "kill the process now" into "stop at the
// next safe point": the training loop finishes the step in flight, writes its checkpoint when one
// is configured, and the command exits 130 (SIGINT) or 143 (SIGTERM) with one line. A second signal
// of either kind ends the process at once, the default action, for a user who will not wait.
//
// The CLI installs the handlers once (install_interrupt_handlers); a library user who does not
// never sees a request. Async-signal-safe: the handler only stores a number.
#pragma once

#include <stdexcept>
#include <string>

namespace headroom {

void install_interrupt_handlers();

// The signal that asked to stop (SIGINT, SIGTERM), or 0.
int interrupt_requested();

// Thrown by long operations made of many runs (the doctor, fit, plan's calibration) at a safe
// point after an interrupt; the CLI turns it into the exit code.
class Interrupted : public std::runtime_error {
 public:
  explicit Interrupted(int signal, const std::string& what) : std::runtime_error(what), signal_(signal) {}
  int signal() const { return signal_; }
  int exit_code() const { return 128 + signal_; }

 private:
  int signal_;
};

// Throws Interrupted naming `where` when an interrupt was requested.
void throw_if_interrupted(const std::string& where);

const char* signal_name(int signal);

}  // namespace headroom
