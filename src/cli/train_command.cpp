#include "cli/train_command.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <map>
#include <memory>

#include "train/run_config.h"
#include "train/trainer.h"
#include "util/json.h"
#include "util/size.h"

namespace headroom {

void add_train_command(CLI::App& app, std::function<int()>& run) {
  CLI::App* cmd = app.add_subcommand(
      "train", "Train a causal LM of the given architecture (random init) on a text corpus.\n"
               "With no flags: the 'tiny' preset on the bundled corpus for 200 steps.");
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
  const RunConfig defaults;
  for (const RunField& f : run_fields()) {
    const std::string name = "--" + f.key;
    switch (f.kind) {
      case RunField::Kind::flag:
        v->options[f.key] = cmd->add_flag(name, v->flags[f.key], f.help);
        break;
      case RunField::Kind::list:
        v->options[f.key] = cmd->add_option(name, v->lists[f.key], f.help)->type_name("KEY=VALUE");
        break;
      default:
        v->options[f.key] = cmd->add_option(name, v->text[f.key], f.help)
                                 ->type_name(f.kind == RunField::Kind::text ? "TEXT"
                                             : f.kind == RunField::Kind::integer ? "INT"
                                                                                 : "NUMBER");
    }
  }
  cmd->callback([v, &run] {
    run = [v]() -> int {
      RunConfig cfg;
      if (!v->config_file.empty()) apply_toml_file(cfg, v->config_file);
      for (const RunField& f : run_fields()) {
        if (v->options.at(f.key)->count() == 0) continue;
        switch (f.kind) {
          case RunField::Kind::flag: f.set(cfg, v->flags.at(f.key) ? "true" : "false"); break;
          case RunField::Kind::list:
            cfg.overrides.clear();  // flags replace the file's list
            for (const auto& item : v->lists.at(f.key)) f.set(cfg, item);
            break;
          default: f.set(cfg, v->text.at(f.key));
        }
      }
      const TrainSummary s = train(cfg);
      if (cfg.json) {
        const nlohmann::json out = {{"params", s.params},         {"steps", s.steps},
                                    {"final_loss", s.final_loss}, {"eval_loss", s.eval_loss},
                                    {"tokens_per_s", s.tokens_per_s}, {"peak_bytes", s.peak_bytes},
                                    {"seconds", s.seconds},       {"device", s.device}};
        fmt::print("{}\n", dump_json(out));
      } else if (!cfg.quiet) {
        fmt::print(stderr, "\nmemory by phase, at each phase's highest peak — {}:\n{}\n", s.memory_source,
                   s.memory_table);
        fmt::print(stderr, "done: {} steps, final loss {:.4f}, eval loss {:.4f}, {:.0f} tok/s, peak {}\n", s.steps,
                   s.final_loss, s.eval_loss, s.tokens_per_s, format_bytes(s.peak_bytes));
      }
      return 0;
    };
  });
}

}  // namespace headroom
