#include "config/finetune.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace headroom {
namespace {

constexpr const char* kAccepted =
    "accepted: full, freeze:PATTERN[,PATTERN...], or lora:r=R[,alpha=A][,dropout=P][,targets=q,k,v,o,gate,up,down]";

const char* const kNames[kProjections] = {"q", "k", "v", "o", "gate", "up", "down"};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at - start));
    if (at == std::string::npos) return out;
    start = at + 1;
  }
}

double number(const std::string& text, const std::string& key, const std::string& given) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(v)) {
    fail("--finetune '{}': {}={} is not a number; {}", given, key, text, kAccepted);
  }
  return v;
}

LoraSettings parse_lora(const std::string& body, const std::string& given) {
  LoraSettings l;
  bool has_r = false, in_targets = false;
  auto add_target = [&](const std::string& t) {
    const auto* it = std::find_if(std::begin(kNames), std::end(kNames), [&](const char* n) { return t == n; });
    if (it == std::end(kNames)) {
      fail("--finetune '{}': target '{}'; accepted: q, k, v, o, gate, up, down (targets=q,k,v,o)", given, t);
    }
    const auto p = static_cast<Projection>(it - std::begin(kNames));
    if (std::find(l.targets.begin(), l.targets.end(), p) == l.targets.end()) l.targets.push_back(p);
  };
  for (const std::string& item : split(body, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos) {
      // targets=q,k,v: the names after targets= are its list
      if (!in_targets) fail("--finetune '{}': '{}' is not key=value; {}", given, item, kAccepted);
      add_target(item);
      continue;
    }
    in_targets = false;
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "r") {
      const double r = number(value, key, given);
      if (r < 1 || r > 65536 || r != std::floor(r)) fail("--finetune '{}': r must be an integer from 1 to 65536", given);
      l.r = static_cast<int64_t>(r);
      has_r = true;
    } else if (key == "alpha") {
      l.alpha = number(value, key, given);
      if (!(l.alpha > 0)) fail("--finetune '{}': alpha must be positive", given);
    } else if (key == "dropout") {
      l.dropout = number(value, key, given);
      if (l.dropout < 0 || l.dropout >= 1) fail("--finetune '{}': dropout must be in [0, 1)", given);
    } else if (key == "targets") {
      l.targets.clear();
      in_targets = true;
      for (const std::string& t : split(value, '+')) add_target(t);
    } else {
      fail("--finetune '{}': unknown LoRA setting '{}'; {}", given, key, kAccepted);
    }
  }
  std::sort(l.targets.begin(), l.targets.end());
  if (!has_r) fail("--finetune '{}': LoRA needs its rank, r=R (e.g. lora:r=16); {}", given, kAccepted);
  return l;
}

std::string shortest(double v) { return fmt::format("{}", v); }

}  // namespace

const char* projection_name(Projection p) { return kNames[static_cast<int>(p)]; }

bool LoraSettings::targets_any(std::initializer_list<Projection> ps) const {
  for (Projection p : ps) {
    if (std::find(targets.begin(), targets.end(), p) != targets.end()) return true;
  }
  return false;
}

std::string Finetune::name() const {
  switch (kind) {
    case Kind::full: return "full";
    case Kind::freeze: return fmt::format("freeze:{}", fmt::join(freeze, ","));
    case Kind::lora: {
      std::vector<std::string> t;
      for (Projection p : lora.targets) t.emplace_back(projection_name(p));
      return fmt::format("lora:r={},alpha={},dropout={},targets={}", lora.r, shortest(lora.alpha),
                         shortest(lora.dropout), fmt::join(t, ","));
    }
  }
  return "full";
}

Finetune parse_finetune(const std::string& text) {
  Finetune f;
  if (text == "full") return f;
  if (text.rfind("freeze:", 0) == 0) {
    f.kind = Finetune::Kind::freeze;
    for (const std::string& p : split(text.substr(7), ',')) {
      if (p.empty()) fail("--finetune '{}': an empty pattern; {}", text, kAccepted);
      f.freeze.push_back(p);
    }
    return f;
  }
  if (text.rfind("lora:", 0) == 0) {
    f.kind = Finetune::Kind::lora;
    f.lora = parse_lora(text.substr(5), text);
    return f;
  }
  if (text == "lora") fail("--finetune lora needs its rank: lora:r=R (e.g. lora:r=16)");
  fail("--finetune '{}'; {}", text, kAccepted);
}

bool glob_match(const std::string& pattern, const std::string& name) {
  // Iterative matching with one backtrack point for the last `*`.
  size_t p = 0, n = 0, star = std::string::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace headroom
