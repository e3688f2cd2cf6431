// Attention by blocks (kernels/ops.h: AttentionBlockForward, AttentionMerge,
// AttentionRowDot, AttentionBlockBackward, for ring context parallelism) of a table
// against the CPU's Fp64 table, with the fixture and tolerances of
// tests/support/ops_conformance.h:
//
// - Blocks: grouped-query heads (NH 4 over KVH 2; also NH = KVH), B = 2, head sizes 8, 40
//   and 128 (one, two and four channels a lane on the GPU, and heads that are not whole
//   warps), Tq and Tk of several sizes, both masks. The table under test reads and writes
//   its operands where strides put them, inside larger buffers (q, k and v in a packed
//   qkv, rows padded, statistics apart), while the reference reads compact arrays: what
//   lies outside a block must be left as it was, and every element inside written.
// - Merge: partial results with empty ones (lse = -inf) on either side or both.
// - The ring: a causal sequence of T rows in 2C chunks, rank c holding chunks c and
//   2C-1-c (the load-balanced assignment), the key/value chunks passed round the ring;
//   each query chunk's blocks (kNone against every earlier key chunk, kCausal against its
//   own) merged in the ring's order, from an empty accumulator, equal AttentionForward
//   on the whole sequence, and the blocks' backward, summed, AttentionBackward's dqkv.
//
// A table is checked by instantiating the suite as OpsConformance is:
//
//   INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, AttentionBlocksConformance, ::testing::Types<CpuBf16>);

#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tests/support/ops_conformance.h"

namespace meshtrain::testing {

// Where a block operand lies in a flat buffer of `size` elements: element (b, t, c) of its
// compact (B,T,width) array at base + b * batch + t * row + c; for statistics (compact
// (B,NH,T)), (b, h, t) at base + b * batch + h * row + t.
struct BlockOperand {
  int64_t base = 0, row = 0, batch = 0, size = 0;

  kernels::AttentionRows Rows() const { return {row, batch}; }
  kernels::AttentionStats Stats() const { return {row, batch}; }

  // An operand alone, compact.
  static BlockOperand Compact(int B, int T, int64_t width) { return {0, width, T * width, B * T * width}; }
  static BlockOperand CompactStats(int B, int NH, int T) { return {0, T, int64_t(NH) * T, int64_t(B) * NH * T}; }

  // The buffer positions of the compact array's elements, in its order.
  std::vector<int64_t> Indices(int B, int T, int64_t width) const {
    std::vector<int64_t> at;
    for (int b = 0; b < B; ++b) {
      for (int t = 0; t < T; ++t) {
        for (int64_t c = 0; c < width; ++c) at.push_back(base + b * batch + t * row + c);
      }
    }
    return at;
  }
  std::vector<int64_t> StatIndices(int B, int NH, int T) const {
    std::vector<int64_t> at;
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < NH; ++h) {
        for (int t = 0; t < T; ++t) at.push_back(base + b * batch + h * row + t);
      }
    }
    return at;
  }
};

template <class Impl>
class AttentionBlocksConformance : public OpsConformance<Impl> {
 protected:
  static constexpr double kEmpty = -std::numeric_limits<double>::infinity();
  static constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

