// Whole files written so that a reader, or a crash or a full disk, never leaves half of
// one in place of the file that was there.
// Thread-safety: a plain function; threads may write different paths at once.

#pragma once

#include <cstddef>
#include <string>

namespace meshtrain::train {

// Writes `size` bytes at `data` to a temporary file beside `path`, fsyncs it and renames
// it over `path`. On any failure the temporary is removed and a file already at `path`
// is left as it was. Returns "" on success, else what failed with the system's reason
// ("cannot write PATH.tmp-123: No space left on device"); the caller names the file it was for.
std::string WriteFileAtomically(const std::string& path, const void* data, size_t size);

}  // namespace meshtrain::train
