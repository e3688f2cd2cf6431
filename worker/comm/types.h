// Element types, reductions and the error every communication failure raises.

#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace meshtrain::comm {

enum class DataType { kFloat32, kBFloat16, kFloat16, kInt32, kInt64, kFloat64 };
inline constexpr DataType kAllDataTypes[] = {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16,
                                             DataType::kInt32,   DataType::kInt64,    DataType::kFloat64};

size_t ElementSize(DataType type);
const char* DataTypeName(DataType type);  // "fp32", "bf16", "fp16", "int32", "int64", "fp64"

enum class ReduceOp { kSum, kAverage };
const char* ReduceOpName(ReduceOp op);  // "sum", "avg"

// A collective or point-to-point operation that failed or did not finish in time.
// The message names the operation, the group, the size and, where known, the peer.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The transport this rank was told to use (a libfabric provider named in its environment)
// does not exist on its node: no restart on such a node can connect.
class ProviderUnavailable : public CommError {
 public:
  using CommError::CommError;
};

// out[i] = a[i] + b[i] for `count` elements of `type`; out may alias a or b. bf16 and
// fp16 are added in fp32 and rounded back to nearest-even each time, as NCCL does for
// partial sums. The addition is commutative bit for bit, so a+b on one rank equals b+a
// on another.
void Sum(void* out, const void* a, const void* b, size_t count, DataType type);
// buf[i] /= divisor (integers truncate toward zero).
void DivideBy(void* buf, size_t count, DataType type, int divisor);

// Conversions used by reductions and tests; round to nearest-even.
float Bf16ToFloat(uint16_t value);
uint16_t FloatToBf16(float value);
float Fp16ToFloat(uint16_t value);
uint16_t FloatToFp16(float value);

}  // namespace meshtrain::comm
