// OpenBLAS's core for this CPU (worker/kernels/cpu/blas_core.h): which cores a CPU runs,
// the decision with its self-check passing and failing, and the self-check itself in a
// child process of this test binary (whose main() answers it: tests/support/test_main.cc).

#include "worker/kernels/cpu/blas_core.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

extern "C" char* openblas_get_corename(void);

namespace meshtrain::kernels::cpu {
namespace {

CpuVectorFeatures Avx512(bool bf16) {
  CpuVectorFeatures f;
  f.sse3 = f.ssse3 = f.sse42 = f.avx = f.avx2 = f.fma = true;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512cd = true;
  f.avx512_bf16 = bf16;
  return f;
}

TEST(BlasCore, TheCoresACpuRunsComeBestFirstDownToPrescott) {
  EXPECT_EQ(CoresFor(Avx512(true)),
            (std::vector<std::string>{"Cooperlake", "SkylakeX", "Haswell", "Sandybridge", "Nehalem", "Core2", "Prescott"}));
  EXPECT_EQ(CoresFor(Avx512(false)).front(), "SkylakeX");
  CpuVectorFeatures avx2 = Avx512(false);
  avx2.avx512f = avx2.avx512bw = avx2.avx512vl = avx2.avx512dq = avx2.avx512cd = false;
  EXPECT_EQ(CoresFor(avx2).front(), "Haswell");
  EXPECT_EQ(avx2.Describe(), "AVX2 and FMA");
  CpuVectorFeatures no_bw = Avx512(false);
  no_bw.avx512bw = false;  // AVX-512F alone (Knights Landing) is not enough for SkylakeX
  EXPECT_EQ(CoresFor(no_bw).front(), "Haswell");
  EXPECT_EQ(CoresFor(CpuVectorFeatures{}), (std::vector<std::string>{"Prescott"}));
  EXPECT_EQ(Avx512(false).Describe(), "AVX-512");
  EXPECT_EQ(Avx512(true).Describe(), "AVX-512 with BF16");
}

TEST(BlasCore, LevelsOrderTheCoresAndUnknownNamesAreMinusOne) {
  EXPECT_LT(CoreLevel("Prescott"), CoreLevel("Nehalem"));
  EXPECT_LT(CoreLevel("Sandybridge"), CoreLevel("Haswell"));
  EXPECT_EQ(CoreLevel("Zen"), CoreLevel("Haswell"));
  EXPECT_LT(CoreLevel("HASWELL"), CoreLevel("skylakex"));
  EXPECT_LT(CoreLevel("SkylakeX"), CoreLevel("Cooperlake"));
  EXPECT_EQ(CoreLevel("NoSuchCore"), -1);
}

TEST(BlasCore, APrescottFallbackOnAnAvx512CpuAdoptsSkylakeXOnceItsCheckPasses) {
  std::vector<std::string> asked;
  const BlasCoreDecision d = DecideBlasCore("Prescott", Avx512(false), [&](const std::string& core) {
    asked.push_back(core);
    return BlasSelfCheck{true, "largest error 1e-07"};
  });
  EXPECT_EQ(d.adopt, "SkylakeX");
  EXPECT_EQ(d.note, "Prescott detected; CPU has AVX-512");
  EXPECT_EQ(d.warning, "");
  EXPECT_EQ(asked, std::vector<std::string>{"SkylakeX"});
}

TEST(BlasCore, AFailedSelfCheckFallsBackAndWarns) {
  // The best core fails; the next better than OpenBLAS's passes and is run, with a warning.
  const BlasCoreDecision next = DecideBlasCore("Prescott", Avx512(false), [](const std::string& core) {
    return core == "SkylakeX" ? BlasSelfCheck{false, "crashed (signal 4, Illegal instruction)"}
                              : BlasSelfCheck{true, "largest error 1e-07"};
  });
  EXPECT_EQ(next.adopt, "Haswell");
  EXPECT_EQ(next.warning,
            "OpenBLAS chose Prescott, older than this CPU runs (AVX-512), and SkylakeX failed its self-check (crashed "
            "(signal 4, Illegal instruction)); running Haswell");
  // Every better core fails: OpenBLAS's own choice stays, and the warning and note say so.
  std::vector<std::string> asked;
  const BlasCoreDecision kept = DecideBlasCore("Prescott", Avx512(false), [&](const std::string& core) {
    asked.push_back(core);
    return BlasSelfCheck{false, "wrong products: largest error 0.5 of the bound (tolerance 1e-04)"};
  });
  EXPECT_EQ(kept.adopt, "");
  EXPECT_EQ(asked, (std::vector<std::string>{"SkylakeX", "Haswell", "Sandybridge", "Nehalem", "Core2"}));
  EXPECT_NE(kept.warning.find("OpenBLAS chose Prescott, older than this CPU runs (AVX-512)"), std::string::npos);
  EXPECT_NE(kept.warning.find("; keeping Prescott"), std::string::npos) << kept.warning;
  EXPECT_EQ(kept.note.rfind("detected; SkylakeX failed its self-check (wrong products", 0), 0u) << kept.note;
  EXPECT_NE(kept.note.find("), and 4 more; CPU has AVX-512"), std::string::npos) << kept.note;
}

TEST(BlasCore, OpenBlasOwnChoiceStandsWhenItIsTheBestOrUnknown) {
  int asked = 0;
  auto check = [&](const std::string&) {
    ++asked;
    return BlasSelfCheck{true, ""};
  };
  const BlasCoreDecision best = DecideBlasCore("SkylakeX", Avx512(false), check);
  EXPECT_EQ(best.adopt, "");
  EXPECT_EQ(best.note, "detected; CPU has AVX-512");
  const BlasCoreDecision unknown = DecideBlasCore("SomeFutureCore", Avx512(true), check);
  EXPECT_EQ(unknown.adopt, "");
  EXPECT_EQ(asked, 0);
}

TEST(BlasCore, TheSelfCheckRunsACoreInAChildAndRefusesAnotherCore) {
  // The core OpenBLAS chose here, and SSE3's, which every x86-64 CPU runs.
  const std::string here = openblas_get_corename();
  const BlasSelfCheck same = RunBlasSelfCheck(here);
  EXPECT_TRUE(same.ok) << here << ": " << same.detail;
  EXPECT_NE(same.detail.find("largest error"), std::string::npos) << same.detail;
#if defined(__x86_64__)
  const BlasSelfCheck prescott = RunBlasSelfCheck("Prescott");
  EXPECT_TRUE(prescott.ok) << prescott.detail;
#endif
  // A name OpenBLAS does not know: it runs a core of its own choosing, which the check
  // catches. (Which core differs by CPU: on an AMD EPYC that runs Zen by itself, Haswell.)
  const BlasSelfCheck unknown = RunBlasSelfCheck("NoSuchCore");
  EXPECT_FALSE(unknown.ok);
  const std::string ran = "OpenBLAS ran ", refused = ", not NoSuchCore";
  EXPECT_TRUE(unknown.detail.starts_with(ran) && unknown.detail.ends_with(refused) &&
              unknown.detail.size() > ran.size() + refused.size())
      << unknown.detail;
}

TEST(BlasCore, TheCoreInUseIsDescribedWithItsSource) {
  const BlasCore b = CurrentBlasCore();
  EXPECT_EQ(b.core, openblas_get_corename());
  EXPECT_EQ(b.library.rfind("OpenBLAS ", 0), 0u) << b.library;
  EXPECT_EQ(b.Describe(), b.library + " " + b.core + " (" + b.source + ")");
  if (const char* set = std::getenv("OPENBLAS_CORETYPE"); set != nullptr && *set != '\0' &&
                                                          std::getenv("MESHTRAIN_BLAS_CORE") == nullptr) {
    EXPECT_EQ(b.source, "set by OPENBLAS_CORETYPE=" + std::string(set));  // the user's, kept
  } else {
    EXPECT_NE(b.source.find("CPU has "), std::string::npos) << b.source;  // chosen by this binary's main()
  }
}

}  // namespace
}  // namespace meshtrain::kernels::cpu
