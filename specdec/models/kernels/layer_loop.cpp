// A decoder's layers in one call, for forwards whose every sequence runs its rows through row_attention.cpp (decoding,
// verification, token trees): the loop the decoder runs in Python, step for step, calling the same kernels through
// their C++ entries (kernel_entry.h), so its results are bitwise the Python loop's.
//
// Why: every large product streams more than the L3 and evicts the interpreter's and PyTorch's dispatcher's state, so
// each of the ~200 Python steps between a forward's products began on cold caches (the first op after a 110 MB
// product: 35–60 µs, against 2–3 µs hot; Zen 4 host, 32 MiB L3). Against the Python loop, the 1.5B's forwards of 1–8
// rows took 0.94–0.99 of the time in int8 and 0.96–0.98 in float32 (Zen 5 host, paired; BENCHMARKS.md, twenty-sixth
// session). This file makes no choice of its own and needs no instruction set: each kernel was built for its own.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "kernel_entry.h"

namespace {

namespace entry = specdec::entry;
namespace py = pybind11;

using Tensor = torch::Tensor;
using LinearSpec = std::tuple<py::capsule, std::vector<Tensor>, int64_t>;  // entry, operands, out features
// input norm (None: the layer reads its input unnormalized), qkv, o, post-attention norm, gate/up, down, and whether
// the gate/up product applies SwiGLU itself
using LayerSpec = std::tuple<std::optional<Tensor>, LinearSpec, LinearSpec, Tensor, LinearSpec, LinearSpec, bool>;
// one sequence of the forward: its new rows, the tokens its slot holds before them, each row's tree path (none:
// causal; as row_attention.cpp takes them) and its slot's keys and values, layer by layer
using Sequence = std::tuple<int64_t, int64_t, std::vector<std::vector<int64_t>>, std::vector<std::pair<Tensor, Tensor>>>;

struct Linear {
  entry::Linear fn;
  std::vector<Tensor> operands;
  int64_t out_features;

  explicit Linear(const LinearSpec& spec)
      : fn(entry::function<entry::Linear>(std::get<0>(spec))), operands(std::get<1>(spec)), out_features(std::get<2>(spec)) {}
  Tensor operator()(const Tensor& x) const { return fn(x, operands, out_features); }
};

struct Layer {
  std::optional<Tensor> input_norm;
  Linear qkv, o;
  Tensor post_norm;
  Linear gate_up, down;
  bool gate_up_applies_swiglu;

  explicit Layer(const LayerSpec& spec)
      : input_norm(std::get<0>(spec)), qkv(std::get<1>(spec)), o(std::get<2>(spec)), post_norm(std::get<3>(spec)),
        gate_up(std::get<4>(spec)), down(std::get<5>(spec)), gate_up_applies_swiglu(std::get<6>(spec)) {}
};

class LayerStack {
 public:
  LayerStack(const std::vector<LayerSpec>& layers, std::optional<Tensor> final_norm, double eps, double scale,
             const py::capsule& attend, const py::capsule& rms_norm, const py::capsule& add_rms_norm,
             const py::capsule& swiglu)
      : final_norm_(std::move(final_norm)), eps_(eps), scale_(scale), attend_(entry::function<entry::Attend>(attend)),
        rms_norm_(entry::function<entry::RmsNorm>(rms_norm)),
        add_rms_norm_(entry::function<entry::AddRmsNorm>(add_rms_norm)), swiglu_(entry::function<entry::Swiglu>(swiglu)) {
    layers_.reserve(layers.size());
    for (const auto& spec : layers) layers_.emplace_back(spec);
  }

