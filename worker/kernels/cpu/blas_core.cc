#include "worker/kernels/cpu/blas_core.h"

#include <cblas.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string_view>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

extern "C" {
char* openblas_get_corename(void);
char* openblas_get_config(void);
}

extern char** environ;

namespace meshtrain::kernels::cpu {
namespace {

// Set in the environment of the child that checks a core; it answers and exits.
constexpr const char* kSelfCheckVariable = "MESHTRAIN_BLAS_SELF_CHECK";
// The decision, for this process after it re-executes and for every process it starts:
// "core<TAB>note<TAB>warning".
constexpr const char* kDecisionVariable = "MESHTRAIN_BLAS_CORE";
constexpr const char* kCoreTypeVariable = "OPENBLAS_CORETYPE";
// A core's sgemm passes when every element is within this fraction of its error bound's
// scale (the sum of |a||b| over k): fp32 accumulation over k = 300 stays under 2e-5.
constexpr double kTolerance = 1e-4;

std::string Lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

const char* Getenv(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

std::vector<std::string> SplitTabs(const std::string& s) {
  std::vector<std::string> parts(1);
  for (char c : s) {
    if (c == '\t') {
      parts.emplace_back();
    } else {
      parts.back() += c;
    }
  }
  return parts;
}

// Largest |c - ref| / sum_k |a||b| of a product in every transposition, in sgemm or dgemm.
template <class T>
double GemmError() {
  struct Shape {
    int m, n, k;
  };
  double worst = 0;
  uint64_t seed = 0x9e3779b97f4a7c15ULL;
  auto next = [&] {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return T(double(seed >> 11) / double(1ULL << 53) * 2 - 1);
  };
  for (const Shape s : {Shape{37, 53, 71}, Shape{130, 97, 300}}) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        std::vector<T> a(size_t(s.m) * s.k), b(size_t(s.k) * s.n), c(size_t(s.m) * s.n);
        for (T& x : a) x = next();
        for (T& x : b) x = next();
        // a is m x k (k x m when transposed), b is k x n (n x k when transposed).
        const int lda = ta ? s.m : s.k, ldb = tb ? s.k : s.n;
        const auto order = CblasRowMajor;
        const auto opa = ta ? CblasTrans : CblasNoTrans, opb = tb ? CblasTrans : CblasNoTrans;
        if constexpr (std::is_same_v<T, float>) {
          cblas_sgemm(order, opa, opb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), s.n);
        } else {
          cblas_dgemm(order, opa, opb, s.m, s.n, s.k, 1.0, a.data(), lda, b.data(), ldb, 0.0, c.data(), s.n);
        }
        for (int i = 0; i < s.m; ++i) {
          for (int j = 0; j < s.n; ++j) {
            double ref = 0, scale = 1e-30;
            for (int p = 0; p < s.k; ++p) {
              const double x = double(ta ? a[size_t(p) * lda + i] : a[size_t(i) * lda + p]);
              const double y = double(tb ? b[size_t(j) * ldb + p] : b[size_t(p) * ldb + j]);
              ref += x * y;
              scale += std::fabs(x * y);
            }
            const double error = std::fabs(double(c[size_t(i) * s.n + j]) - ref) / scale;
            worst = std::max(worst, std::isfinite(error) ? error : 1e30);
          }
        }
      }
    }
  }
  return worst;
}

// The child's side of RunBlasSelfCheck: one line on stdout, then exit.
[[noreturn]] void AnswerSelfCheck() {
  const double error = std::max(GemmError<float>(), GemmError<double>());
  std::printf("core=%s error=%.3g\n", openblas_get_corename(), error);
  std::fflush(stdout);
  std::_Exit(0);
}

std::string DescribeStatus(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "crashed (signal " + std::to_string(sig) + ", " + strsignal(sig) + ")";
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

}  // namespace

std::string CpuVectorFeatures::Describe() const {
  if (avx512f && avx512bw && avx512vl && avx512dq) return avx512_bf16 ? "AVX-512 with BF16" : "AVX-512";
  if (avx2 && fma) return "AVX2 and FMA";
  if (avx) return "AVX";
  if (sse42) return "SSE4.2";
  return sse3 ? "SSE3" : "no SSE3";
}