  // values as T stores them.
  template <class T>
  static std::vector<double> Rounded(std::vector<double> values) {
    for (double& v : values) v = OpsSide<kernels::Fp64>::ToDouble(OpsSide<typename Impl::Precision>::template Convert<T>(v));
    return values;
  }
  static std::vector<double> Scatter(std::vector<double> buffer, const std::vector<int64_t>& at,
                                     const std::vector<double>& compact) {
    for (size_t i = 0; i < at.size(); ++i) buffer[size_t(at[i])] = compact[i];
    return buffer;
  }
  static std::vector<double> Gather(const std::vector<double>& buffer, const std::vector<int64_t>& at) {
    std::vector<double> compact(at.size());
    for (size_t i = 0; i < at.size(); ++i) compact[i] = buffer[size_t(at[i])];
    return compact;
  }
  // Every element of got outside `at` as it was in `before` (NaN stays NaN).
  static void ExpectUntouched(const std::vector<double>& got, const std::vector<double>& before,
                              const std::vector<int64_t>& at, const std::string& what) {
    std::vector<bool> inside(got.size(), false);
    for (int64_t i : at) inside[size_t(i)] = true;
    for (size_t i = 0; i < got.size(); ++i) {
      if (inside[i]) continue;
      const bool same = std::isnan(before[i]) ? std::isnan(got[i]) : got[i] == before[i];
      ASSERT_TRUE(same) << what << ": element " << i << " outside the block changed from " << before[i] << " to "
                        << got[i];
    }
  }
  // As ExpectClose, where want may hold -inf (empty results): got has -inf there too.
  void ExpectCloseOrEmpty(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    std::vector<double> finite_got, finite_want;
    for (size_t i = 0; i < got.size(); ++i) {
      if (want[i] == kEmpty) {
        ASSERT_EQ(got[i], kEmpty) << what << ": element " << i << " should be empty (-inf)";
      } else {
        finite_got.push_back(got[i]);
        finite_want.push_back(want[i]);
      }
    }
    this->ExpectClose(finite_got, finite_want, what);
  }
  static std::vector<double> Minus(std::vector<double> a, const std::vector<double>& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
    return a;
  }
};

TYPED_TEST_SUITE_P(AttentionBlocksConformance);

