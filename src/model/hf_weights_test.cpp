// The Hugging Face loader's refusals, each naming the first thing wrong and leaving the model as it
// was, a sharded checkpoint (an index and two files) loading as the single file does, and a model
// part (a pipeline stage, a tensor-parallel share) taking its part of a whole checkpoint.
#include "model/hf_weights.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "testing/temp_dir.h"
#include "model/safetensors.h"
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
  EXPECT_THAT(refusal(dir.file("nothing-here"), model), HasSubstr("not a directory"));
  std::filesystem::create_directories(dir.file("empty"));
  EXPECT_THAT(refusal(dir.file("empty"), model), HasSubstr("no model.safetensors"));
}

// Every family: what headroom writes is what transformers' save_pretrained wrote (its fixture), name
// for name and bit for bit, tied heads left out as transformers leaves them out; and the directory
// save_hf_weights writes loads back to the same model.
TEST(HfWeights, EveryFamilySavesTheNamesAndTensorsTransformersSaves) {
  const std::string root = std::string(HEADROOM_SOURCE_DIR) + "/src/model/testdata/hf";
  int families = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root)) {
    const std::string dir = entry.path().string();
    SCOPED_TRACE(dir);
    std::ifstream in(dir + "/reference.json");
    const auto ref = nlohmann::json::parse(in);
    const ModelConfig config = load_model_config(ref["preset"], ref["overrides"].get<std::vector<std::string>>());
    CausalLM model(config, at::TensorOptions().dtype(at::kFloat), 1);
    load_hf_weights(dir + "/hf", model);
    const SafetensorsFile theirs = SafetensorsFile::open(dir + "/hf/model.safetensors");
    std::map<std::string, at::Tensor> ours;
    for (auto& [name, t] : hf_checkpoint_tensors(model)) ours.emplace(name, t);
    size_t expected = 0;
    for (const auto& e : theirs.entries()) {
      if (e.name.find("rotary_emb") != std::string::npos || e.name.find(".attn.bias") != std::string::npos) continue;
      ++expected;
      const auto it = ours.find(e.name);
      ASSERT_NE(it, ours.end()) << "headroom does not write " << e.name;
      EXPECT_TRUE(at::equal(it->second.contiguous(), theirs.load(e.name))) << e.name;
    }
    EXPECT_EQ(ours.size(), expected);

    TempDir out;
    save_hf_weights(out.file("saved"), model);
    CausalLM back(config, at::TensorOptions().dtype(at::kFloat), 2);
    load_hf_weights(out.file("saved"), back);
    for (size_t i = 0; i < model.parameters().size(); ++i) {
      EXPECT_TRUE(at::equal(back.parameters()[i].tensor, model.parameters()[i].tensor)) << model.parameters()[i].name;
    }
    const auto saved_config = nlohmann::json::parse(std::ifstream(out.file("saved/config.json")));
    EXPECT_EQ(saved_config["model_type"], config.source["model_type"]);
    EXPECT_EQ(saved_config["dtype"], "float32");
    EXPECT_EQ(load_model_config(out.file("saved")).hidden_size, config.hidden_size);
    ++families;
  }
  EXPECT_EQ(families, 12);
}

// GPT-2's widths and vocabulary (2 layers; fused q/k/v, Conv1D weights stored transposed, 50257 rows
// split unevenly), tied and untied: a whole model's checkpoint loaded into a pipeline stage that is
// also a tensor-parallel share gives each of its parameters the whole model's, cut here by hand (half
// the heads of q, k and v; half the MLP's inner rows or columns; vocabulary rows floor(t·V/2) to
// floor((t+1)·V/2); norms, positions and the o/down biases whole).
TEST(HfWeights, AStageAndShareLoadsItsPartOfAWholeCheckpoint) {
  const int64_t h = 768, half = h / 2, inner = 3072 / 2, vocab = 50257;
  auto by_hand = [&](const std::string& name, const at::Tensor& w, int64_t t) {
    auto ends = [&](const std::string& tail) { return name.ends_with(tail); };
    if (name == "embed_tokens.weight" || name == "lm_head.weight") {
      return w.narrow(0, t * vocab / 2, (t + 1) * vocab / 2 - t * vocab / 2);
    }
    if (ends("attn.qkv.weight") || ends("attn.qkv.bias")) {
      return at::cat({w.narrow(0, t * half, half), w.narrow(0, h + t * half, half), w.narrow(0, 2 * h + t * half, half)});
    }
    if (ends("attn.o_proj.weight")) return w.narrow(1, t * half, half);
    if (ends("mlp.up_proj.weight") || ends("mlp.up_proj.bias")) return w.narrow(0, t * inner, inner);
    if (ends("mlp.down_proj.weight")) return w.narrow(1, t * inner, inner);
    return w;
  };
  for (const char* tied : {"true", "false"}) {
    SCOPED_TRACE(std::string("tie_word_embeddings=") + tied);
    const ModelConfig c = load_model_config("gpt2", {"n_layer=2", std::string("tie_word_embeddings=") + tied});
    const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
    const CausalLM whole(c, f32, 1);
    TempDir dir;
    save_hf_weights(dir.file("hf"), whole);
    std::map<std::string, at::Tensor> by_name;
    for (const NamedTensor& p : whole.parameters()) by_name[p.name] = p.tensor;
    // {embeddings, layer 0} as share 0 of 2, and {layer 1, the head} as share 1.
    for (const ModelStage& stage : {ModelStage{0, 1, true, false, TensorSlice{0, 2, {}}},
                                    ModelStage{1, 2, false, true, TensorSlice{1, 2, {}}}}) {
      SCOPED_TRACE(fmt::format("layers {} to {}, share {}", stage.first, stage.end, stage.tensor.rank));
      CausalLM part(c, f32, 2, CausalLM::KeepParameter{}, Finetune{}, true, BaseWeights::dense, stage);
      load_hf_weights(dir.file("hf"), part);
      ASSERT_FALSE(part.parameters().empty());
      for (const NamedTensor& p : part.parameters()) {
        EXPECT_TRUE(at::equal(p.tensor, by_hand(p.name, by_name.at(p.name), stage.tensor.rank))) << p.name;
      }
    }
  }
}

}  // namespace
}  // namespace headroom
