// The Hugging Face loader's refusals, each naming the first thing wrong and leaving the model as it
// was, and a sharded checkpoint (an index and two files) loading as the single file does.
#include "model/hf_weights.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "testing/temp_dir.h"
#include "train/safetensors.h"
#include "util/error.h"

namespace headroom {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

const std::string kLlama = std::string(HEADROOM_SOURCE_DIR) + "/src/model/testdata/hf/llama";

ModelConfig llama_config() {
  std::ifstream in(kLlama + "/reference.json");
  const auto ref = nlohmann::json::parse(in);
  return load_model_config(ref["preset"], ref["overrides"].get<std::vector<std::string>>());
}

std::vector<std::pair<std::string, at::Tensor>> reference_tensors() {
  const SafetensorsFile f = SafetensorsFile::open(kLlama + "/hf/model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& e : f.entries()) out.push_back({e.name, f.load(e.name)});
  return out;
}

std::string refusal(const std::string& dir, CausalLM& model) {
  const at::Tensor before = model.parameters()[0].tensor.clone();
  try {
    load_hf_weights(dir, model);
  } catch (const Error& e) {
    EXPECT_TRUE(at::equal(model.parameters()[0].tensor, before)) << "a failed load changed the model";
    return e.what();
  }
  return "accepted";
}

TEST(HfWeights, AShardedCheckpointLoadsAsTheSingleFileDoes) {
  TempDir dir;
  auto tensors = reference_tensors();
  const size_t half = tensors.size() / 2;
  std::vector<std::pair<std::string, at::Tensor>> first(tensors.begin(), tensors.begin() + half),
      second(tensors.begin() + half, tensors.end());
  write_safetensors(dir.file("model-00001-of-00002.safetensors"), first);
  write_safetensors(dir.file("model-00002-of-00002.safetensors"), second);
  nlohmann::json index;
  for (const auto& [name, t] : first) index["weight_map"][name] = "model-00001-of-00002.safetensors";
  for (const auto& [name, t] : second) index["weight_map"][name] = "model-00002-of-00002.safetensors";
  std::ofstream(dir.file("model.safetensors.index.json")) << index.dump();
  CausalLM sharded(llama_config(), at::TensorOptions().dtype(at::kFloat), 1), single(llama_config(), at::TensorOptions().dtype(at::kFloat), 2);
  load_hf_weights(dir.path(), sharded);
  load_hf_weights(kLlama + "/hf", single);
  for (size_t i = 0; i < single.parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(sharded.parameters()[i].tensor, single.parameters()[i].tensor)) << single.parameters()[i].name;
  }
}

TEST(HfWeights, ConvertsTheCheckpointsDtype) {
  TempDir dir;
  auto tensors = reference_tensors();
  for (auto& [name, t] : tensors) t = t.to(at::kBFloat16);
  write_safetensors(dir.file("model.safetensors"), tensors);
  CausalLM model(llama_config(), at::TensorOptions().dtype(at::kFloat), 1);
  load_hf_weights(dir.path(), model);
  EXPECT_EQ(model.parameters()[0].tensor.scalar_type(), at::kFloat);
  const auto embed = std::find_if(tensors.begin(), tensors.end(),
                                  [](const auto& p) { return p.first == "model.embed_tokens.weight"; });
  ASSERT_NE(embed, tensors.end());
  ASSERT_EQ(model.parameters()[0].name, "embed_tokens.weight");
  EXPECT_TRUE(at::equal(model.parameters()[0].tensor, embed->second.to(at::kFloat)));
}

TEST(HfWeights, RefusesMissingUnexpectedAndMisShapedTensorsNamingThem) {
  TempDir dir;
  CausalLM model(llama_config(), at::TensorOptions().dtype(at::kFloat), 1);
  auto write = [&](const std::string& name, std::vector<std::pair<std::string, at::Tensor>> tensors) {
    const std::string d = dir.file(name);
    std::filesystem::create_directories(d);
    write_safetensors(d + "/model.safetensors", tensors);
    return d;
  };
  auto tensors = reference_tensors();
  auto missing = tensors;
  missing.erase(std::find_if(missing.begin(), missing.end(), [](const auto& p) { return p.first == "model.norm.weight"; }));
  EXPECT_THAT(refusal(write("missing", missing), model), HasSubstr("missing tensor for the model's final_norm.weight"));
  auto unexpected = tensors;
  unexpected.push_back({"model.layers.7.self_attn.q_proj.weight", at::zeros({4, 4})});
  EXPECT_THAT(refusal(write("unexpected", unexpected), model),
              HasSubstr("unexpected tensor 'model.layers.7.self_attn.q_proj.weight'"));
  auto shaped = tensors;
  for (auto& [name, t] : shaped) {
    if (name == "model.layers.0.mlp.up_proj.weight") t = at::zeros({3, 3});
  }
  EXPECT_THAT(refusal(write("shaped", shaped), model), HasSubstr("tensor 'model.layers.0.mlp.up_proj.weight' has shape 3×3"));
  auto unknown = tensors;
  unknown.push_back({"model.vision_tower.weight", at::zeros({2})});
  EXPECT_THAT(refusal(write("unknown", unknown), model), HasSubstr("not a parameter of a llama model"));
  EXPECT_THAT(refusal(dir.file("nothing-here"), model), HasSubstr("no model.safetensors"));
}

}  // namespace
}  // namespace headroom
