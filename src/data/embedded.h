// Data compiled into the binary (cmake/EmbedScript.cmake generates the definitions): the bundled
// corpus (data/corpus.txt, see data/CORPUS.md for its licence) and the model presets
// (configs/models/*.json), so that headroom runs from any directory.
#pragma once

#include <string_view>
#include <vector>

namespace headroom {

struct EmbeddedPreset {
  std::string_view name;  // file name without ".json", e.g. "llama-3.2-1b"
  std::string_view json;
};

std::string_view embedded_corpus();
const std::vector<EmbeddedPreset>& embedded_presets();

}  // namespace headroom
