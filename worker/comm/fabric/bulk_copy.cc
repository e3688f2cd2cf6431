#include "worker/comm/fabric/bulk_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace meshtrain::comm::fabric {
namespace {

#if defined(__x86_64__)
constexpr size_t kLine = 64;

// Copies up to the first 64-byte boundary of `to`, since streaming stores need aligned
// addresses; returns how many bytes that took.
size_t CopyHead(char* to, const char* from, size_t bytes) {
  size_t head = (kLine - reinterpret_cast<uintptr_t>(to) % kLine) % kLine;
  if (head > bytes) head = bytes;
  std::memcpy(to, from, head);
  return head;
}

__attribute__((target("avx512f"))) void StreamAvx512(char* to, const char* from, size_t bytes) {
  size_t done = CopyHead(to, from, bytes);
  for (; done + 4 * kLine <= bytes; done += 4 * kLine) {
    __m512i a = _mm512_loadu_si512(from + done);
    __m512i b = _mm512_loadu_si512(from + done + kLine);
    __m512i c = _mm512_loadu_si512(from + done + 2 * kLine);
    __m512i d = _mm512_loadu_si512(from + done + 3 * kLine);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to + done), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to + done + kLine), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to + done + 2 * kLine), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to + done + 3 * kLine), d);
  }
  _mm_sfence();  // streaming stores are weakly ordered: publish them before any flag
  std::memcpy(to + done, from + done, bytes - done);
}

void StreamSse2(char* to, const char* from, size_t bytes) {
  size_t done = CopyHead(to, from, bytes);
  for (; done + kLine <= bytes; done += kLine) {
    for (size_t k = 0; k < kLine; k += 16) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + done + k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + done + k), v);
    }
  }
  _mm_sfence();
  std::memcpy(to + done, from + done, bytes - done);
}

using StreamFunction = void (*)(char*, const char*, size_t);
StreamFunction Stream() {
  static const StreamFunction stream = [] {
    __builtin_cpu_init();  // may run before libgcc's own initialiser
    return __builtin_cpu_supports("avx512f") ? StreamAvx512 : StreamSse2;
  }();
  return stream;
}
#endif

}  // namespace

void BulkCopy(void* to, const void* from, size_t bytes) {
#if defined(__x86_64__)
  if (bytes >= kStreamingCopyBytes) {
    return Stream()(static_cast<char*>(to), static_cast<const char*>(from), bytes);
  }
#endif
  if (bytes > 0) std::memcpy(to, from, bytes);
}

}  // namespace meshtrain::comm::fabric
