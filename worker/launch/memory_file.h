// A file that lives in memory only (memfd_create), for what a launcher hands its ranks:
// the rank table, the Store's key, a rank's failure file. A process that holds the
// descriptor opens it by /proc/self/fd/N like any file, and it is gone when the last
// holder ends, so nothing reaches the disk or outlives the launch, however it ends (a
// SIGKILLed launcher included). A process that closes its descriptors before it execs
// (Python's subprocess does by default) does not hand such a file on to its children.
//
// Thread-safety: one thread at a time per object.

#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace meshtrain::launch {

class MemoryFile {
 public:
  // kInherited: every child process keeps it across exec; kOwn: none does, unless the
  // child clears FD_CLOEXEC on fd() itself (a file for one child). Readable and writable
  // by its owner only. Throws std::runtime_error naming `name` when the system has none.
  enum class Sharing { kInherited, kOwn };
  MemoryFile(const std::string& name, Sharing sharing);
  ~MemoryFile();
  MemoryFile(MemoryFile&& other) noexcept;
  MemoryFile& operator=(MemoryFile&& other) noexcept;
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;

  int fd() const { return fd_; }
  // The name under which a process holding the descriptor opens the file.
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }
  // Replaces the contents. Throws std::runtime_error.
  void Write(std::string_view contents);
  // At most `most` bytes from the start; empty when nothing was written.
  std::string Read(size_t most) const;

 private:
  std::string name_;
  int fd_ = -1;
};

}  // namespace meshtrain::launch