CpuVectorFeatures DetectCpuVectorFeatures() {
  CpuVectorFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.sse3 = c & (1u << 0);
  f.ssse3 = c & (1u << 9);
  f.sse42 = c & (1u << 20);
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28);
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t(hi) << 32) | lo;
  }
  const bool os_avx = (xcr0 & 0x6) == 0x6;      // SSE and AVX state
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;  // and opmask, ZMM0-15 upper halves, ZMM16-31
  f.avx = avx && os_avx;
  f.fma = fma && f.avx;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = f.avx && (b & (1u << 5));
    f.avx512f = os_avx512 && (b & (1u << 16));
    f.avx512dq = f.avx512f && (b & (1u << 17));
    f.avx512cd = f.avx512f && (b & (1u << 28));
    f.avx512bw = f.avx512f && (b & (1u << 30));
    f.avx512vl = f.avx512f && (b & (1u << 31));
    const unsigned subleaves = a;
    if (subleaves >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      f.avx512_bf16 = f.avx512f && (a & (1u << 5));
    }
  }
#endif
  return f;
}

std::vector<std::string> CoresFor(const CpuVectorFeatures& cpu) {
  std::vector<std::string> cores;
  const bool avx512 = cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512dq && cpu.avx512cd;
  if (avx512 && cpu.avx512_bf16) cores.push_back("Cooperlake");
  if (avx512) cores.push_back("SkylakeX");
  if (cpu.avx2 && cpu.fma) cores.push_back("Haswell");
  if (cpu.avx) cores.push_back("Sandybridge");
  if (cpu.sse42) cores.push_back("Nehalem");
  if (cpu.ssse3) cores.push_back("Core2");
  cores.push_back("Prescott");
  return cores;
}

int CoreLevel(const std::string& core) {
  // OpenBLAS's x86-64 core names (driver/others/dynamic.c), by the newest instructions
  // their sgemm kernels use.
  static const std::map<std::string, int> kLevels = {
      {"katmai", 0},      {"coppermine", 0},   {"northwood", 0},   {"prescott", 0},     {"banias", 0},
      {"athlon", 0},      {"opteron", 0},      {"opteron_sse3", 0}, {"core2", 1},       {"penryn", 1},
      {"dunnington", 1},  {"atom", 1},         {"nano", 1},        {"barcelona", 1},    {"bobcat", 1},
      {"nehalem", 2},     {"sandybridge", 3},  {"bulldozer", 3},   {"piledriver", 3},   {"steamroller", 3},
      {"excavator", 3},   {"haswell", 4},      {"zen", 4},         {"skylakex", 5},     {"cooperlake", 6},
      {"sapphirerapids", 6}};
  const auto it = kLevels.find(Lower(core));
  return it == kLevels.end() ? -1 : it->second;
}

