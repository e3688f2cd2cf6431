// Memory that ranks on the same node can read directly: each buffer is a memfd mapped
// shared, which a peer maps read-only through /proc/<pid>/fd. A large intra-node
// message from such a buffer is then one memcpy by the receiver, at memory speed,
// instead of the provider's copy (CMA or bounce buffers), which runs at about half of
// it here. The all-to-all also maps a receiver's buffer writable, when the receiver
// offers it, so the sender copies into it. Mapping needs the same permission as CMA
// (same user, ptrace allowed).
//
// Thread-safety: all functions are safe to call from any thread.

#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace meshtrain::comm::fabric {

// Where a local buffer lives, to tell a peer.
struct SharedLocation {
  int32_t pid = 0;
  int32_t fd = 0;
  uint64_t generation = 0;  // distinguishes segments that reuse an fd number
  uint64_t offset = 0;
  uint64_t segment_bytes = 0;
};

// Allocates `bytes` of node-shareable memory; throws std::bad_alloc on failure.
void* AllocateShared(size_t bytes);
// Frees what AllocateShared returned; ignores nullptr.
void FreeShared(void* memory);
// The location of [data, data+bytes) if it lies within one shared allocation.
std::optional<SharedLocation> FindShared(const void* data, size_t bytes);
// This process's read-only view of a peer's location; throws CommError if it cannot map.
const char* MapPeer(const SharedLocation& location);
// A writable view of it, for a peer that has offered this location to be written (the
// all-to-all's pushed blocks); throws CommError if it cannot map.
char* MapPeerWritable(const SharedLocation& location);

}  // namespace meshtrain::comm::fabric
