// The families' parameters and math (worker/model/): the layout of the flat buffer (units,
// TP slices, the padded vocabulary) against what the planner counts, initialisation as a
// pure function of (seed, tensor, element), and the whole model, run by the reference
// (tests/support/model_reference.h) over each family's layers (model/model.h): gradients
// against finite differences in fp64, fp32 and bf16 against fp64, accumulation, and
// inputs it refuses. GPT-2, and the Llama class: an untied head with grouped-query
// attention whose heads are wider than hidden / heads, and Qwen2's biased q, k and v with
// one key/value head and a tied head, each under its kind of RoPE scaling.

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "api/engine_memory.h"
#include "api/model_shape.h"
#include "tests/support/model_reference.h"
#include "worker/model/parameters.h"

namespace meshtrain::model {
namespace {

using kernels::Bf16;
using kernels::Fp32;
using kernels::Fp64;
using testing::ModelReference;

const api::ModelShape kTiny{.layers = 2, .heads = 2, .hidden = 8, .vocab_size = 11, .seq_len = 6};
// theta 10, so that the rotations are large at positions 0 to 5.
const api::ModelShape kLlama{.layers = 2, .heads = 4, .hidden = 8, .vocab_size = 11, .seq_len = 6,
                             .family = "llama", .kv_heads = 2, .head_dim = 4, .intermediate = 12,
                             .max_positions = 32, .norm_eps = 1e-5, .rope_theta = 10,
                             .rope_scaling = {"llama3", 4, 1, 4, 16}, .tied = false};
const api::ModelShape kQwen{.layers = 2, .heads = 2, .hidden = 8, .vocab_size = 11, .seq_len = 6,
                            .family = "qwen2", .kv_heads = 1, .head_dim = 4, .intermediate = 12,
                            .max_positions = 32, .norm_eps = 1e-6, .rope_theta = 10,
                            .rope_scaling = {"linear", 2, 1, 4, 8192}, .tied = true};
const api::ModelShape kFamilies[] = {kTiny, kLlama, kQwen};
constexpr int B = 2, Tn = 5;

std::vector<int32_t> Tokens(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(B * Tn);
  for (int32_t& x : t) x = int32_t(rng() % kTiny.vocab_size);
  return t;
}

// The elements of the padding rows of wte in a layout.
int64_t PaddingElements(const ParameterLayout& layout) {
  const auto [begin, end] = layout.VocabRange();
  return (layout.padded_vocab_rows() - (end - begin)) * layout.shape().hidden;
}

TEST(ModelLayout, UnitsTileTheBufferAndMatchTheParameterCount) {
  for (std::string_view name : api::PresetNames()) {
    const api::ModelShape& shape = *api::FindPreset(name);
    for (int multiple : {1, 128}) {
      const ParameterLayout layout(shape, 0, 1, multiple);
      EXPECT_EQ(layout.padded_vocab_rows(), api::PaddedVocabRows(shape.vocab_size, multiple)) << name;
      EXPECT_EQ(layout.padded_vocab_rows() % multiple, 0) << name;
      // The buffer is the model and wte's padding rows, nothing else.
      EXPECT_EQ(layout.total(), shape.ParameterCount() + PaddingElements(layout)) << name << " multiple " << multiple;
      if (multiple == 1) {
        EXPECT_EQ(PaddingElements(layout), 0) << name;
      }
      int64_t expect_begin = 0;
      for (int u = 0; u < layout.units(); ++u) {
        const auto [begin, end] = layout.Unit(u);
        EXPECT_EQ(begin, expect_begin) << name << " unit " << u;
        EXPECT_GT(end, begin);
        expect_begin = end;
      }
      EXPECT_EQ(expect_begin, layout.total()) << name;
    }
  }
  EXPECT_EQ(ParameterLayout(*api::FindPreset("gpt2-124m"), 0, 1, 128).padded_vocab_rows(), 50304);
}

// The planner's memory model counts units with api::UnitElementsOf; it must be what
// the layout the engine shards holds, on every TP rank of every preset, padded or not, and
// of a Qwen3-MoE with dense blocks (units of two sizes).
TEST(ModelLayout, UnitSizesAreTheOnesThePlannerCounts) {
  std::vector<std::pair<std::string, api::ModelShape>> shapes;
  for (std::string_view name : api::PresetNames()) shapes.emplace_back(std::string(name), *api::FindPreset(name));
  api::ModelShape dense_blocks = *api::FindPreset("qwen3-moe-tiny");
  dense_blocks.layers = 5, dense_blocks.decoder_sparse_step = 2, dense_blocks.mlp_only_layers = {3};
  shapes.emplace_back("qwen3-moe-tiny, dense blocks 0 2 3 4", dense_blocks);
  ASSERT_EQ(dense_blocks.DenseBlocks(), 4);
  for (const auto& [name, shape] : shapes) {
    for (int multiple : {1, 128}) {
      for (int tp : {1, 2, 4}) {
        if (shape.heads % tp != 0 || shape.KvHeads() % tp != 0) continue;
        for (int t = 0; t < tp; ++t) {
          const ParameterLayout layout(shape, t, tp, multiple);
          const api::UnitElements expected = api::UnitElementsOf(shape, t, tp, multiple);
          const std::string where = std::string(name) + " tp " + std::to_string(t) + "/" + std::to_string(tp) +
                                    " multiple " + std::to_string(multiple);
          EXPECT_EQ(layout.Unit(0).second - layout.Unit(0).first, expected.embedding) << where;
          for (int u = 1; u <= layout.blocks(); ++u) {
            const int64_t block = shape.DenseBlock(u - 1) ? expected.dense_block : expected.block;
            ASSERT_EQ(layout.Unit(u).second - layout.Unit(u).first, block) << where << " unit " << u;
            EXPECT_EQ(layout.UnitHasExperts(u), !shape.DenseBlock(u - 1) && shape.experts > 0) << where << " unit " << u;
          }
          EXPECT_EQ(expected.dense_block > 0, shape.DenseBlocks() > 0) << where;
          EXPECT_EQ(layout.has_head_unit(), expected.head > 0) << where;
          if (layout.has_head_unit()) {
            EXPECT_EQ(layout.Unit(layout.head_unit()).second - layout.Unit(layout.head_unit()).first, expected.head)
                << where;
          }
        }
      }
    }
  }
}

// wte's padding rows are zero at init, map to no element of the model (-1), and are
// skipped by RealRanges; every other element of every TP slice maps to the model, so
// that the slices together hold each element of the single-rank model exactly once (a
// tensor every rank holds whole: once per rank).
TEST(ModelLayout, PaddingRowsAreZeroMapToNothingAndTheSlicesCoverTheModelOnce) {
  const api::ModelShape shape{.layers = 2, .heads = 4, .hidden = 8, .vocab_size = 11, .seq_len = 6};
  const ParameterLayout whole(shape);
  for (int multiple : {1, 4, 128}) {
    for (int T : {1, 2, 4}) {
      std::vector<int> covered(size_t(whole.total()), 0);
      int64_t padding_seen = 0;
      for (int t = 0; t < T; ++t) {
        const ParameterLayout slice(shape, t, T, multiple);
        const std::string where = "multiple " + std::to_string(multiple) + ", tp " + std::to_string(t) + "/" +
                                  std::to_string(T);
        std::vector<float> init(size_t(slice.total()), 1.0f);
        InitParameters(init.data(), slice, 3);
        const std::vector<int64_t> at = slice.WholeIndices(0, slice.total());
        ASSERT_EQ(int64_t(at.size()), slice.total()) << where;
        // The runs RealRanges gives are exactly the elements that map to the model.
        std::vector<bool> real(at.size(), false);
        for (const auto& [a, b] : slice.RealRanges(0, slice.total())) {
          ASSERT_LT(a, b) << where;
          for (int64_t i = a; i < b; ++i) real[size_t(i)] = true;
        }
        const ParamTensor& wte = slice.tensors()[0];
        ASSERT_EQ(wte.kind, Param::kWte);
        for (int64_t i = 0; i < slice.total(); ++i) {
          const bool padding = i >= wte.offset + wte.real && i < wte.offset + wte.size;
          EXPECT_EQ(at[size_t(i)] < 0, padding) << where << " element " << i;
          EXPECT_EQ(real[size_t(i)], !padding) << where << " element " << i;
          if (padding) {
            EXPECT_EQ(init[size_t(i)], 0.0f) << where << " padding element " << i;
            EXPECT_EQ(slice.GlobalIndex(wte, i - wte.offset), -1) << where;
            ++padding_seen;
          } else {
            ++covered[size_t(at[size_t(i)])];
          }
        }
        EXPECT_EQ(wte.size - wte.real, PaddingElements(slice)) << where;
      }
      if (multiple == 1) {
        EXPECT_EQ(padding_seen, 0);
      }
      if (multiple == 128) {
        EXPECT_GT(padding_seen, 0);
      }
      const ParameterLayout rank0(shape, 0, T, multiple);
      for (size_t id = 0; id < whole.tensors().size(); ++id) {
        const ParamTensor& t = whole.tensors()[id];
        const int want = rank0.tensors()[id].tp_replicated() ? T : 1;
        for (int64_t i = 0; i < t.size; ++i) {
          ASSERT_EQ(covered[size_t(t.offset + i)], want) << t.name << " element " << i << ", T=" << T;
        }
      }
    }
  }
}

TEST(ModelInit, IsAPureFunctionOfSeedTensorAndIndex) {
  const ParameterLayout layout(kTiny);
  std::vector<float> a(layout.total()), b(layout.total());
  InitParameters(a.data(), layout, 42);
  InitParameters(b.data(), layout, 42);
  EXPECT_EQ(a, b);
  // Any element can be recomputed alone, as a shard would.
  const ParamTensor& qkv = layout.tensors()[6];
  ASSERT_EQ(qkv.name, "h0.qkv.w");
  for (int64_t i : {int64_t(0), qkv.size / 2, qkv.size - 1}) {
    EXPECT_EQ(a[qkv.offset + i], float(0.02 * CounterNormal(42, 6, uint64_t(i))));
    std::vector<float> one(1);
    InitParameterRange(one.data(), layout, 42, qkv.offset + i, qkv.offset + i + 1);
    EXPECT_EQ(one[0], a[qkv.offset + i]);
  }
  InitParameters(b.data(), layout, 43);
  EXPECT_NE(a, b);
  // Padding does not move any element's value: the padded layout's model elements are
  // the unpadded ones.
  const ParameterLayout padded(kTiny, 0, 1, 8);
  std::vector<float> p(size_t(padded.total()));
  InitParameters(p.data(), padded, 42);
  const std::vector<int64_t> at = padded.WholeIndices(0, padded.total());
  for (size_t i = 0; i < at.size(); ++i) {
    if (at[i] >= 0) {
      ASSERT_EQ(p[i], a[size_t(at[i])]) << "element " << i;
    }
  }
  // Statistics of a large tensor: mean 0, stddev 0.02.
  const ParameterLayout big(*api::FindPreset("gpt2-tiny"));
  std::vector<float> q(big.total());
  InitParameters(q.data(), big, 1);
  const ParamTensor& wte = big.tensors()[0];
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < wte.size; ++i) sum += q[wte.offset + i], sq += double(q[wte.offset + i]) * q[wte.offset + i];
  EXPECT_NEAR(sum / wte.size, 0.0, 1e-3);
  EXPECT_NEAR(std::sqrt(sq / wte.size), 0.02, 5e-4);
  EXPECT_EQ(q[big.Offset(Param::kLnfW)], 1.0f);
  EXPECT_EQ(q[big.Offset(Param::kQkvB, 0)], 0.0f);
}

// A TP slice initialises exactly its elements of the single-rank model: every element of
// the whole model lands in exactly one slice (or, for a tensor every rank holds whole,
// in all of them), bit for bit, including a vocabulary the group does not divide, padded.
TEST(ModelInit, TensorParallelSlicesAreTheSingleRankModelBitForBit) {
  const api::ModelShape shape{.layers = 2, .heads = 4, .hidden = 8, .vocab_size = 11, .seq_len = 6};
  const ParameterLayout whole(shape);
  std::vector<float> reference(size_t(whole.total()));
  InitParameters(reference.data(), whole, 5);
  for (int multiple : {1, 4}) {
    for (int T : {2, 4}) {
      std::vector<int> covered(size_t(whole.total()), 0);
      for (int t = 0; t < T; ++t) {
        const ParameterLayout slice(shape, t, T, multiple);
        std::vector<float> local(size_t(slice.total()));
        InitParameterRange(local.data(), slice, 5, 0, slice.total());
        ASSERT_EQ(slice.tensors().size(), whole.tensors().size());
        for (size_t id = 0; id < slice.tensors().size(); ++id) {
          const ParamTensor& part = slice.tensors()[id];
          const ParamTensor& full = whole.tensors()[id];
          for (int64_t i = 0; i < part.real; ++i) {
            const int64_t at = full.offset + slice.GlobalIndex(part, i);
            ASSERT_GE(slice.GlobalIndex(part, i), 0) << part.name << " element " << i;
            ASSERT_LT(at, full.offset + full.size) << part.name << " element " << i;
            EXPECT_EQ(local[size_t(part.offset + i)], reference[size_t(at)])
                << part.name << " element " << i << " of tp " << t;
            ++covered[size_t(at)];
          }
        }
      }
      for (const ParamTensor& t : whole.tensors()) {
        const bool replicated = ParameterLayout(shape, 0, T).tensors()[size_t(&t - whole.tensors().data())].tp_replicated();
        for (int64_t i = 0; i < t.size; ++i) {
          ASSERT_EQ(covered[size_t(t.offset + i)], replicated ? T : 1) << t.name << " element " << i << ", T=" << T;
        }
      }
    }
  }
}

TEST(ModelLayout, ATensorParallelDegreeThatDoesNotDivideTheHeadsNamesTheField) {
  const api::ModelShape shape{.layers = 1, .heads = 6, .hidden = 12, .vocab_size = 11, .seq_len = 6};
  try {
    ParameterLayout(shape, 0, 4);
    ADD_FAILURE() << "4 ranks split 6 heads";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spec.parallelism.tensorParallelDegree: must divide spec.model.heads (6), got 4"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(ParameterLayout(shape, 2, 3).VocabRange(), (std::pair<int64_t, int64_t>{7, 11}));
  EXPECT_EQ(ParameterLayout(shape, 2, 3, 8).padded_vocab_rows(), 8);  // 4 real rows, padded to 8
}

// Central differences of the loss against the reference's analytic gradients, in fp64,
// with a padded vocabulary (11 rows padded to 16): the padding's logits must not take
// part in the softmax, or the loss and every gradient would move.
TEST(ModelGradients, WholeModelMatchesFiniteDifferences) {
  for (const api::ModelShape& shape : kFamilies) {
  SCOPED_TRACE(api::DescribeShape(shape));
  ModelReference<Fp64> model(shape, B, Tn, 7, /*vocab_multiple=*/8);
  ASSERT_EQ(model.layout().padded_vocab_rows(), 16);
  // Larger weights than at init, so that every path carries signal.
  std::vector<double> params = model.Params();
  for (double& p : params) p *= 10;
  model.SetParams(params);
  const auto inputs = Tokens(1), targets = Tokens(2);
  model.ZeroGrad();
  const ModelReference<Fp64>::Training training{};
  const double loss = model.Forward(inputs.data(), targets.data(), B, Tn, &training);
  EXPECT_GT(loss, 0);
  EXPECT_EQ(model.Forward(inputs.data(), targets.data(), B, Tn), loss) << "training and evaluation differ in loss";
  model.ZeroGrad();
  model.Forward(inputs.data(), targets.data(), B, Tn, &training);
  model.Backward();
  const std::vector<double> analytic = model.Grads();
  const double h = 1e-5;
  for (const ParamTensor& t : model.layout().tensors()) {
    for (int64_t i : {int64_t(0), t.real / 3, t.real - 1}) {
      double& p = params[size_t(t.offset + i)];
      const double saved = p;
      p = saved + h;
      model.SetParams(params);
      const double plus = model.Forward(inputs.data(), targets.data(), B, Tn);
      p = saved - h;
      model.SetParams(params);
      const double minus = model.Forward(inputs.data(), targets.data(), B, Tn);
      p = saved;
      const double numeric = (plus - minus) / (2 * h);
      // Truncation error of central differences at these weights is ~1e-6 relative.
      EXPECT_NEAR(analytic[size_t(t.offset + i)], numeric, 1e-5 * std::max(1.0, std::abs(numeric)))
          << t.name << "[" << i << "]";
    }
  }
  model.SetParams(params);
  for (const ParamTensor& t : model.layout().tensors()) {
    if (t.split != TpSplit::kVocab) continue;  // the embedding's padding rows, and an untied head's
    for (int64_t i = t.real; i < t.size; ++i) EXPECT_EQ(analytic[size_t(t.offset + i)], 0.0) << t.name << " padding " << i;
  }
  }
}

// Relative L2 distance of `got` from `want`.
template <class T>
double RelativeL2(const std::vector<T>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

// The same model in fp32 and in the bf16 emulation against fp64, from the same (fp32)
// weights. fp32: sums of a few hundred terms keep ~1e-6 relative, so 1e-5 on the loss
// and 1e-4 of the largest gradient leave room. bf16 stores 8 significant bits (2^-9 =
// 2e-3 relative per value): the loss, a mean over rows of log-softmaxes whose rounding
// errors partly cancel, stays within 1e-3 (measured: 5e-6); the gradients, products of
// several rounded factors through the whole backward, within 5e-2 in relative L2
// (measured: 7e-3). Either is far tighter than what a wrong index or a missed term gives.
TEST(ModelPrecision, Fp32AndBf16MatchTheFp64Reference) {
  for (const api::ModelShape& shape : kFamilies) {
  SCOPED_TRACE(api::DescribeShape(shape));
  ModelReference<Fp64> ref(shape, B, Tn, 3);
  ModelReference<Fp32> fp32(shape, B, Tn, 3);
  ModelReference<Bf16> bf16(shape, B, Tn, 3);
  const std::vector<float> weights = fp32.Params();
  ref.SetParams(std::vector<double>(weights.begin(), weights.end()));
  EXPECT_EQ(bf16.Params(), weights) << "the same masters";
  const auto inputs = Tokens(5), targets = Tokens(6);
  const ModelReference<Fp64>::Training training64{};
  const ModelReference<Fp32>::Training training32{};
  const ModelReference<Bf16>::Training training16{};
  const double ref_loss = ref.Forward(inputs.data(), targets.data(), B, Tn, &training64);
  const double loss32 = fp32.Forward(inputs.data(), targets.data(), B, Tn, &training32);
  const double loss16 = bf16.Forward(inputs.data(), targets.data(), B, Tn, &training16);
  EXPECT_NEAR(loss32, ref_loss, 1e-5 * ref_loss);
  EXPECT_NEAR(loss16, ref_loss, 1e-3 * ref_loss);
  EXPECT_NE(loss16, loss32) << "the emulation rounded nothing";
  EXPECT_NEAR(ref_loss, std::log(double(kTiny.vocab_size)), 0.1);  // near-uniform predictions at init
  ref.Backward();
  fp32.Backward();
  bf16.Backward();
  const std::vector<double> want = ref.Grads();
  const std::vector<float> got32 = fp32.Grads();
  double scale = 0;
  for (double g : want) scale = std::max(scale, std::abs(g));
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got32[i], want[i], 1e-4 * scale) << i;
  EXPECT_LT(RelativeL2(bf16.Grads(), want), 5e-2);
  const std::vector<double> p64 = ref.NextTokenProbabilities(inputs.data(), Tn);
  const std::vector<double> p32 = fp32.NextTokenProbabilities(inputs.data(), Tn);
  for (size_t v = 0; v < p64.size(); ++v) EXPECT_NEAR(p32[v], p64[v], 1e-6) << "token " << v;
  }
}

TEST(ModelBehaviour, GradientsAccumulateAndInputsAreChecked) {
  ModelReference<Fp64> model(kTiny, B, Tn, 9);
  const auto inputs = Tokens(1), targets = Tokens(2);
  const ModelReference<Fp64>::Training training{};
  model.ZeroGrad();
  model.Forward(inputs.data(), targets.data(), B, Tn, &training);
  model.Backward();
  const std::vector<double> once = model.Grads();
  model.Forward(inputs.data(), targets.data(), B, Tn, &training);
  model.Backward();
  const std::vector<double> twice = model.Grads();
  double largest = 0;
  for (size_t i = 0; i < once.size(); ++i) {
    largest = std::max(largest, std::abs(once[i]));
    ASSERT_NEAR(twice[i], 2 * once[i], 1e-12 + 1e-9 * std::abs(once[i])) << i;
  }
  EXPECT_GT(largest, 0);
  // The loss weight scales the gradient: two half-weighted micro-batches are one whole.
  const ModelReference<Fp64>::Training half{0.5f};
  model.ZeroGrad();
  EXPECT_NEAR(2 * model.Forward(inputs.data(), targets.data(), B, Tn, &half),
              model.Forward(inputs.data(), targets.data(), B, Tn), 1e-12);
  model.ZeroGrad();
  for (int micro = 0; micro < 2; ++micro) {
    model.Forward(inputs.data(), targets.data(), B, Tn, &half);
    model.Backward();
  }
  const std::vector<double> halves = model.Grads();
  for (size_t i = 0; i < once.size(); ++i) ASSERT_NEAR(halves[i], once[i], 1e-12 + 1e-9 * std::abs(once[i])) << i;

  EXPECT_THROW(model.Backward(), std::logic_error) << "a Backward without its Forward";
  model.Forward(inputs.data(), targets.data(), B, Tn);
  EXPECT_THROW(model.Backward(), std::logic_error) << "an evaluation forward has no backward";
  std::vector<int32_t> bad = inputs;
  bad[3] = int32_t(kTiny.vocab_size);
  EXPECT_THROW(model.Forward(bad.data(), targets.data(), B, Tn), std::out_of_range);
  bad[3] = -1;
  EXPECT_THROW(model.Forward(inputs.data(), bad.data(), B, Tn), std::out_of_range);
  EXPECT_THROW(model.Forward(inputs.data(), targets.data(), B + 1, Tn), std::invalid_argument);
  EXPECT_THROW(ModelReference<Fp64>(kTiny, B, int(kTiny.seq_len) + 1, 1), std::invalid_argument);
}

// Document attention (model.h, Documents): a window that packs documents computes what
// each document computes alone, from position 0 (GPT-2's learned positions and RoPE's
// alike): every token's prediction, the losses' sum and the sum of the documents'
// gradients. Documents of 2, 1
// and 3 tokens in one sequence, 4 and 2 in the other.
TEST(ModelDocuments, APackedWindowIsItsDocumentsEachAlone) {
  constexpr int T = 6, N = 2 * T;
  const Documents documents{{{0, 2, 3}, {0, 4}}};
  for (const api::ModelShape& shape : kFamilies) {
    SCOPED_TRACE(api::DescribeShape(shape));
    ModelReference<Fp64> packed(shape, 2, T, 3, 1, {}, /*documents=*/true);
    ModelReference<Fp64> alone(shape, 1, T, 3);
    std::mt19937_64 rng(11);
    std::vector<int32_t> inputs(N), targets(N);
    for (int32_t& x : inputs) x = int32_t(rng() % shape.vocab_size);
    for (int32_t& x : targets) x = int32_t(rng() % shape.vocab_size);
    // Each document: sequence b, rows [start, end).
    struct Document {
      int b, start, end;
    };
    std::vector<Document> each;
    for (int b = 0; b < 2; ++b) {
      const std::vector<int64_t>& starts = documents.starts[size_t(b)];
      for (size_t i = 0; i < starts.size(); ++i) {
        each.push_back({b, int(starts[i]), i + 1 < starts.size() ? int(starts[i + 1]) : T});
      }
    }
    // Every token's prediction (the whole distribution, so its loss for any target):
    // the window's first t + 1 rows with their documents, against its document's alone.
    for (const Document& doc : each) {
      for (int t = doc.start; t < doc.end; ++t) {
        Documents prefix;
        prefix.starts.resize(1);
        for (int64_t start : documents.starts[size_t(doc.b)]) {
          if (start <= t) prefix.starts[0].push_back(start);
        }
        packed.set_documents(&prefix);
        const std::vector<double> got = packed.NextTokenProbabilities(inputs.data() + doc.b * T, t + 1);
        const std::vector<double> want =
            alone.NextTokenProbabilities(inputs.data() + doc.b * T + doc.start, t - doc.start + 1);
        for (size_t v = 0; v < want.size(); ++v) {
          ASSERT_NEAR(got[v], want[v], 1e-12) << "sequence " << doc.b << " row " << t << " token " << v;
        }
      }
    }
    packed.set_documents(&documents);
    packed.ZeroGrad();
    alone.ZeroGrad();
    const ModelReference<Fp64>::Training sum{float(N)};  // weights 1: the losses' sum
    double want = 0;
    for (const Document& doc : each) {
      const int n = doc.end - doc.start;
      const ModelReference<Fp64>::Training mine{float(n)};
      want += alone.Forward(inputs.data() + doc.b * T + doc.start, targets.data() + doc.b * T + doc.start, 1, n, &mine);
      alone.Backward();
    }
    EXPECT_NEAR(packed.Forward(inputs.data(), targets.data(), 2, T, &sum), want, 1e-12 * want);
    packed.Backward();
    const std::vector<double> got = packed.Grads(), expected = alone.Grads();
    double scale = 0;
    for (double g : expected) scale = std::max(scale, std::abs(g));
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-12 * scale) << i;
    packed.set_documents(nullptr);  // causal attention over the window sees across documents
    EXPECT_GT(std::abs(packed.Forward(inputs.data(), targets.data(), 2, T, &sum) - want), 1e-3);
  }
}

TEST(ModelDocuments, SegmentsCutAtChunksAndDocuments) {
  const Documents documents{{{0, 3, 5}}};
  // One rank: the documents.
  std::vector<Segment> s = SegmentsOf(documents, 1, 8, 0, 1);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[1].row, 3);
  EXPECT_EQ(s[1].rows, 2);
  EXPECT_EQ(s[2].position(), 0);
  // Rank 1 of 2 holds chunks 1 (rows 2, 3) and 2 (rows 4, 5) of 4 chunks of 2.
  s = SegmentsOf(documents, 1, 4, 1, 2);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].whole, 2);
  EXPECT_EQ(s[0].start, 0);
  EXPECT_EQ(s[0].position(), 2);
  EXPECT_EQ(s[1].whole, 3);
  EXPECT_EQ(s[1].position(), 0);
  EXPECT_EQ(s[2].row, 2);
  EXPECT_EQ(s[2].whole, 4);
  EXPECT_EQ(s[2].start, 3);
  EXPECT_EQ(s[2].position(), 1);
  EXPECT_EQ(s[3].whole, 5);
  EXPECT_EQ(s[3].position(), 0);
  EXPECT_THROW(SegmentsOf({{{1}}}, 1, 4, 0, 1), std::invalid_argument);
  EXPECT_THROW(SegmentsOf({{{0, 2, 2}}}, 1, 4, 0, 1), std::invalid_argument);
  EXPECT_THROW(SegmentsOf({{{0, 4}}}, 1, 4, 0, 1), std::invalid_argument);
  EXPECT_THROW(SegmentsOf(documents, 2, 8, 0, 1), std::invalid_argument);
}

}  // namespace
}  // namespace meshtrain::model
