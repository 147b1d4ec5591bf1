// A kernel's C++ entry points, handed to another extension in a PyCapsule, so that the layer loop (layer_loop.cpp)
// calls the kernels it is given one after another without the interpreter in between. Each capsule is named after its
// function's type: a loop handed the wrong one refuses it.
#pragma once
#include <torch/extension.h>

#include <cstring>
#include <tuple>
#include <vector>

namespace specdec::entry {

// y [M, out_features] of x [M, K]; operands: the kernel's packed weight and the rest, as its Python class keeps them
using Linear = torch::Tensor (*)(const torch::Tensor& x, const std::vector<torch::Tensor>& operands,
                                 int64_t out_features);
// row_attention.cpp's attend(qkv, cos, sin, keys, values, cached, paths, scale)
using Attend = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                                 const std::vector<std::vector<int64_t>>&, double);
// norm_swiglu.cpp's rms_norm(x, weight, eps), add_rms_norm(x, delta, weight, eps) and swiglu(gate_up)
using RmsNorm = torch::Tensor (*)(torch::Tensor, torch::Tensor, double);
using AddRmsNorm = std::tuple<torch::Tensor, torch::Tensor> (*)(torch::Tensor, torch::Tensor, torch::Tensor, double);
using Swiglu = torch::Tensor (*)(torch::Tensor);

template <typename Fn>
struct Name;
template <>
struct Name<Linear> { static constexpr const char* value = "specdec.entry.linear"; };
template <>
struct Name<Attend> { static constexpr const char* value = "specdec.entry.attend"; };
template <>
struct Name<RmsNorm> { static constexpr const char* value = "specdec.entry.rms_norm"; };
template <>
struct Name<AddRmsNorm> { static constexpr const char* value = "specdec.entry.add_rms_norm"; };
template <>
struct Name<Swiglu> { static constexpr const char* value = "specdec.entry.swiglu"; };

template <typename Fn>
pybind11::capsule capsule(Fn fn) {
  return pybind11::capsule(reinterpret_cast<void*>(fn), Name<Fn>::value);
}

template <typename Fn>
Fn function(const pybind11::capsule& capsule) {
  const char* name = capsule.name();
  TORCH_CHECK(name != nullptr && std::strcmp(name, Name<Fn>::value) == 0, "expected a capsule ", Name<Fn>::value,
              ", got ", name ? name : "an unnamed one");
  return reinterpret_cast<Fn>(capsule.get_pointer());
}

}  // namespace specdec::entry
