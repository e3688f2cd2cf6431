// The float8 linear layers of each family's block (api::Float8LinearProducts and
// api::BlockFloat8FlopsPerToken): which products float8 training casts, their (k, n) and
// how tensor parallelism splits them. The tables here are written out per family, apart
// from the families' own descriptions: GPT-2's qkv, attention projection, fc and fc
// projection; the Llama class's q/k/v as one product, o, gate and up as one, and down
// (Mistral, Qwen2 and Qwen3 alike); a mixture's attention only.

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "api/engine_memory.h"
#include "api/model_family.h"
#include "api/model_shape.h"

namespace meshtrain::api {
namespace {

// A linear layer: (tokens x k) by (k x n); column-parallel layers split n, row-parallel
// ones k.
struct Layer {
  int64_t k = 0, n = 0;
  bool column = true;
};

std::vector<Layer> ExpectedLayers(const ModelShape& shape) {
  const ModelShape s = shape.Resolved();
  const int64_t C = s.hidden, Q = s.QueryWidth(), KV = s.KvWidth();
  if (s.family == "gpt2") {
    const int64_t I = s.Intermediate();
    return {{C, 3 * C, true}, {C, C, false}, {C, I, true}, {I, C, false}};
  }
  std::vector<Layer> layers = {{C, Q + 2 * KV, true}, {Q, C, false}};
  if (s.experts == 0) {
    const int64_t I = s.Intermediate();
    layers.insert(layers.end(), {{C, 2 * I, true}, {I, C, false}});
  }
  return layers;
}

// Each layer's forward (OC, N, K), input gradient (K, N, OC) and weight gradient (K, OC, N).
std::vector<Float8Product> ExpectedProducts(int batch, int seq, const ModelShape& shape, int tp) {
  const int64_t N = int64_t(batch) * seq;
  std::vector<Float8Product> products;
  for (const Layer& l : ExpectedLayers(shape)) {
    const int64_t K = l.column ? l.k : l.k / tp, OC = l.column ? l.n / tp : l.n;
    for (const Float8Product p : {Float8Product{OC, N, K}, Float8Product{K, N, OC}, Float8Product{K, OC, N}}) {
      products.push_back(p);
    }
  }
  return products;
}

std::string Text(const std::vector<Float8Product>& products) {
  std::string text;
  for (const Float8Product& p : products) {
    text += "(" + std::to_string(p.m) + "," + std::to_string(p.n) + "," + std::to_string(p.k) + ")";
  }
  return text;
}

bool Splits(const ModelShape& shape, int tp) {
  for (const Layer& l : ExpectedLayers(shape)) {
    if ((l.column ? l.n : l.k) % tp != 0) return false;
  }
  return true;
}

TEST(Float8Layers, EveryPresetCastsItsFamilysLinearLayersSplitByTheirParallelism) {
  int checked = 0;
  for (const ModelFamily* family : Families()) {
    for (const ModelFamily::Preset& preset : family->Presets()) {
      for (const int tp : {1, 2, 4, 8}) {
        if (!Splits(preset.shape, tp)) continue;
        for (const auto& [batch, seq] : {std::pair{1, 64}, std::pair{4, 2048}}) {
          SCOPED_TRACE(std::string(preset.name) + " tp " + std::to_string(tp) + " " + std::to_string(batch) + "x" +
                       std::to_string(seq));
          EXPECT_EQ(Text(Float8LinearProducts(batch, seq, preset.shape, tp)),
                    Text(ExpectedProducts(batch, seq, preset.shape, tp)));
        }
        double weights = 0;
        for (const Layer& l : ExpectedLayers(preset.shape)) weights += double(l.k) * double(l.n);
        EXPECT_EQ(BlockFloat8FlopsPerToken(preset.shape, tp), 2 * weights / tp) << preset.name << " tp " << tp;
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 40);
}

// The numbers themselves, for one model of each kind.
TEST(Float8Layers, PinnedNumbers) {
  // Llama 3.2 1B (C 2048, q 2048, k and v 512 each, I 8192) at 4 x 2048 rows on TP 2.
  EXPECT_EQ(Text(Float8LinearProducts(4, 2048, *FindPreset("llama3.2-1b"), 2)),
            "(1536,8192,2048)(2048,8192,1536)(2048,1536,8192)"    // q, k and v
            "(2048,8192,1024)(1024,8192,2048)(1024,2048,8192)"    // o
            "(8192,8192,2048)(2048,8192,8192)(2048,8192,8192)"    // gate and up
            "(2048,8192,4096)(4096,8192,2048)(4096,2048,8192)");  // down
  EXPECT_EQ(BlockFloat8FlopsPerToken(*FindPreset("llama3.2-1b"), 2), 2.0 * (2048.0 * 3072 + 2048.0 * 2048 +
                                                                           2048.0 * 16384 + 8192.0 * 2048) / 2);
  // GPT-2 124M (C 768, I 3072): 12 C^2 weights.
  EXPECT_EQ(Text(Float8LinearProducts(1, 1024, *FindPreset("gpt2-124m"), 1)),
            "(2304,1024,768)(768,1024,2304)(768,2304,1024)"
            "(768,1024,768)(768,1024,768)(768,768,1024)"
            "(3072,1024,768)(768,1024,3072)(768,3072,1024)"
            "(768,1024,3072)(3072,1024,768)(3072,768,1024)");
  EXPECT_EQ(BlockFloat8FlopsPerToken(*FindPreset("gpt2-124m"), 1), 2.0 * 12 * 768 * 768);
  // Qwen3 0.6B: q 16 x 128 = 2048 wider than C 1024; k and v 8 x 128; I 3072.
  EXPECT_EQ(BlockFloat8FlopsPerToken(*FindPreset("qwen3-0.6b"), 1),
            2.0 * (1024.0 * 4096 + 2048.0 * 1024 + 1024.0 * 6144 + 3072.0 * 1024));
  // Mixtral 8x7B: attention only (C 4096, q 4096, k and v 1024 each).
  EXPECT_EQ(Text(Float8LinearProducts(1, 2048, *FindPreset("mixtral-8x7b"), 1)),
            "(6144,2048,4096)(4096,2048,6144)(4096,6144,2048)"
            "(4096,2048,4096)(4096,2048,4096)(4096,4096,2048)");
  EXPECT_EQ(BlockFloat8FlopsPerToken(*FindPreset("mixtral-8x7b"), 1), 2.0 * (4096.0 * 6144 + 4096.0 * 4096));
  // Qwen3-MoE's tiny preset: attention only, whatever its dense width.
  EXPECT_EQ(Text(Float8LinearProducts(1, 64, *FindPreset("qwen3-moe-tiny"), 1)),
            "(128,64,64)(64,64,128)(64,128,64)"
            "(64,64,64)(64,64,64)(64,64,64)");
}

// Which products the GPU table runs through fp32 sums ('S'; '-' straight into the output),
// layer by layer: forward, input gradient, weight gradient.
std::string Sums(const std::vector<Float8Product>& products) {
  std::string text;
  for (size_t i = 0; i < products.size(); ++i) {
    if (i > 0 && i % 3 == 0) text += ' ';
    text += products[i].sums ? 'S' : '-';
  }
  return text;
}

// Tensorwise, a product keeps sums where its epilogue works on it: GPT-2's biases (a
// row-parallel layer's on TP rank 0 only), the residual stream on one TP rank, fc's GELU
// and the fc projection's GELU backward; rowwise, every product keeps them.
TEST(Float8Layers, ProductsKeepSumsWhereTheirEpilogueOrScalesNeedThem) {
  const ModelShape& gpt2 = *FindPreset("gpt2-124m");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, gpt2, 1)), "S-- S-- S-- SS-");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, gpt2, 2, {.tp_rank = 0})), "S-- S-- S-- SS-");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, gpt2, 2, {.tp_rank = 1})), "S-- --- S-- -S-");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, gpt2, 2, {.rowwise = true, .tp_rank = 1})), "SSS SSS SSS SSS");
  const ModelShape& llama = *FindPreset("llama3.2-1b");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, llama, 1)), "--- S-- --- S--");  // o and down add the residual
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, llama, 2)), "--- --- --- ---");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, llama, 2, {.rowwise = true})), "SSS SSS SSS SSS");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, *FindPreset("qwen2.5-0.5b"), 2)), "S-- --- --- ---");  // q, k, v biases
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, *FindPreset("qwen3-0.6b"), 1)), "--- S-- --- S--");
  EXPECT_EQ(Sums(Float8LinearProducts(1, 64, *FindPreset("mixtral-8x7b"), 1)), "--- S--");
}

