// Helpers for tests labelled `gpu`. Where no CUDA device is present they skip,
// and say so in the words ctest and people look for: "skipped: no GPU".

#pragma once

#include <gtest/gtest.h>

namespace meshtrain::testing {

// True if the CUDA runtime sees at least one device.
bool HaveGpu();

}  // namespace meshtrain::testing

#define MESHTRAIN_SKIP_WITHOUT_GPU()                                    \
  do {                                                                  \
    if (!::meshtrain::testing::HaveGpu()) GTEST_SKIP() << "skipped: no GPU"; \
  } while (0)
