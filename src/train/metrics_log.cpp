#include "train/metrics_log.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "util/atomic_file.h"
#include "util/error.h"
#include "util/json.h"

namespace headroom {

MetricsLog::MetricsLog(const std::string& path, std::optional<int64_t> keep_through) : path_(path) {
  std::vector<std::string> kept;
  if (keep_through) {
    std::ifstream old(path);
    std::string line;
    while (std::getline(old, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      // A line that is not a step record (or was cut short by a crash) is dropped.
      if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j.at("step").is_number_integer()) continue;
      if (j.at("step").get<int64_t>() <= *keep_through) kept.push_back(line);
    }
  }
  if (keep_through) {
    // Rewritten atomically, so that a crash here loses nothing.
    std::string text;
    for (const auto& line : kept) text += line + '\n';
    write_file_atomically(path, text, "--metrics");
    out_.open(path, std::ios::app);
  } else {
    out_.open(path, std::ios::trunc);
  }
  if (!out_) fail("--metrics: cannot write '{}'", path);
}

void MetricsLog::write(const StepRecord& r) {
  if (!out_.is_open()) return;
  out_ << dump_json(r.to_json()) << '\n';
  out_.flush();
  if (!out_) fail("--metrics: writing '{}' failed (disk full?)", path_);
}

}  // namespace headroom