BlasSelfCheck RunBlasSelfCheck(const std::string& core) {
  // The child's environment: ours, with the core and the self-check set.
  std::vector<std::string> entries;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (entry.starts_with(std::string(kCoreTypeVariable) + "=") || entry.starts_with(std::string(kSelfCheckVariable) + "=")) {
      continue;
    }
    entries.emplace_back(entry);
  }
  entries.push_back(std::string(kCoreTypeVariable) + "=" + core);
  entries.push_back(std::string(kSelfCheckVariable) + "=1");
  std::vector<char*> envp;
  for (std::string& e : entries) envp.push_back(e.data());
  envp.push_back(nullptr);
  char self[] = "/proc/self/exe";
  char* argv[] = {self, nullptr};

  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return {false, std::string("pipe: ") + std::strerror(errno)};
  const pid_t pid = fork();
  if (pid < 0) {
    close(out[0]);
    close(out[1]);
    return {false, std::string("fork: ") + std::strerror(errno)};
  }
  if (pid == 0) {  // async-signal-safe calls only until exec
    dup2(out[1], STDOUT_FILENO);
    const int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null >= 0) dup2(null, STDERR_FILENO);  // OpenBLAS names an unknown core there
    execve(self, argv, envp.data());
    _exit(127);
  }
  close(out[1]);
  std::string answer;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    const int ready = poll(&p, 1, int(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buffer[256];
    const ssize_t n = read(out[0], buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || answer.size() > 4096) break;
    answer.append(buffer, size_t(n));
  }
  close(out[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return {false, "gave no answer within 20 s"};
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return {false, DescribeStatus(status)};
  char ran[64] = {0};
  double error = 0;
  if (std::sscanf(answer.c_str(), "core=%63s error=%lf", ran, &error) != 2) {
    return {false, "answered \"" + answer.substr(0, 80) + "\", not a core and an error"};
  }
  if (Lower(ran) != Lower(core)) return {false, "OpenBLAS ran " + std::string(ran) + ", not " + core};
  char detail[96];
  std::snprintf(detail, sizeof detail, "largest error %.2g of the bound (tolerance %.0e)", error, kTolerance);
  if (!(error <= kTolerance)) return {false, std::string("wrong products: ") + detail};
  return {true, detail};
}

BlasCoreDecision DecideBlasCore(const std::string& detected, const CpuVectorFeatures& cpu,
                                const std::function<BlasSelfCheck(const std::string&)>& check) {
  BlasCoreDecision d;
  const std::string has = "CPU has " + cpu.Describe();
  const int level = CoreLevel(detected);
  if (level < 0) {  // a core this code does not rank: OpenBLAS knows better
    d.note = "detected; " + has;
    return d;
  }
  std::vector<std::string> failed;
  for (const std::string& core : CoresFor(cpu)) {
    if (CoreLevel(core) <= level) break;
    const BlasSelfCheck r = check(core);
    if (r.ok) {
      d.adopt = core;
      break;
    }
    failed.push_back(core + " failed its self-check (" + r.detail + ")");
  }
  std::string failures;
  for (const std::string& f : failed) failures += (failures.empty() ? "" : "; ") + f;
  if (!failed.empty()) {
    d.warning = "OpenBLAS chose " + detected + ", older than this CPU runs (" + cpu.Describe() + "), and " + failures +
                "; " + (d.adopt.empty() ? "keeping " + detected : "running " + d.adopt);
  }
  if (!d.adopt.empty()) {
    d.note = detected + " detected; " + has;
  } else if (!failed.empty()) {  // the best core's failure; the warning has them all
    d.note = "detected; " + failed.front() +
             (failed.size() > 1 ? ", and " + std::to_string(failed.size() - 1) + " more" : "") + "; " + has;
  } else {
    d.note = "detected; " + has;
  }
  return d;
}

void StartWithBestBlasCore(int /*argc*/, char** argv) {
  if (Getenv(kSelfCheckVariable) != nullptr) AnswerSelfCheck();
  if (Getenv(kCoreTypeVariable) != nullptr || Getenv(kDecisionVariable) != nullptr) return;
  const std::string detected = openblas_get_corename();
  const BlasCoreDecision d = DecideBlasCore(detected, DetectCpuVectorFeatures(), RunBlasSelfCheck);
  if (!d.warning.empty()) std::fprintf(stderr, "warning: %s\n", d.warning.c_str());
  const std::string decision = (d.adopt.empty() ? detected : d.adopt) + "\t" + d.note + "\t" + d.warning;
  setenv(kDecisionVariable, decision.c_str(), 1);
  if (d.adopt.empty()) return;
  setenv(kCoreTypeVariable, d.adopt.c_str(), 1);
  execv("/proc/self/exe", argv);
  // Not re-executed: this process keeps OpenBLAS's core, and says so.
  std::fprintf(stderr, "warning: could not re-execute to run OpenBLAS's %s core (%s); running %s\n", d.adopt.c_str(),
               std::strerror(errno), detected.c_str());
  unsetenv(kCoreTypeVariable);
  const std::string kept = detected + "\tdetected; re-executing for " + d.adopt + " failed\t";
  setenv(kDecisionVariable, kept.c_str(), 1);
}

BlasCore CurrentBlasCore() {
  BlasCore b;
  b.core = openblas_get_corename();
  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ...": the first two words.
  const std::string config = openblas_get_config();
  const size_t first = config.find(' '), second = first == std::string::npos ? first : config.find(' ', first + 1);
  b.library = config.substr(0, second);
  const char* forced = Getenv(kCoreTypeVariable);
  const char* decided = Getenv(kDecisionVariable);
  std::vector<std::string> decision = decided ? SplitTabs(decided) : std::vector<std::string>{};
  decision.resize(3);
  const bool ours = decided != nullptr && Lower(decision[0]) == Lower(b.core);
  if (forced != nullptr && !ours) {
    b.source = "set by OPENBLAS_CORETYPE=" + std::string(forced);
  } else if (ours) {
    b.source = decision[1];
    b.warning = decision[2];
  } else {
    b.source = "detected; CPU has " + DetectCpuVectorFeatures().Describe();
  }
  return b;
}

std::string BlasCore::Describe() const { return library + " " + core + " (" + source + ")"; }

}  // namespace meshtrain::kernels::cpu