// One block, forward, RowDot and backward, compact on the reference and compact or
// strided into larger buffers on the table under test. The backward's lse and D are the
// reference's (rounded to Acc), so both sides get the same inputs, and those of a final
// result the block is one part of.
TYPED_TEST_P(AttentionBlocksConformance, BlockForwardAndBackward) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  using kernels::AttentionBlock;
  using kernels::AttentionMask;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  struct Case {
    int Tq, Tk, NH, KVH, HS;
    AttentionMask mask;
  };
  const Case cases[] = {{5, 7, 4, 2, 8, AttentionMask::kNone},    {8, 8, 4, 2, 8, AttentionMask::kNone},
                        {13, 4, 4, 2, 8, AttentionMask::kNone},   {1, 9, 4, 2, 8, AttentionMask::kNone},
                        {1, 1, 4, 2, 8, AttentionMask::kCausal},  {7, 7, 4, 2, 8, AttentionMask::kCausal},
                        {16, 16, 4, 2, 8, AttentionMask::kCausal}, {6, 11, 4, 4, 40, AttentionMask::kNone},
                        {9, 9, 4, 2, 40, AttentionMask::kCausal}, {5, 6, 2, 1, 128, AttentionMask::kNone},
                        {6, 6, 2, 2, 128, AttentionMask::kCausal}};
  const int B = 2;
  for (const Case& c : cases) {
    for (bool packed : {false, true}) {
      const int64_t Q = int64_t(c.NH) * c.HS, KH = int64_t(c.KVH) * c.HS, W = Q + 2 * KH;
      const bool causal = c.mask == AttentionMask::kCausal;
      const std::string at = std::string(packed ? " (strided" : " (compact") + ", Tq " + std::to_string(c.Tq) +
                             ", Tk " + std::to_string(c.Tk) + ", " + std::to_string(c.NH) + " query heads over " +
                             std::to_string(c.KVH) + " of " + std::to_string(c.HS) + (causal ? ", causal)" : ")");
      // The reference: compact arrays.
      const auto q = this->template Random<Act>(B * c.Tq * Q), k = this->template Random<Act>(B * c.Tk * KH),
                 v = this->template Random<Act>(B * c.Tk * KH), dout = this->template Random<Act>(B * c.Tq * Q);
      const AttentionBlock compact = AttentionBlock::Contiguous(B, c.Tq, c.Tk, c.NH, c.KVH, c.HS, c.mask);
      auto ref_out = ref.template Poisoned<double>(B * c.Tq * Q), ref_lse = ref.template Poisoned<double>(B * c.NH * c.Tq);
      ref.ops->AttentionBlockForward(ref_out, ref_lse, ref.template Put<double>(q), ref.template Put<double>(k),
                                     ref.template Put<double>(v), compact, *ref.stream);
      const auto want_out = ref.Get(ref_out, B * c.Tq * Q), want_lse = ref.Get(ref_lse, B * c.NH * c.Tq);
      // The block as one of several: the final output as stored near the block's, and
      // the final lse above the block's (more keys, a larger denominator).
      std::vector<double> final_out = this->template Random<Act>(B * c.Tq * Q, 0.3),
                          final_lse = this->template Random<Acc>(B * c.NH * c.Tq, 0.5);
      for (size_t i = 0; i < final_out.size(); ++i) final_out[i] += want_out[i];
      for (size_t i = 0; i < final_lse.size(); ++i) final_lse[i] = want_lse[i] + std::abs(final_lse[i]);
      final_out = this->template Rounded<Act>(final_out);
      auto ref_D = ref.template Poisoned<double>(B * c.NH * c.Tq);
      ref.ops->AttentionRowDot(ref_D, ref.template Put<double>(dout), ref.template Put<double>(final_out), compact,
                               *ref.stream);
      const auto want_D = ref.Get(ref_D, B * c.NH * c.Tq);
      const auto lse_in = this->template Rounded<Acc>(final_lse), D_in = this->template Rounded<Acc>(want_D);
      const auto dq0 = this->template Random<Acc>(B * c.Tq * Q), dk0 = this->template Random<Acc>(B * c.Tk * KH),
                 dv0 = this->template Random<Acc>(B * c.Tk * KH);
      auto ref_dq = ref.template Put<double>(dq0), ref_dk = ref.template Put<double>(dk0),
           ref_dv = ref.template Put<double>(dv0);
      ref.ops->AttentionBlockBackward(ref_dq, ref_dk, ref_dv, ref.template Put<double>(dout), ref.template Put<double>(q),
                                      ref.template Put<double>(k), ref.template Put<double>(v),
                                      ref.template Put<double>(lse_in), ref.template Put<double>(D_in), compact,
                                      *ref.stream);
      const auto want_dq = ref.Get(ref_dq, B * c.Tq * Q), want_dk = ref.Get(ref_dk, B * c.Tk * KH),
                 want_dv = ref.Get(ref_dv, B * c.Tk * KH);

      // The table under test: each operand where its layout puts it. Strided: a packed
      // qkv of T rows, keys from row s0 and queries from row t0 (after the keys, or the
      // same rows when causal); out, dout and the statistics in buffers of T rows with
      // padded rows; dq, dk and dv in an Acc buffer laid out as the qkv.
      const int s0 = causal ? 2 : 1, t0 = causal ? s0 : s0 + c.Tk + 1, T = t0 + c.Tq + 2;
      BlockOperand oq = BlockOperand::Compact(B, c.Tq, Q), ok = BlockOperand::Compact(B, c.Tk, KH), ov = ok;
      BlockOperand oout = oq, odout = oq, ostats = BlockOperand::CompactStats(B, c.NH, c.Tq), odq = oq, odk = ok,
                   odv = ok;
      if (packed) {
        const int64_t qkv_size = B * T * W, Wout = Q + 3, Wdout = Q + 2, head = T + 1;
        oq = {t0 * W, W, T * W, qkv_size};
        ok = {Q + s0 * W, W, T * W, qkv_size};
        ov = {Q + KH + s0 * W, W, T * W, qkv_size};
        oout = {t0 * Wout, Wout, T * Wout, B * T * Wout};
        odout = {t0 * Wdout, Wdout, T * Wdout, B * T * Wdout};
        ostats = {t0, head, c.NH * head + 2, B * (c.NH * head + 2)};
        odq = oq;
        odk = ok;
        odv = ov;
      }
      AttentionBlock shape = compact;
      shape.q = oq.Rows();
      shape.k = ok.Rows();
      shape.v = ov.Rows();
      shape.out = oout.Rows();
      shape.stats = ostats.Stats();
      shape.dout = odout.Rows();
      shape.dq = odq.Rows();
      shape.dk = odk.Rows();
      shape.dv = odv.Rows();
      const auto iq = oq.Indices(B, c.Tq, Q), ik = ok.Indices(B, c.Tk, KH), iv = ov.Indices(B, c.Tk, KH),
                 iout = oout.Indices(B, c.Tq, Q), idout = odout.Indices(B, c.Tq, Q),
                 istats = ostats.StatIndices(B, c.NH, c.Tq);
      // Inputs: q, k and v in one buffer when packed (filler between them), else apart.
      std::vector<double> qkv;
      impl.keep.clear();
      auto put_inputs = [&](BlockOperand o, const std::vector<int64_t>& idx, const std::vector<double>& values) {
        return impl.template Put<Act>(this->Scatter(this->template Random<Act>(o.size), idx, values));
      };
      runtime::DevicePtr<const Act> in_q, in_k, in_v;
      if (packed) {
        qkv = this->Scatter(this->Scatter(this->Scatter(this->template Random<Act>(oq.size), iq, q), ik, k), iv, v);
        auto all = impl.template Put<Act>(qkv);
        in_q = all;
        in_k = all;
        in_v = all;
      } else {
        in_q = put_inputs(oq, iq, q);
        in_k = put_inputs(ok, ik, k);
        in_v = put_inputs(ov, iv, v);
      }
      const std::vector<double> out_before(size_t(oout.size), TestFixture::kNaN),
          stats_before(size_t(ostats.size), TestFixture::kNaN);
      auto out = impl.template Put<Acc>(out_before), lse = impl.template Put<Acc>(stats_before);
      impl.ops->AttentionBlockForward(out + oout.base, lse + ostats.base, in_q + oq.base, in_k + ok.base,
                                      in_v + ov.base, shape, *impl.stream);
      const auto got_out = impl.Get(out, oout.size), got_lse = impl.Get(lse, ostats.size);
      this->ExpectUntouched(got_out, out_before, iout, "AttentionBlockForward out" + at);
      this->ExpectUntouched(got_lse, stats_before, istats, "AttentionBlockForward lse" + at);
      this->ExpectClose(this->Gather(got_out, iout), want_out, "AttentionBlockForward out" + at);
      this->ExpectClose(this->Gather(got_lse, istats), want_lse, "AttentionBlockForward lse" + at);

      auto D = impl.template Put<Acc>(stats_before);
      auto in_dout = put_inputs(odout, idout, dout), in_out = put_inputs(odout, idout, final_out);
      impl.ops->AttentionRowDot(D + ostats.base, in_dout + odout.base, in_out + odout.base, shape, *impl.stream);
      const auto got_D = impl.Get(D, ostats.size);
      this->ExpectUntouched(got_D, stats_before, istats, "AttentionRowDot" + at);
      this->ExpectClose(this->Gather(got_D, istats), want_D, "AttentionRowDot" + at);

      // dq, dk and dv start from random values, inside the block and out.
      std::vector<double> grads_before;  // packed: dq, dk and dv in one buffer
      runtime::DevicePtr<Acc> dq, dk, dv;
      if (packed) {
        grads_before = this->Scatter(
            this->Scatter(this->Scatter(this->template Random<Acc>(odq.size), iq, dq0), ik, dk0), iv, dv0);
        dq = dk = dv = impl.template Put<Acc>(grads_before);
      } else {
        dq = impl.template Put<Acc>(dq0);
        dk = impl.template Put<Acc>(dk0);
        dv = impl.template Put<Acc>(dv0);
      }
      auto in_stats = [&](const std::vector<double>& values) {
        return impl.template Put<Acc>(this->Scatter(std::vector<double>(size_t(ostats.size), 0.0), istats, values));
      };
      impl.ops->AttentionBlockBackward(dq + odq.base, dk + odk.base, dv + odv.base, in_dout + odout.base,
                                       in_q + oq.base, in_k + ok.base, in_v + ov.base, in_stats(lse_in) + ostats.base,
                                       in_stats(D_in) + ostats.base, shape, *impl.stream);
      const auto got_dq = impl.Get(dq, odq.size);
      const auto got_dk = packed ? got_dq : impl.Get(dk, odk.size);
      const auto got_dv = packed ? got_dq : impl.Get(dv, odv.size);
      if (packed) {
        std::vector<int64_t> all = iq;
        all.insert(all.end(), ik.begin(), ik.end());
        all.insert(all.end(), iv.begin(), iv.end());
        this->ExpectUntouched(got_dq, grads_before, all, "AttentionBlockBackward" + at);
      }
      // The increments, so that the starting values do not hide an error.
      this->ExpectClose(this->Minus(this->Gather(got_dq, iq), dq0), this->Minus(want_dq, dq0),
                        "AttentionBlockBackward dq (+=)" + at);
      this->ExpectClose(this->Minus(this->Gather(got_dk, ik), dk0), this->Minus(want_dk, dk0),
                        "AttentionBlockBackward dk (+=)" + at);
      this->ExpectClose(this->Minus(this->Gather(got_dv, iv), dv0), this->Minus(want_dv, dv0),
                        "AttentionBlockBackward dv (+=)" + at);
    }
  }
}

