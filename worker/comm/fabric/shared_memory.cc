#include "worker/comm/fabric/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <tuple>

#include "worker/comm/types.h"

namespace meshtrain::comm::fabric {
namespace {

struct Segment {
  size_t bytes;
  int fd;
  uint64_t generation;
};

struct PeerMapping {
  uint64_t generation;
  const char* base;
  size_t bytes;
};

std::mutex mutex;
std::map<uintptr_t, Segment> segments;                          // ours, by base address
// Peers' segments this process has mapped, read-only and writable, by (pid, fd).
std::map<std::pair<int32_t, int32_t>, PeerMapping> peer_maps, writable_peer_maps;
uint64_t next_generation = 1;

}  // namespace

void* AllocateShared(size_t bytes) {
  size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  int fd = ::memfd_create("meshtrain-comm", MFD_CLOEXEC);
  if (fd < 0) throw std::bad_alloc();
  void* memory = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(rounded)) == 0) {
    memory = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (memory == MAP_FAILED) {
    ::close(fd);
    throw std::bad_alloc();
  }
  std::lock_guard lock(mutex);
  segments[reinterpret_cast<uintptr_t>(memory)] = Segment{rounded, fd, next_generation++};
  return memory;
}

void FreeShared(void* memory) {
  if (memory == nullptr) return;
  std::lock_guard lock(mutex);
  auto it = segments.find(reinterpret_cast<uintptr_t>(memory));
  if (it == segments.end()) return;
  ::munmap(memory, it->second.bytes);
  ::close(it->second.fd);
  segments.erase(it);
}

std::optional<SharedLocation> FindShared(const void* data, size_t bytes) {
  uintptr_t start = reinterpret_cast<uintptr_t>(data);
  std::lock_guard lock(mutex);
  auto it = segments.upper_bound(start);
  if (it == segments.begin()) return std::nullopt;
  --it;
  if (start + bytes > it->first + it->second.bytes) return std::nullopt;
  return SharedLocation{static_cast<int32_t>(::getpid()), it->second.fd, it->second.generation,
                        start - it->first, it->second.bytes};
}

namespace {

// The view of `location` in `maps`, mapped (writable or not) on first use. REQUIRES: mutex held.
const char* MapPeerLocked(const SharedLocation& location, bool writable,
                          std::map<std::pair<int32_t, int32_t>, PeerMapping>& maps) {
  auto key = std::make_pair(location.pid, location.fd);
  auto it = maps.find(key);
  if (it == maps.end() || it->second.generation != location.generation) {
    if (it != maps.end()) {
      ::munmap(const_cast<char*>(it->second.base), it->second.bytes);
      maps.erase(it);
    }
    std::string path = "/proc/" + std::to_string(location.pid) + "/fd/" + std::to_string(location.fd);
    int fd = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    void* base = fd < 0 ? MAP_FAILED
                        : ::mmap(nullptr, location.segment_bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                                 MAP_SHARED, fd, 0);
    int error = errno;
    if (fd >= 0) ::close(fd);
    if (base == MAP_FAILED) {
      throw CommError(std::string("cannot map a peer's buffer ") + (writable ? "for writing " : "") + path + ": " +
                      std::strerror(error));
    }
    it = maps.emplace(key, PeerMapping{location.generation, static_cast<const char*>(base),
                                       location.segment_bytes}).first;
  }
  return it->second.base + location.offset;
}

}  // namespace

const char* MapPeer(const SharedLocation& location) {
  std::lock_guard lock(mutex);
  return MapPeerLocked(location, false, peer_maps);
}

char* MapPeerWritable(const SharedLocation& location) {
  std::lock_guard lock(mutex);
  return const_cast<char*>(MapPeerLocked(location, true, writable_peer_maps));
}

}  // namespace meshtrain::comm::fabric
