// The elementwise steps between a decoder layer's matrix products (AVX-512, or AVX2 with FMA: simd.h): RMSNorm
// (after the residual add, in one pass) and SwiGLU's silu(gate) · up. PyTorch runs each as several ops of ~10–30 µs
// at one row (a 1.5B int8 forward spent ~3 ms of its ~37 in them); here each is one call per layer.
// Every row is computed on its own in a fixed order, so its result never depends on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "kernel_entry.h"
#include "simd.h"

namespace {

namespace simd = specdec::simd;
using simd::kLanes;
using simd::lane_mask;

constexpr int64_t kSwigluPiece = 1024;  // columns: a multiple of kLanes

torch::Tensor rows_of(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() >= 1, what, ": float32 input expected");
  return x.contiguous().view({-1, x.size(-1)});
}

// out = x · (1 / sqrt(mean(x²) + eps)) · weight, as PyTorch's rms_norm (the sum of squares in 16 lanes, then across)
void norm_row(const float* x, const float* weight, int64_t h, float eps, float* out) {
  simd::Vec squares = simd::zero();
  for (int64_t c = 0; c < h; c += kLanes) {
    const simd::Vec v = simd::load(lane_mask(h - c), x + c);
    squares = simd::fmadd(v, v, squares);
  }
  const simd::Vec inv_rms = simd::broadcast(1.0f / std::sqrt(simd::reduce_add(squares) / static_cast<float>(h) + eps));
  for (int64_t c = 0; c < h; c += kLanes) {
    const simd::Mask m = lane_mask(h - c);
    const simd::Vec v = simd::mul(simd::load(m, x + c), inv_rms);
    simd::store(out + c, m, simd::mul(v, simd::load(m, weight + c)));
  }
}

torch::Tensor checked_weight(const torch::Tensor& weight, int64_t h) {
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.numel() == h, "rms_norm: float32 weight of ", h, " expected");
  return weight.contiguous();
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const auto rows = rows_of(x, "rms_norm");
  const int64_t t = rows.size(0), h = rows.size(1);
  weight = checked_weight(weight, h);
  auto out = torch::empty_like(rows);
  const float *in = rows.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(in + r * h, w, h, static_cast<float>(eps), o + r * h);
  });
  return out.view(x.sizes());
}

// (x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight,
                                                      double eps) {
  TORCH_CHECK(x.sizes() == delta.sizes(), "add_rms_norm: x and delta differ in shape");
  const auto rows = rows_of(x, "add_rms_norm"), deltas = rows_of(delta, "add_rms_norm");
  const int64_t t = rows.size(0), h = rows.size(1);
  weight = checked_weight(weight, h);
  auto sum = torch::empty_like(rows), out = torch::empty_like(rows);
  const float *a = rows.data_ptr<float>(), *b = deltas.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *s = sum.data_ptr<float>(), *o = out.data_ptr<float>();
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < h; c += kLanes) {
        const simd::Mask m = lane_mask(h - c);
        simd::store(s + r * h + c, m, simd::add(simd::load(m, a + r * h + c), simd::load(m, b + r * h + c)));
      }
      norm_row(s + r * h, w, h, static_cast<float>(eps), o + r * h);
    }
  });
  return {sum.view(x.sizes()), out.view(x.sizes())};
}

// gate_up [.., 2I] (gate, then up) → silu(gate) · up [.., I] (simd::swiglu)
torch::Tensor swiglu(torch::Tensor gate_up) {
  const auto rows = rows_of(gate_up, "swiglu");
  TORCH_CHECK(rows.size(1) % 2 == 0, "swiglu: gate and up halves expected, got ", rows.size(1), " features");
  const int64_t t = rows.size(0), inner = rows.size(1) / 2;
  auto out = torch::empty({t, inner}, rows.options());
  const float* in = rows.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // pieces of kSwigluPiece columns of a row, so that both threads share even one row's work (one row of the 1.5B:
  // 5.2 µs a call on one thread, hot; 4 rows 14.3 µs)
  const int64_t pieces = (inner + kSwigluPiece - 1) / kSwigluPiece;
  at::parallel_for(0, t * pieces, 2, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / pieces, first = task % pieces * kSwigluPiece;
      const float *gate = in + r * 2 * inner, *up = gate + inner;
      for (int64_t c = first; c < std::min(inner, first + kSwigluPiece); c += kLanes) {
        const simd::Mask m = lane_mask(inner - c);
        simd::store(o + r * inner + c, m, simd::swiglu(simd::load(m, gate + c), simd::load(m, up + c)));
      }
    }
  });
  auto shape = gate_up.sizes().vec();
  shape.back() = inner;
  return out.view(shape);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("rms_norm", &rms_norm);
  module.def("add_rms_norm", &add_rms_norm);
  module.def("swiglu", &swiglu);
  // the layer loop's entries (kernel_entry.h)
  module.attr("rms_norm_entry") = specdec::entry::capsule<specdec::entry::RmsNorm>(&rms_norm);
  module.attr("add_rms_norm_entry") = specdec::entry::capsule<specdec::entry::AddRmsNorm>(&add_rms_norm);
  module.attr("swiglu_entry") = specdec::entry::capsule<specdec::entry::Swiglu>(&swiglu);
}