// The GPU table's scratch: its largest product, with sums where that product keeps them.
// Llama 3.2 1B at 4 x 2048 rows on TP 2: the gate-and-up layer's input gradient (m 2048,
// n 8192, k 8192) and weight gradient (2048, 8192 over 8192) each cast 16 + 64 MiB of
// codes; tensorwise neither keeps sums (80 MiB and 512 bytes of descales and alignment),
// rowwise each keeps 64 MiB (8192 rows of 2048 floats).
TEST(Float8Layers, KernelScratchIsTheLargestProductWithItsOwnSums) {
  const ModelShape& llama = *FindPreset("llama3.2-1b");
  EXPECT_EQ(Float8KernelScratchBytes(4, 2048, llama, 2, {.rowwise = false}), (int64_t{80} << 20) + 512);
  EXPECT_EQ(Float8KernelScratchBytes(4, 2048, llama, 2, {.rowwise = true}), (int64_t{144} << 20) + 512);
  // On one rank the largest is gate and up's input gradient (32 + 128 MiB of codes, no
  // sums), above down's forward, which adds the residual (16 + 64 MiB, and 64 MiB of sums).
  EXPECT_EQ(Float8KernelScratchBytes(4, 2048, llama, 1, {.rowwise = false}), (int64_t{160} << 20) + 512);
  EXPECT_EQ(Float8ProductBytes({2048, 8192, 8192}, true), (int64_t{144} << 20) + 512);
}

// Rowwise, a scale per row or column of each operand: as many as the rows, or the widest
// K or OC of a float8 layer on the rank.
TEST(Float8Layers, ScaleWidthIsTheWidestOperandOfAFloat8Layer) {
  EXPECT_EQ(Float8ScaleWidth(1, 64, *FindPreset("llama3.2-1b"), 2, false), 1);
  EXPECT_EQ(Float8ScaleWidth(1, 64, *FindPreset("llama3.2-1b"), 2, true), 8192);  // gate and up: 2 x 8192 / 2
  EXPECT_EQ(Float8ScaleWidth(4, 2048, *FindPreset("llama3.2-1b"), 2, true), 8192);  // the rows
  EXPECT_EQ(Float8ScaleWidth(4, 4096, *FindPreset("llama3.2-1b"), 2, true), 16384);
  EXPECT_EQ(Float8ScaleWidth(1, 64, *FindPreset("gpt2-124m"), 1, true), 3072);  // fc's 4 x 768
  EXPECT_EQ(Float8ScaleWidth(1, 64, *FindPreset("mixtral-8x7b"), 1, true), 6144);  // q, k and v; not the experts
}

}  // namespace
}  // namespace meshtrain::api
