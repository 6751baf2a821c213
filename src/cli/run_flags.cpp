#include "cli/run_flags.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "device/cuda_adapter.h"
#include "device/device.h"
#include "util/error.h"

namespace headroom {

std::function<RunConfig()> bind_run_flags(CLI::App* cmd, const std::vector<std::string>& only, const RunConfig& base) {
  auto bound = [&only](const std::string& key) {
    return only.empty() || std::find(only.begin(), only.end(), key) != only.end();
  };
  struct Values {
    std::string config_file;
    std::map<std::string, std::string> text;
    std::map<std::string, std::vector<std::string>> lists;
    std::map<std::string, bool> flags;
    std::map<std::string, CLI::Option*> options;
  };
  auto v = std::make_shared<Values>();
  cmd->add_option("--config", v->config_file, "TOML run file; its keys are these flags' names, flags override it")
      ->check(CLI::ExistingFile);
  for (const RunField& f : run_fields()) {
    if (!bound(f.key)) continue;
    const std::string name = "--" + f.key;
    switch (f.kind) {
      case RunField::Kind::flag: v->options[f.key] = cmd->add_flag(name, v->flags[f.key], f.help); break;
      case RunField::Kind::list:
        v->options[f.key] = cmd->add_option(name, v->lists[f.key], f.help)->type_name("KEY=VALUE");
        break;
      default:
        v->options[f.key] = cmd->add_option(name, v->text[f.key], f.help)
                                ->type_name(f.kind == RunField::Kind::text      ? "TEXT"
                                            : f.kind == RunField::Kind::integer ? "INT"
                                                                                : "NUMBER");
    }
  }
  return [v, base]() {
    RunConfig cfg = base;
    if (!v->config_file.empty()) apply_toml_file(cfg, v->config_file);
    for (const RunField& f : run_fields()) {
      if (!v->options.count(f.key) || v->options.at(f.key)->count() == 0) continue;
      switch (f.kind) {
        case RunField::Kind::flag: f.set(cfg, v->flags.at(f.key) ? "true" : "false"); break;
        case RunField::Kind::list:
          cfg.overrides.clear();  // flags replace the file's list
          for (const auto& item : v->lists.at(f.key)) f.set(cfg, item);
          break;
        default: f.set(cfg, v->text.at(f.key));
      }
    }
    return cfg;
  };
}

int64_t device_budget(const RunConfig& cfg, const std::string& command) {
  if (cfg.memory_budget) return *cfg.memory_budget;
  const auto device = resolve_device(cfg.device);
  if (device.is_cuda()) return cuda_device_memory(device.index() < 0 ? 0 : device.index()).free_bytes;
  fail("{} on cpu needs --memory-budget SIZE (the simulated device to fit into), e.g. --memory-budget 512MiB", command);
}

}  // namespace headroom
