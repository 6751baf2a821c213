// A 4-bit frozen base (QLoRA, Dettmers et al. 2023): NF4 weights and the linear layer over them.
//
// NF4 ("4-bit NormalFloat") has 16 values at quantiles of the standard normal distribution, scaled to
// [-1, 1], with an exact zero: 7 negative, 0 and 8 positive, as QLoRA's create_normal_map makes
// them. A weight is quantised in blocks of 64 consecutive values: each block's absolute maximum is
// kept (float32) and each value stored as the index of the nearest code value to value / absmax,
// two to a byte (the first in the high half), as bitsandbytes' quantize_4bit packs them.
//
// nf4_linear() dequantises the weight for the forward and again for the backward (for the input's
// gradient), so that only one layer's dense weight exists at a time and autograd keeps none: the
// trade QLoRA makes, some compute for the memory of the dense weights.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace headroom {

inline constexpr int64_t kNf4Block = 64;  // values per absmax

// The 16 code values, ascending.
const std::array<float, 16>& nf4_code();

// A weight in NF4: codes (uint8, ceil(n / 2)) and absmax (float32, ceil(n / 64)) of its n values,
// its shape, and the dtype it is dequantised to outside autocast.
struct Nf4Weight {
  at::Tensor codes, absmax;
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool defined() const { return codes.defined(); }
  int64_t numel() const;
};

// The parameters an NF4 weight is held as, by the weight's name: "<weight>.nf4" (codes) and
// "<weight>.absmax"; and back: the weight whose codes a parameter is ("" when it is not).
std::string nf4_codes_name(const std::string& weight);
std::string nf4_absmax_name(const std::string& weight);
std::string nf4_weight_of_codes(const std::string& param);
// Whether a parameter is part of an NF4 weight (its codes or its absmax).
bool is_nf4_part(const std::string& param);

// The tensors a weight of n values needs: ceil(n / 2) bytes of codes and ceil(n / 64) absmaxes.
int64_t nf4_code_bytes(int64_t numel);
int64_t nf4_blocks(int64_t numel);

// Quantises `dense` (any floating dtype, the weight's shape) into `w`'s existing codes and absmax,
// which must be on the same device. On cpu nothing else is allocated.
void nf4_quantise_into(const at::Tensor& dense, Nf4Weight& w);
// The dense weight in `dtype`: one new tensor (cpu: nothing else allocated).
at::Tensor nf4_dequantise(const Nf4Weight& w, c10::ScalarType dtype);

// x · Wᵀ + bias with W dequantised on use, in autocast's dtype when autocast is on for x's device,
// else in w.dtype. The weight and bias get no gradient (they are frozen); x gets one.
at::Tensor nf4_linear(const at::Tensor& x, const Nf4Weight& w, const at::Tensor& bias);

}  // namespace headroom
