// OpenBLAS's kernel core for the CPU this process runs on.
//
// A DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernels once, when the library loads, from
// the CPU's model number. A build older than the CPU does not know the model and falls
// back to an old core: Debian 12's 0.3.21 runs SSE3 ("Prescott") kernels on a current
// Xeon, a third of the speed its AVX-512 kernels reach there. OPENBLAS_CORETYPE, read at
// load time too, chooses a core by name.
//
// StartWithBestBlasCore, called first in main(), compares the core OpenBLAS chose with the
// vector features the CPU and the OS actually offer (cpuid, xgetbv). Where OpenBLAS chose
// an older core, the best core the CPU runs is first checked in a short child process (a
// small sgemm and dgemm against plain fp64 loops, and that the child really ran that core):
// some OpenBLAS builds compute wrong results, or crash, on some processors. A core that
// passes is adopted by re-executing this program once with OPENBLAS_CORETYPE set, so that
// every process it starts (ranks, launchers, benches) inherits the choice. A core that
// fails is not adopted: the program keeps OpenBLAS's choice and warns. An OPENBLAS_CORETYPE
// the user set is never overridden.

#pragma once

#include <functional>
#include <string>
#include <vector>

namespace meshtrain::kernels::cpu {

// What the CPU offers and the OS saves across context switches (AVX state, AVX-512's
// mask and upper registers).
struct CpuVectorFeatures {
  bool sse3 = false, ssse3 = false, sse42 = false, avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512cd = false, avx512_bf16 = false;

  // "AVX-512 with BF16", "AVX-512", "AVX2 and FMA", "AVX", "SSE4.2", "SSE3" or "no SSE3".
  std::string Describe() const;
};

// This CPU's features (x86-64; all false elsewhere). Thread-safe.
CpuVectorFeatures DetectCpuVectorFeatures();

// OpenBLAS's x86-64 cores that a CPU with `cpu` runs, best first, down to "Prescott".
std::vector<std::string> CoresFor(const CpuVectorFeatures& cpu);

// How new a core's kernels are: 0 for SSE3 and older, up to 6 for AVX-512 with BF16
// (Cooperlake); -1 for a name this code does not know. Names compare case-insensitively.
int CoreLevel(const std::string& core);

// The outcome of checking one core in a child process.
struct BlasSelfCheck {
  bool ok = false;
  std::string detail;  // "largest error 3.1e-07 of the bound" or why it failed
};

// Runs this executable again (/proc/self/exe) with OPENBLAS_CORETYPE=core: it multiplies
// in sgemm and dgemm and compares against plain fp64 loops, and says which core OpenBLAS
// ran. Fails on a wrong result, another core, a crash or no answer within 20 s. Only
// programs that call StartWithBestBlasCore first in main() answer it. Thread-safe.
BlasSelfCheck RunBlasSelfCheck(const std::string& core);

// What to do about the core OpenBLAS chose (`detected`) on a CPU with `cpu`: `adopt` names
// the core to run instead ("" keeps OpenBLAS's), `note` says why, as Describe prints it
// after the core's name, and `warning` is set when a better core failed its check. `check`
// is asked about each better core, best first, until one passes.
struct BlasCoreDecision {
  std::string adopt;
  std::string note;
  std::string warning;
};
BlasCoreDecision DecideBlasCore(const std::string& detected, const CpuVectorFeatures& cpu,
                                const std::function<BlasSelfCheck(const std::string&)>& check);

// Call first in main(), before any thread starts. Answers a self-check and exits when this
// process is one; else decides as above when OPENBLAS_CORETYPE is unset, and re-executes
// the program (same arguments) when it adopts a core, or prints the warning to stderr and
// goes on when a better core failed. The decision travels to child processes in the
// environment, so that they neither check nor warn again.
void StartWithBestBlasCore(int argc, char** argv);

// The core in use and where it came from. Thread-safe.
struct BlasCore {
  std::string library;  // "OpenBLAS 0.3.21"
  std::string core;     // "SkylakeX"
  std::string source;   // "Prescott detected; CPU has AVX-512", "set by OPENBLAS_CORETYPE", ...
  std::string warning;  // a better core that failed its check, else ""

  // "OpenBLAS 0.3.21 SkylakeX (Prescott detected; CPU has AVX-512)"
  std::string Describe() const;
};
BlasCore CurrentBlasCore();

}  // namespace meshtrain::kernels::cpu
