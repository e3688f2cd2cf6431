// A stand-in for an OpenBLAS that does not know this CPU, for tests of
// worker/kernels/cpu/blas_core.h on CPUs that OpenBLAS does know. Preloaded (LD_PRELOAD),
// it answers openblas_get_corename() with "Prescott", the core an old OpenBLAS falls back
// to, while OPENBLAS_CORETYPE is unset; once the variable is set it answers as the real
// library does, so that a core chosen by name is reported as it runs. With
// OPENBLAS_FALLBACK_SHIM=always it answers "Prescott" whatever is set: a self-check of any
// other core then sees the wrong core run, and fails. The kernels are the real library's.

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

extern "C" char* openblas_get_corename(void) {
  static char prescott[] = "Prescott";
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  const char* mode = std::getenv("OPENBLAS_FALLBACK_SHIM");
  if (forced == nullptr || *forced == '\0' || (mode != nullptr && std::strcmp(mode, "always") == 0)) return prescott;
  using CoreName = char* (*)();
  const auto real = reinterpret_cast<CoreName>(dlsym(RTLD_NEXT, "openblas_get_corename"));
  return real != nullptr ? real() : prescott;
}
