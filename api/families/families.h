// The model families (api/model_family.h) and what their descriptions share. Only the
// files of api/families/ include this.
// Thread-safety: immutable singletons and pure functions.

#pragma once

#include <string>
#include <vector>

#include "api/model_family.h"

namespace meshtrain::api {

const ModelFamily& Gpt2();
const ModelFamily& Llama();
const ModelFamily& Mistral();
const ModelFamily& Qwen2();
const ModelFamily& Qwen3();
const ModelFamily& Mixtral();
const ModelFamily& Qwen3Moe();

// config.json's layer_types (transformers' per-layer attention kinds), refused by key
// where a layer is not "full_attention": sliding attention is not implemented.
void RefuseSlidingLayers(const nlohmann::json& j, const ConfigKeys& k);

// "vocabSize V, seqLen T" and " of P" where the window is not max_positions.
std::string DescribeWindow(const ModelShape& s);

// Elements of what attention keeps for its backward: the (B,NH,T,T) probabilities of a
// block on the CPU, one statistic per row, (B,NH,T), for fused (flash) attention and for
// ring attention across a context group (EngineTypes::context > 1).
int64_t AttentionStateElements(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t);

// A block's backward working set around the family's MLP gradients `mlp`: "dresidual"
// (the residual stream's gradient) first, a projection's output, a norm's output
// gradient, the MLP's, attention's output and q, k and v gradients, with dropout a
// masked gradient and attention's output after dropout, and attention's scratch.
std::vector<Buffer> ScratchAround(int batch, int seq, const ModelShape& s, int tp_size, const EngineTypes& t,
                                  bool dropout, const std::vector<Buffer>& mlp);

}  // namespace meshtrain::api
