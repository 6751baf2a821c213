// The readers of the families added since the first five, one file each in config/families/:
// each maps its config.json onto ModelConfig's switches. model_config.cpp's family table names them.
#pragma once

#include <string>

#include "config/field_reader.h"

namespace headroom::config_reading {

void read_qwen3(FieldReader& r, ModelConfig& c, const std::string& origin);  // qwen3 and qwen3_moe
void read_mixtral(FieldReader& r, ModelConfig& c, const std::string& origin);
void read_gemma3(FieldReader& r, ModelConfig& c, const std::string& origin);  // gemma3_text (and gemma3's text_config)
void read_phi3(FieldReader& r, ModelConfig& c, const std::string& origin);
void read_olmo2(FieldReader& r, ModelConfig& c, const std::string& origin);
void read_smollm3(FieldReader& r, ModelConfig& c, const std::string& origin);

// The experts of qwen3_moe and mixtral share these fields' meaning; each family names them its way.
void read_router_loss(FieldReader& r, MoeConfig& moe, double default_coef);

}  // namespace headroom::config_reading
