// nanobind module `diffuserve._core`: the C++ Model and Sequence, with numpy in and out.
// The Python package (python/diffuserve) wraps these with argument conversion; the heavy
// work runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "diffuserve/diffuserve.h"

namespace nb = nanobind;
using namespace diffuserve;

using IdArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using LogitsIn = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

namespace {

// A numpy array that owns a std::vector's storage.
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape, owner);
}

std::span<const int32_t> ids_of(const IdArray& a) { return {a.data(), a.shape(0)}; }

nb::dict config_dict(const ModelConfig& c) {
  nb::dict d;
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["num_layers"] = c.num_layers;
  d["num_heads"] = c.num_heads;
  d["num_experts"] = c.num_experts;
  d["top_k_experts"] = c.top_k_experts;
  d["sliding_window"] = c.sliding_window;
  d["canvas_length"] = c.canvas_length;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["final_logit_softcapping"] = c.final_logit_softcapping;
  nb::list layer_types;
  for (const auto& L : c.layers) layer_types.append(L.sliding ? "sliding_attention" : "full_attention");
  d["layer_types"] = layer_types;
  const GenerationDefaults& g = c.generation;
  nb::dict gen;
  gen["max_new_tokens"] = g.max_new_tokens;
  gen["max_denoising_steps"] = g.max_denoising_steps;
  gen["t_min"] = g.t_min;
  gen["t_max"] = g.t_max;
  gen["entropy_bound"] = g.entropy_bound;
  gen["stability_threshold"] = g.stability_threshold;
  gen["confidence_threshold"] = g.confidence_threshold;
  gen["eos_token_ids"] = g.eos_token_ids;
  d["generation"] = gen;
  return d;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "diffuserve native runtime";
  nb::exception<FormatError>(m, "CheckpointError", PyExc_ValueError);

  nb::class_<Model>(m, "Model")
      .def_static(
          "load",
          [](const std::string& path, const std::string& device, const std::string& dtype, int num_threads) {
            nb::gil_scoped_release release;
            return Model::load(path, LoadOptions{device, dtype, num_threads});
          },
          nb::arg("path"), nb::arg("device") = "cpu", nb::arg("dtype") = "", nb::arg("num_threads") = 0)
      .def_prop_ro("config", [](const Model& self) { return config_dict(self.config()); })
      .def_prop_ro("dtype", [](const Model& self) { return std::string(dtype_name(self.weight_dtype())); })
      .def_prop_ro("device", &Model::device)
      .def("sequence", &Model::new_sequence);

  nb::class_<Sequence>(m, "Sequence")
      .def("prefill",
           [](Sequence& self, IdArray ids) {
             nb::gil_scoped_release release;
             self.prefill(ids_of(ids));
           })
      .def("commit",
           [](Sequence& self, IdArray ids) {
             nb::gil_scoped_release release;
             self.commit(ids_of(ids));
           })
      .def(
          "denoise",
          [](Sequence& self, IdArray canvas, std::optional<LogitsIn> sc) {
            const int vocab = self.config().vocab_size;
            if (sc && (sc->shape(0) != canvas.shape(0) || sc->shape(1) != size_t(vocab)))
              throw InvalidArgument("denoise: self_conditioning_logits must have shape [" +
                                    std::to_string(canvas.shape(0)) + ", " + std::to_string(vocab) + "], got [" +
                                    std::to_string(sc->shape(0)) + ", " + std::to_string(sc->shape(1)) + "]");
            std::vector<float> logits;
            {
              nb::gil_scoped_release release;
              logits = self.denoise(ids_of(canvas), sc ? sc->data() : nullptr);
            }
            return to_numpy(std::move(logits), {canvas.shape(0), size_t(vocab)});
          },
          nb::arg("canvas"), nb::arg("self_conditioning_logits").none())
      .def("__len__", &Sequence::length)
      .def("kv", [](const Sequence& self, int layer) {
        LayerKV kv = self.kv(layer);
        const size_t h = kv.kv_heads, r = kv.rows, d = kv.head_dim;
        return nb::make_tuple(to_numpy(std::move(kv.keys), {h, r, d}), to_numpy(std::move(kv.values), {h, r, d}),
                              kv.first_position);
      });
}
