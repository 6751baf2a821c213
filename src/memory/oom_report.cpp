#include "memory/oom_report.h"

#include <fmt/format.h>

#include <regex>
#include <vector>

#include "util/error.h"
#include "util/size.h"

namespace headroom {

nlohmann::json OomReport::to_json() const {
  return {{"happened", true},
          {"step", step},
          {"during_setup", during_setup},
          {"phase", std::string(phase_name(phase))},
          {"requested_bytes", requested},
          {"in_use_bytes", in_use},
          {"budget_bytes", budget},
          {"injected", injected},
          {"breakdown", breakdown.to_json()},
          {"message", message},
          {"advice", advice},
          {"live_before_step_bytes", live_before_step},
          {"live_after_cleanup_bytes", live_after_cleanup},
          {"micro_batch", micro_batch},
          {"during_update", during_update},
          {"rank", rank >= 0 ? nlohmann::json(rank) : nlohmann::json()},
          {"elsewhere", elsewhere}};
}

std::string OomReport::to_text() const {
  if (during_setup) {
    return fmt::format(
        "out of memory allocating the model and optimizer state, before the first step: the "
        "weights need {} and the optimizer state comes on top{}; a smaller model, a lighter "
        "optimizer, pure bf16 or a larger budget is needed\n  allocator: {}",
        format_bytes(breakdown.weights), budget >= 0 ? fmt::format(", within a {} budget", format_bytes(budget)) : "",
        message);
  }
  if (elsewhere) {
    return fmt::format(
        "rank {} ran out of memory in step {} (micro-batch {}) and could not recover; every rank stops with it "
        "(rank {}'s own report has the figures)",
        rank, step, micro_batch, rank);
  }
  std::string out = fmt::format("{}out of memory in {} of step {}", rank >= 0 ? fmt::format("rank {}: ", rank) : "",
                                phase_name(phase), step);
  if (requested >= 0) out += fmt::format(": tried to allocate {}", format_bytes(requested));
  out += fmt::format(" with {} in use", format_bytes(in_use));
  if (budget >= 0) out += fmt::format(" of a {} budget", format_bytes(budget));
  out += "\n  in use by category:";
  std::vector<std::pair<const char*, int64_t>> cats = {{"weights", breakdown.weights},
                                                       {"gradients", breakdown.gradients},
                                                       {"optimizer", breakdown.optimizer},
                                                       {"activations", breakdown.activations},
                                                       {"other", breakdown.other}};
  if (breakdown.communication > 0) cats.emplace_back("communication", breakdown.communication);  // ranks only
  for (const auto& [name, bytes] : cats) {
    const double share = in_use > 0 ? 100.0 * static_cast<double>(bytes) / static_cast<double>(in_use) : 0.0;
    out += fmt::format("\n    {:<13} {:>11}  {:>5.1f}%", name, format_bytes(bytes), share);
  }
  out += fmt::format("\n  after releasing the failed step: {} in use ({} before it)", format_bytes(live_after_cleanup),
                     format_bytes(live_before_step));
  if (!advice.empty()) out += "\n  " + advice;
  out += "\n  allocator: " + message;
  return out;
}

int64_t requested_bytes_of(const std::string& message) {
  static const std::regex pattern(R"(Tried to allocate ([0-9.]+) ?([KMGT]i?B|B|bytes))");
  std::smatch m;
  if (!std::regex_search(message, m, pattern)) return 0;
  try {
    const std::string unit = m[2].str() == "bytes" ? "B" : m[2].str();
    return parse_size(m[1].str() + unit, "requested");
  } catch (const Error&) {
    return 0;
  }
}

}  // namespace headroom
