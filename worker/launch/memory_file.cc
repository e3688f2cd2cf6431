#include "worker/launch/memory_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace meshtrain::launch {

MemoryFile::MemoryFile(const std::string& name, Sharing sharing) : name_(name) {
  const bool own = sharing == Sharing::kOwn;
  fd_ = ::memfd_create(name.c_str(), own ? MFD_CLOEXEC : 0);
  if (fd_ >= 0 && fd_ < 3) {
    // Never standard input or output (a launcher started with one closed): a rank would
    // inherit the file as such and write its log over it.
    const int moved = ::fcntl(fd_, own ? F_DUPFD_CLOEXEC : F_DUPFD, 3);
    ::close(fd_);
    fd_ = moved;
  }
  if (fd_ < 0 || ::fchmod(fd_, 0600) != 0) {
    const int error = errno;
    if (fd_ >= 0) ::close(fd_);
    throw std::runtime_error("cannot make the in-memory file " + name + ": " + std::strerror(error));
  }
}

MemoryFile::~MemoryFile() {
  if (fd_ >= 0) ::close(fd_);
}

MemoryFile::MemoryFile(MemoryFile&& other) noexcept
    : name_(std::move(other.name_)), fd_(std::exchange(other.fd_, -1)) {}

MemoryFile& MemoryFile::operator=(MemoryFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    name_ = std::move(other.name_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void MemoryFile::Write(std::string_view contents) {
  if (::ftruncate(fd_, 0) != 0) throw std::runtime_error("cannot empty " + name_ + ": " + std::strerror(errno));
  for (size_t done = 0; done < contents.size();) {
    const ssize_t wrote = ::pwrite(fd_, contents.data() + done, contents.size() - done, off_t(done));
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) throw std::runtime_error("cannot write " + name_ + ": " + std::strerror(errno));
    done += size_t(wrote);
  }
}

std::string MemoryFile::Read(size_t most) const {
  std::string text(most, '\0');
  size_t got = 0;
  while (got < most) {
    const ssize_t n = ::pread(fd_, text.data() + got, most - got, off_t(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  text.resize(got);
  return text;
}

}  // namespace meshtrain::launch
