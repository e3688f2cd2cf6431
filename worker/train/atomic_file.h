// Whole files: written so that a reader, or a crash or a full disk, never leaves half of
// one in place of the file that was there; read only when they are files.
// Thread-safety: plain functions; threads may use different paths at once.

#pragma once

#include <cstddef>
#include <string>

namespace meshtrain::train {

// Writes `size` bytes at `data` to a temporary file beside `path`, fsyncs it and renames
// it over `path`. On any failure the temporary is removed and a file already at `path`
// is left as it was. Returns "" on success, else what failed with the system's reason
// ("cannot write PATH.tmp-123: No space left on device"); the caller names the file it was for.
std::string WriteFileAtomically(const std::string& path, const void* data, size_t size);

// Whether something other than a regular file is at `path` (a directory, whose stream
// reads as empty or throws, or a FIFO, whose open would block until a writer comes). A
// missing path is not: the reader's open names it.
bool NotARegularFile(const std::string& path);

}  // namespace meshtrain::train
