// GPT-2 weights in Hugging Face's safetensors layout, in and out (transformers' GPT2Model
// names, with or without a "transformer." prefix):
//   wte.weight (V,C)  wpe.weight (T,C)  ln_f.{weight,bias}
//   h.N.ln_1.{weight,bias}  h.N.attn.c_attn.{weight (C,3C), bias}  h.N.attn.c_proj.{weight (C,C), bias}
//   h.N.ln_2.{weight,bias}  h.N.mlp.c_fc.{weight (C,4C), bias}   h.N.mlp.c_proj.{weight (4C,C), bias}
// Hugging Face's Conv1D keeps weights as (in, out), the transpose of ours (out, in). The LM
// head is tied to wte; lm_head.weight and the attention-mask buffers are ignored on import.
// Thread-safety: plain functions.

#pragma once

#include <string>
#include <vector>

#include "api/model_shape.h"

namespace meshtrain::train {

// The weights of a model of `shape`, in ParameterLayout order, from the file at `path`.
// Throws SafetensorsError naming the file and the tensor for a missing or misshapen
// tensor, an unknown one, or a file that is not safetensors.
std::vector<float> LoadHuggingFaceGpt2(const std::string& path, const api::ModelShape& shape);

// The shape of the GPT-2 in the file at `path`: layers from the h.N tensors, hidden and
// vocabulary from wte, sequence length from wpe. Heads are not in the weights: GPT-2's
// sizes all use heads of `head_dim` (64). Throws SafetensorsError naming the file.
api::ModelShape HuggingFaceGpt2Shape(const std::string& path, int64_t head_dim = 64);

// Writes `weights` (ParameterLayout order, a model of `shape`) to `path` in that layout.
void SaveHuggingFaceGpt2(const std::string& path, const std::vector<float>& weights, const api::ModelShape& shape);

}  // namespace meshtrain::train