// A block with no keys is an empty result (out 0, lse -inf) and adds no gradient.
TYPED_TEST_P(AttentionBlocksConformance, BlockWithoutKeys) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  using kernels::AttentionBlock;
  auto& impl = this->impl_;
  const int B = 2, Tq = 3, NH = 4, KVH = 2, HS = 8, Q = NH * HS;
  const AttentionBlock shape = AttentionBlock::Contiguous(B, Tq, 0, NH, KVH, HS, kernels::AttentionMask::kNone);
  const auto q = this->template Random<Act>(B * Tq * Q), dout = q;
  auto out = impl.template Poisoned<Acc>(B * Tq * Q), lse = impl.template Poisoned<Acc>(B * NH * Tq);
  auto in_q = impl.template Put<Act>(q), kv = impl.template Put<Act>(this->template Random<Act>(1));
  impl.ops->AttentionBlockForward(out, lse, in_q, kv, kv, shape, *impl.stream);
  for (double x : impl.Get(out, B * Tq * Q)) ASSERT_EQ(x, 0.0) << "AttentionBlockForward out without keys";
  for (double x : impl.Get(lse, B * NH * Tq)) ASSERT_EQ(x, TestFixture::kEmpty) << "AttentionBlockForward lse without keys";
  const auto dq0 = this->template Random<Acc>(B * Tq * Q), stats = this->template Random<Acc>(B * NH * Tq);
  auto dq = impl.template Put<Acc>(dq0), dkv = impl.template Put<Acc>(this->template Random<Acc>(1));
  impl.ops->AttentionBlockBackward(dq, dkv, dkv, impl.template Put<Act>(dout), in_q, kv, kv,
                                   impl.template Put<Acc>(stats), impl.template Put<Acc>(stats), shape, *impl.stream);
  EXPECT_EQ(impl.Get(dq, B * Tq * Q), dq0) << "AttentionBlockBackward without keys changed dq";
}

