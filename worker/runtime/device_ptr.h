// Device memory as typed handles that host code cannot dereference (docs/design.md, "The
// device seam").
//
// DevicePtr<T> is an address in a backend's device memory. It offsets and converts as T*
// does (to DevicePtr<const T>, and to bytes), but it has no *, [] or ->: host code that
// would read or write device memory does not compile. That holds on the CPU backend too,
// where device memory is ordinary host memory, so the CPU tests catch what would fault on
// a GPU.
//
// The code that runs on the device side (a backend's copies and fills, a kernel table,
// stream-ordered collectives) turns handles into addresses through DeviceSide
// (device_side.h). Nothing in model/, parallel/ or train/ includes that header; a test
// holds it (tests/unit/layering_test.sh).
// Thread-safety: a plain value.

#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace meshtrain::runtime {

struct DeviceSide;
template <class>
class DeviceArray;

template <class T>
class DevicePtr {
 public:
  DevicePtr() = default;
  DevicePtr(std::nullptr_t) {}  // NOLINT: a null handle, as from nullptr

  // T -> const T, and any T -> (const) std::byte: the conversions T* has to void*.
  template <class U, class = std::enable_if_t<std::is_convertible_v<U*, T*> || std::is_same_v<std::remove_const_t<T>, std::byte>>>
  DevicePtr(DevicePtr<U> other)  // NOLINT: implicit, as for pointers
      : address_(reinterpret_cast<uintptr_t>(other.address_)) {
    static_assert(std::is_const_v<T> || !std::is_const_v<U>, "DevicePtr: cannot drop const");
  }

  explicit operator bool() const { return address_ != 0; }
  DevicePtr operator+(int64_t n) const { return DevicePtr(address_ + uintptr_t(n * int64_t(sizeof(Element)))); }
  DevicePtr& operator+=(int64_t n) { return *this = *this + n; }
  // Elements from `other` to this, in one array.
  int64_t operator-(DevicePtr other) const { return int64_t(address_ - other.address_) / int64_t(sizeof(Element)); }
  friend bool operator==(DevicePtr a, DevicePtr b) { return a.address_ == b.address_; }

  // The handle of the same address as another element type (bytes carved into tensors).
  // REQUIRES: the address is aligned for U.
  template <class U>
  DevicePtr<U> As() const {
    static_assert(std::is_const_v<U> || !std::is_const_v<T>, "DevicePtr: cannot drop const");
    DevicePtr<U> p;
    p.address_ = address_;
    return p;
  }

 private:
  using Element = std::conditional_t<std::is_void_v<T>, std::byte, T>;
  template <class>
  friend class DevicePtr;
  friend struct DeviceSide;
  template <class>
  friend class DeviceArray;
  explicit DevicePtr(uintptr_t address) : address_(address) {}

  uintptr_t address_ = 0;
};

using DeviceBytes = DevicePtr<std::byte>;
using ConstDeviceBytes = DevicePtr<const std::byte>;

}  // namespace meshtrain::runtime
