// The CPU's kernel tables against the Fp64 reference (tests/support/ops_conformance.h,
// moe_conformance.h).

#include "tests/support/cpu_tables.h"
#include "tests/support/moe_conformance.h"
#include "tests/support/ops_conformance.h"

namespace meshtrain::testing {
namespace {

INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, OpsConformance, CpuTables);
INSTANTIATE_TYPED_TEST_SUITE_P(Cpu, MoeConformance, CpuTables);

}  // namespace
}  // namespace meshtrain::testing