// Partial results merged, with empty ones on either side, both, and neither; strided on
// the table under test, compact on the reference.
TYPED_TEST_P(AttentionBlocksConformance, BlockMerge) {
  using Acc = typename TestFixture::G;
  using kernels::AttentionBlock;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  const int B = 2, Tq = 7, NH = 4, KVH = 2;
  for (int HS : {8, 40}) {
    const int64_t Q = int64_t(NH) * HS;
    const std::string at = " (heads of " + std::to_string(HS) + ")";
    auto out0 = this->template Random<Acc>(B * Tq * Q), lse0 = this->template Random<Acc>(B * NH * Tq, 3.0);
    auto block_out = this->template Random<Acc>(B * Tq * Q), block_lse = this->template Random<Acc>(B * NH * Tq, 3.0);
    // Row (b, h, t) of each kind by t: 0 both empty, 1 the accumulator empty (its out NaN:
    // not read), 2 the block empty, the rest neither.
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < NH; ++h) {
        const size_t row = size_t((b * NH + h) * Tq);
        lse0[row + 0] = block_lse[row + 0] = TestFixture::kEmpty;
        lse0[row + 1] = TestFixture::kEmpty;
        for (int c = 0; c < HS; ++c) out0[size_t((b * Tq + 1) * Q + h * HS + c)] = TestFixture::kNaN;
        block_lse[row + 2] = TestFixture::kEmpty;
      }
    }
    const AttentionBlock compact = AttentionBlock::Contiguous(B, Tq, 5, NH, KVH, HS, kernels::AttentionMask::kNone);
    auto ref_out = ref.template Put<double>(out0), ref_lse = ref.template Put<double>(lse0);
    ref.ops->AttentionMerge(ref_out, ref_lse, ref.template Put<double>(block_out), ref.template Put<double>(block_lse),
                            compact, *ref.stream);
    const auto want_out = ref.Get(ref_out, B * Tq * Q), want_lse = ref.Get(ref_lse, B * NH * Tq);

    const int T = Tq + 3, t0 = 2;
    const int64_t Wout = Q + 5, head = T + 2;
    const BlockOperand oout{t0 * Wout, Wout, T * Wout, B * T * Wout}, ostats{t0, head, NH * head + 1, B * (NH * head + 1)};
    AttentionBlock shape = compact;
    shape.out = oout.Rows();
    shape.stats = ostats.Stats();
    const auto iout = oout.Indices(B, Tq, Q), istats = ostats.StatIndices(B, NH, Tq);
    const auto out_before = this->Scatter(this->template Random<Acc>(oout.size), iout, out0);
    const auto lse_before = this->Scatter(this->template Random<Acc>(ostats.size), istats, lse0);
    auto out = impl.template Put<Acc>(out_before), lse = impl.template Put<Acc>(lse_before);
    impl.ops->AttentionMerge(out + oout.base, lse + ostats.base,
                             impl.template Put<Acc>(this->Scatter(std::vector<double>(size_t(oout.size), TestFixture::kNaN), iout, block_out)) + oout.base,
                             impl.template Put<Acc>(this->Scatter(std::vector<double>(size_t(ostats.size), TestFixture::kNaN), istats, block_lse)) + ostats.base,
                             shape, *impl.stream);
    const auto got_out = impl.Get(out, oout.size), got_lse = impl.Get(lse, ostats.size);
    this->ExpectUntouched(got_out, out_before, iout, "AttentionMerge out" + at);
    this->ExpectUntouched(got_lse, lse_before, istats, "AttentionMerge lse" + at);
    this->ExpectClose(this->Gather(got_out, iout), want_out, "AttentionMerge out" + at);
    this->ExpectCloseOrEmpty(this->Gather(got_lse, istats), want_lse, "AttentionMerge lse" + at);
  }
}

