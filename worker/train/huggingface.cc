#include "worker/train/huggingface.h"

#include <algorithm>
#include <cmath>
#include <regex>
#include <set>

#include "worker/model/parameters.h"
#include "worker/train/safetensors.h"

namespace meshtrain::train {
namespace {

using model::Param;

struct HfName {
  std::string name;
  bool transposed;  // a Conv1D weight: (in, out)
};

HfName NameOf(const model::ParamTensor& t) {
  const std::string h = "h." + std::to_string(t.layer) + ".";
  switch (t.kind) {
    case Param::kWte: return {"wte.weight", false};
    case Param::kWpe: return {"wpe.weight", false};
    case Param::kLnfW: return {"ln_f.weight", false};
    case Param::kLnfB: return {"ln_f.bias", false};
    case Param::kLn1W: return {h + "ln_1.weight", false};
    case Param::kLn1B: return {h + "ln_1.bias", false};
    case Param::kQkvW: return {h + "attn.c_attn.weight", true};
    case Param::kQkvB: return {h + "attn.c_attn.bias", false};
    case Param::kAttProjW: return {h + "attn.c_proj.weight", true};
    case Param::kAttProjB: return {h + "attn.c_proj.bias", false};
    case Param::kLn2W: return {h + "ln_2.weight", false};
    case Param::kLn2B: return {h + "ln_2.bias", false};
    case Param::kFcW: return {h + "mlp.c_fc.weight", true};
    case Param::kFcB: return {h + "mlp.c_fc.bias", false};
    case Param::kFcProjW: return {h + "mlp.c_proj.weight", true};
    case Param::kFcProjB: return {h + "mlp.c_proj.bias", false};
  }
  return {"?", false};
}

// The shape Hugging Face stores `t` in.
std::vector<int64_t> HfShape(const model::ParamTensor& t, bool transposed) {
  return transposed ? std::vector<int64_t>{t.shape[1], t.shape[0]} : t.shape;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

}  // namespace

api::ModelShape HuggingFaceGpt2Shape(const std::string& path, int64_t head_dim) {
  const std::map<std::string, Tensor> tensors = ReadSafetensors(path);
  auto find = [&](const std::string& name) -> const Tensor& {
    for (const char* prefix : {"", "transformer."}) {
      const auto it = tensors.find(std::string(prefix) + name);
      if (it != tensors.end() && it->second.shape.size() == 2) return it->second;
    }
    throw SafetensorsError(path + ": no two-dimensional tensor " + name + "; not a GPT-2 in Hugging Face's layout");
  };
  api::ModelShape shape;
  shape.vocab_size = find("wte.weight").shape[0];
  shape.hidden = find("wte.weight").shape[1];
  shape.seq_len = find("wpe.weight").shape[0];
  while (tensors.contains("h." + std::to_string(shape.layers) + ".ln_1.weight") ||
         tensors.contains("transformer.h." + std::to_string(shape.layers) + ".ln_1.weight")) {
    ++shape.layers;
  }
  if (shape.layers == 0) throw SafetensorsError(path + ": no h.0.ln_1.weight; not a GPT-2 in Hugging Face's layout");
  if (head_dim <= 0 || shape.hidden % head_dim != 0) {
    throw SafetensorsError(path + ": hidden size " + std::to_string(shape.hidden) + " is not a multiple of heads of " +
                           std::to_string(head_dim));
  }
  shape.heads = shape.hidden / head_dim;
  return shape;
}

std::vector<float> LoadHuggingFaceGpt2(const std::string& path, const api::ModelShape& shape) {
  std::map<std::string, Tensor> file = ReadSafetensors(path);
  // GPT2LMHeadModel saves its body under "transformer.".
  std::map<std::string, Tensor> tensors;
  for (auto& [name, t] : file) {
    tensors[name.starts_with("transformer.") ? name.substr(12) : name] = std::move(t);
  }
  static const std::regex ignored(R"(lm_head\.weight|h\.\d+\.attn\.(masked_)?bias)");
  const model::ParameterLayout layout(shape);
  std::vector<float> weights(size_t(layout.total()));
  std::set<std::string> used;
  for (const model::ParamTensor& t : layout.tensors()) {
    const HfName hf = NameOf(t);
    const auto found = tensors.find(hf.name);
    if (found == tensors.end()) throw SafetensorsError(path + ": tensor " + hf.name + " is missing");
    const std::vector<int64_t> want = HfShape(t, hf.transposed);
    if (found->second.shape != want) {
      throw SafetensorsError(path + ": tensor " + hf.name + " has shape " + ShapeText(found->second.shape) +
                             ", but spec.model needs " + ShapeText(want));
    }
    const std::vector<float>& v = found->second.values;
    // A NaN or infinity would only show as a diverged loss at the first step.
    if (const auto bad = std::find_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); }); bad != v.end()) {
      throw SafetensorsError(path + ": tensor " + hf.name + " holds " + std::to_string(*bad) + " at element " +
                             std::to_string(bad - v.begin()) + ": the weights are not finite");
    }
    float* out = weights.data() + t.offset;
    if (!hf.transposed) {
      std::copy(v.begin(), v.end(), out);
    } else {
      const int64_t rows = t.shape[0], cols = t.shape[1];  // ours: (out, in)
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = v[size_t(c * rows + r)];
      }
    }
    used.insert(hf.name);
  }
  for (const auto& [name, t] : tensors) {
    if (!used.contains(name) && !std::regex_match(name, ignored)) {
      throw SafetensorsError(path + ": tensor " + name + " is not part of a GPT-2 of this shape");
    }
  }
  return weights;
}

void SaveHuggingFaceGpt2(const std::string& path, const std::vector<float>& weights, const api::ModelShape& shape) {
  const model::ParameterLayout layout(shape);
  std::map<std::string, Tensor> tensors;
  for (const model::ParamTensor& t : layout.tensors()) {
    const HfName hf = NameOf(t);
    Tensor out{HfShape(t, hf.transposed), std::vector<float>(size_t(t.size))};
    const float* in = weights.data() + t.offset;
    if (!hf.transposed) {
      std::copy(in, in + t.size, out.values.begin());
    } else {
      const int64_t rows = t.shape[0], cols = t.shape[1];
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) out.values[size_t(c * rows + r)] = in[r * cols + c];
      }
    }
    tensors.emplace(hf.name, std::move(out));
  }
  WriteSafetensors(path, tensors, {{"format", "pt"}});
}

}  // namespace meshtrain::train