  // x [T, hidden] (the sequences' rows in turn), cos and sin [T, head_dim] → (the final norm's output [T, hidden], the
  // residual stream after each layer of `hidden_layers`, in layer order). The sequences' caches get their new keys
  // and values; their lengths are the caller's to advance.
  std::tuple<Tensor, std::vector<Tensor>> forward(Tensor x, const Tensor& cos, const Tensor& sin,
                                                  const std::vector<Sequence>& sequences,
                                                  const std::vector<int64_t>& hidden_layers) const {
    check(x, sequences);
    std::vector<Tensor> layer_hidden;
    // a layer's MLP output joins the residual stream in the next norm's call, as in the Python loop
    std::optional<Tensor> mlp;
    Tensor h;
    for (size_t index = 0; index < layers_.size(); ++index) {
      const Layer& layer = layers_[index];
      std::tie(x, h) = residual_norm(x, mlp, layer.input_norm);
      const Tensor attention = attend(layer.qkv(h), cos, sin, sequences, index);
      std::tie(x, h) = add_rms_norm_(x, layer.o(attention), layer.post_norm, eps_);
      const Tensor gate_up = layer.gate_up(h);
      mlp = layer.down(layer.gate_up_applies_swiglu ? gate_up : swiglu_(gate_up));
      if (std::find(hidden_layers.begin(), hidden_layers.end(), static_cast<int64_t>(index)) != hidden_layers.end()) {
        x = x + *mlp;
        mlp.reset();
        layer_hidden.push_back(x);
      }
    }
    return {std::get<1>(residual_norm(x, mlp, final_norm_)), std::move(layer_hidden)};
  }

 private:
  void check(const Tensor& x, const std::vector<Sequence>& sequences) const {
    TORCH_CHECK(x.dim() == 2, "layer loop: x [T, hidden] expected");
    int64_t rows = 0;
    for (const auto& [n, cached, paths, views] : sequences) {
      TORCH_CHECK(n > 0 && cached >= 0, "layer loop: a sequence needs new rows");
      TORCH_CHECK(views.size() == layers_.size(), "layer loop: ", views.size(), " layers of KV views for ",
                  layers_.size(), " layers");
      rows += n;
    }
    TORCH_CHECK(!sequences.empty() && rows == x.size(0), "layer loop: the sequences hold ", rows, " rows, x ",
                x.size(0));
  }

  // (x + delta, its RMSNorm), delta and the norm each optional (none: nothing to add, or no norm)
  std::tuple<Tensor, Tensor> residual_norm(const Tensor& x, const std::optional<Tensor>& delta,
                                           const std::optional<Tensor>& weight) const {
    if (!weight) {
      const Tensor sum = delta ? x + *delta : x;
      return {sum, sum};
    }
    if (!delta) return {x, rms_norm_(x, *weight, eps_)};
    return add_rms_norm_(x, *delta, *weight, eps_);
  }

  Tensor attend(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const std::vector<Sequence>& sequences,
                size_t layer) const {
    if (sequences.size() == 1) {  // plain decoding and verification take the tensors whole
      const auto& [n, cached, paths, views] = sequences[0];
      return attend_(qkv, cos, sin, views[layer].first, views[layer].second, cached, paths, scale_);
    }
    std::vector<Tensor> outputs;
    outputs.reserve(sequences.size());
    int64_t start = 0;
    for (const auto& [n, cached, paths, views] : sequences) {
      outputs.push_back(attend_(qkv.narrow(0, start, n), cos.narrow(0, start, n), sin.narrow(0, start, n),
                                views[layer].first, views[layer].second, cached, paths, scale_));
      start += n;
    }
    return torch::cat(outputs);
  }

  std::vector<Layer> layers_;
  std::optional<Tensor> final_norm_;
  double eps_, scale_;
  entry::Attend attend_;
  entry::RmsNorm rms_norm_;
  entry::AddRmsNorm add_rms_norm_;
  entry::Swiglu swiglu_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  py::class_<LayerStack>(module, "LayerStack")
      .def(py::init<const std::vector<LayerSpec>&, std::optional<Tensor>, double, double, const py::capsule&,
                    const py::capsule&, const py::capsule&, const py::capsule&>())
      // the kernels touch no Python object: other threads (the server's) run meanwhile
      .def("forward", &LayerStack::forward, py::call_guard<py::gil_scoped_release>());
}