// The ring: for C ranks, 2C chunks of L rows; rank c holds query chunks c and 2C-1-c and,
// at step s, the key/value chunks of rank (c - s) mod C. Every block is computed
// straight from the packed qkv (strides), merged into accumulators that start empty, and
// its backward added into an Acc dqkv; against the whole sequence's attention on the
// reference and on the table itself.
TYPED_TEST_P(AttentionBlocksConformance, RingEqualsWholeSequence) {
  using Act = typename TestFixture::A;
  using Acc = typename TestFixture::G;
  using kernels::AttentionBlock;
  using kernels::AttentionMask;
  auto& impl = this->impl_;
  auto& ref = this->ref_;
  struct Case {
    int C, L, NH, KVH, HS;
  };
  const int B = 2;
  for (const Case& c : {Case{2, 6, 4, 2, 8}, Case{3, 4, 4, 2, 8}, Case{1, 12, 4, 2, 8}, Case{2, 5, 4, 2, 40}}) {
    const int T = 2 * c.C * c.L;
    const int64_t Q = int64_t(c.NH) * c.HS, KH = int64_t(c.KVH) * c.HS, W = Q + 2 * KH, rows = int64_t(B) * T;
    const std::string at = " (" + std::to_string(c.C) + " ranks, chunks of " + std::to_string(c.L) + " rows, heads of " +
                           std::to_string(c.HS) + ")";
    impl.keep.clear();
    ref.keep.clear();
    const auto qkv = this->template Random<Act>(rows * W), dout = this->template Random<Act>(rows * Q);

    // The whole sequence on the reference (and on the table, below).
    auto ref_qkv = ref.template Put<double>(qkv);
    auto ref_out = ref.template Poisoned<double>(rows * Q);
    auto ref_state = ref.template Poisoned<double>(ref.ops->AttentionStateElements(B, T, c.NH, c.KVH, c.HS));
    auto ref_dqkv = ref.template Poisoned<double>(rows * W);
    ref.ops->AttentionForward(ref_out, ref_state, ref_qkv, B, T, c.NH, c.KVH, c.HS, *ref.stream);
    ref.ops->AttentionBackward(ref_dqkv, nullptr, ref.template Put<double>(dout), ref_qkv, ref_out, ref_state, B, T, c.NH,
                               c.KVH, c.HS, *ref.stream);
    const auto want_out = ref.Get(ref_out, rows * Q), want_dqkv = ref.Get(ref_dqkv, rows * W);

    // The blocks. Accumulators (B,T,NH*HS) and (B,NH,T), a block's scratch alike.
    auto in_qkv = impl.template Put<Act>(qkv), in_dout = impl.template Put<Act>(dout);
    auto out = impl.template Poisoned<Acc>(rows * Q), block_out = impl.template Poisoned<Acc>(rows * Q);
    auto lse = impl.template Put<Acc>(std::vector<double>(size_t(rows * c.NH), TestFixture::kEmpty));
    auto block_lse = impl.template Poisoned<Acc>(rows * c.NH);
    auto shape_of = [&](int query_chunk, int key_chunk) {
      AttentionBlock s = AttentionBlock::Contiguous(B, c.L, c.L, c.NH, c.KVH, c.HS,
                                                    query_chunk == key_chunk ? AttentionMask::kCausal : AttentionMask::kNone);
      s.q = s.k = s.v = s.dq = s.dk = s.dv = {W, T * W};
      s.out = s.dout = {Q, T * Q};
      s.stats = {T, int64_t(c.NH) * T};
      return s;
    };
    // (query chunk, key chunk) in the ring's order: rank by rank, step by step.
    std::vector<std::pair<int, int>> blocks;
    for (int rank = 0; rank < c.C; ++rank) {
      for (int step = 0; step < c.C; ++step) {
        const int source = (rank - step + c.C) % c.C;
        for (int query_chunk : {rank, 2 * c.C - 1 - rank}) {
          for (int key_chunk : {source, 2 * c.C - 1 - source}) {
            if (key_chunk <= query_chunk) blocks.emplace_back(query_chunk, key_chunk);
          }
        }
      }
    }
    ASSERT_EQ(blocks.size(), size_t(2 * c.C * (2 * c.C + 1) / 2)) << "every block below the diagonal, once" << at;
    for (const auto& [qc, kc] : blocks) {
      const AttentionBlock s = shape_of(qc, kc);
      const int64_t query_rows = int64_t(qc) * c.L, key_rows = int64_t(kc) * c.L;
      impl.ops->AttentionBlockForward(block_out + query_rows * Q, block_lse + query_rows, in_qkv + query_rows * W,
                                      in_qkv + Q + key_rows * W, in_qkv + Q + KH + key_rows * W, s, *impl.stream);
      impl.ops->AttentionMerge(out + query_rows * Q, lse + query_rows, block_out + query_rows * Q,
                               block_lse + query_rows, s, *impl.stream);
    }
    const auto got_out = impl.Get(out, rows * Q);
    this->ExpectClose(got_out, want_out, "merged blocks against AttentionForward on fp64" + at);

    // The table's own whole-sequence attention (its outputs are Act).
    impl.ops->Attention(B, T, c.NH, c.KVH, c.HS);
    auto whole_out = impl.template Poisoned<Act>(rows * Q);
    auto whole_state = impl.template Poisoned<Acc>(impl.ops->AttentionStateElements(B, T, c.NH, c.KVH, c.HS));
    auto whole_scratch = impl.template Poisoned<std::byte>(impl.ops->AttentionScratchBytes(B, T, c.NH, c.KVH, c.HS));
    auto whole_dqkv = impl.template Poisoned<Act>(rows * W);
    impl.ops->AttentionForward(whole_out, whole_state, in_qkv, B, T, c.NH, c.KVH, c.HS, *impl.stream);
    impl.ops->AttentionBackward(whole_dqkv, whole_scratch, in_dout, in_qkv, whole_out, whole_state, B, T, c.NH, c.KVH,
                                c.HS, *impl.stream);
    this->ExpectClose(got_out, impl.Get(whole_out, rows * Q), "merged blocks against the table's AttentionForward" + at);

    // Backward: D of each query chunk from the final output as stored, then every block.
    auto final_out = impl.template Poisoned<Act>(rows * Q);
    impl.ops->Cast(final_out, out, rows * Q, *impl.stream);
    auto D = impl.template Poisoned<Acc>(rows * c.NH);
    for (int chunk = 0; chunk < 2 * c.C; ++chunk) {
      const int64_t first = int64_t(chunk) * c.L;
      impl.ops->AttentionRowDot(D + first, in_dout + first * Q, final_out + first * Q, shape_of(chunk, chunk),
                                *impl.stream);
    }
    auto dqkv = impl.template Put<Acc>(std::vector<double>(size_t(rows * W), 0.0));
    for (const auto& [qc, kc] : blocks) {
      const int64_t query_rows = int64_t(qc) * c.L, key_rows = int64_t(kc) * c.L;
      impl.ops->AttentionBlockBackward(dqkv + query_rows * W, dqkv + Q + key_rows * W, dqkv + Q + KH + key_rows * W,
                                       in_dout + query_rows * Q, in_qkv + query_rows * W, in_qkv + Q + key_rows * W,
                                       in_qkv + Q + KH + key_rows * W, lse + query_rows, D + query_rows,
                                       shape_of(qc, kc), *impl.stream);
    }
    const auto got = impl.Get(dqkv, rows * W), whole = impl.Get(whole_dqkv, rows * W);
    const char* parts[3] = {"dq", "dk", "dv"};
    for (int part = 0; part < 3; ++part) {
      const int64_t begin = part == 0 ? 0 : Q + (part - 1) * KH, end = part == 0 ? Q : begin + KH;
      std::vector<double> got_part, want_part, whole_part;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = begin; i < end; ++i) {
          got_part.push_back(got[size_t(r * W + i)]);
          want_part.push_back(want_dqkv[size_t(r * W + i)]);
          whole_part.push_back(whole[size_t(r * W + i)]);
        }
      }
      this->ExpectClose(got_part, want_part, std::string("summed block backwards' ") + parts[part] +
                                                 " against AttentionBackward on fp64" + at);
      this->ExpectClose(got_part, whole_part, std::string("summed block backwards' ") + parts[part] +
                                                  " against the table's AttentionBackward" + at);
    }
  }
}

REGISTER_TYPED_TEST_SUITE_P(AttentionBlocksConformance, BlockForwardAndBackward, BlockWithoutKeys, BlockMerge,
                            RingEqualsWholeSequence);

}  // namespace meshtrain::testing
