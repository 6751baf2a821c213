#include "train/step_record.h"

namespace headroom {

nlohmann::json StepRecord::to_json() const {
  nlohmann::json j = {{"step", step},
                      {"loss", loss},
                      {"tokens", tokens},
                      {"seconds", seconds},
                      {"peak_bytes", peak_bytes},
                      {"live_bytes", live_bytes},
                      {"lr", lr},
                      {"grad_norm", grad_norm},
                      {"batch", batch},
                      {"accum", accum},
                      {"oom_recoveries", oom_recoveries}};
  if (rank) j["rank"] = *rank;
  if (reserved_bytes) j["reserved_bytes"] = *reserved_bytes;
  if (peak_reserved_bytes) j["peak_reserved_bytes"] = *peak_reserved_bytes;
  if (host_peak_bytes) j["host_peak_bytes"] = *host_peak_bytes;
  if (peak_inactive_split_bytes) j["peak_inactive_split_bytes"] = *peak_inactive_split_bytes;
  j["peak_phase"] = std::string(phase_name(memory.peak_phase));
  j["phases"] = memory.to_json();
  if (skipped) j["skipped"] = true;
  if (loss_scale) j["loss_scale"] = *loss_scale;
  if (eval_loss) j["eval_loss"] = *eval_loss;
  if (routing_skew) j["routing_skew"] = *routing_skew;
  return j;
}

}  // namespace headroom
