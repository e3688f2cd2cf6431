// Helpers for tests labelled `gpu`. Where no CUDA device is present they skip,
// and say so in the words ctest and people look for: "skipped: no GPU".

#pragma once

#include <gtest/gtest.h>

#include <vector>

namespace meshtrain::testing {

// True if the CUDA runtime sees at least one device.
bool HaveGpu();

// |got - want| / |want| in the L2 norm: how far a bf16 result is from its fp32 reference.
double RelativeError(const std::vector<float>& got, const std::vector<float>& want);

}  // namespace meshtrain::testing

#define MESHTRAIN_SKIP_WITHOUT_GPU()                                    \
  do {                                                                  \
    if (!::meshtrain::testing::HaveGpu()) GTEST_SKIP() << "skipped: no GPU"; \
  } while (0)
