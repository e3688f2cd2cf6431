// CRC-32C (Castagnoli), the checksum of checkpoint files: the polynomial iSCSI, ext4 and
// LevelDB use, which catches every burst error up to 32 bits.
// Thread-safety: a pure function.

#pragma once

#include <cstddef>
#include <cstdint>

namespace meshtrain::train {

// The CRC-32C of data[0, n), continuing from `crc` (0 for a new sum).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace meshtrain::train
