// The one way from a DevicePtr to an address, for the code that runs on the device side:
// a backend's copies and fills, the kernel tables, stream-ordered collectives and the
// tests of those. Everything else holds handles only (device_ptr.h); model/, parallel/
// and train/ never include this header (tests/unit/layering_test.sh).
// Thread-safety: pure functions.

#pragma once

#include <cstdint>

#include "worker/runtime/device_ptr.h"

namespace meshtrain::runtime {

struct DeviceSide {
  template <class T>
  static T* Address(DevicePtr<T> p) {
    return reinterpret_cast<T*>(p.address_);
  }
  template <class T>
  static DevicePtr<T> Handle(T* address) {
    return DevicePtr<T>(reinterpret_cast<uintptr_t>(address));
  }
};

}  // namespace meshtrain::runtime
