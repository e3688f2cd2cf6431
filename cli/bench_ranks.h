// The multi-rank runs of the benchmarks (bench train --ranks, bench plan --measure): a
// job written for one layout, its ranks launched as processes on virtual nodes (or in
// a network testbed's namespaces), each rank timing its steps and reporting its peak
// memory beside the job file.

#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/model_shape.h"
#include "api/pipeline.h"
#include "cli/commands.h"
#include "worker/train/trainer.h"

namespace meshtrain::cli {

// Seconds on the steady clock since `since`.
inline double SecondsSince(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// How the ranks of one benchmark run keep activations.
struct Activations {
  bool checkpointing = false;
  int offload = 0;  // loading horizon; 0: none
  std::string Describe() const;
};

// One layout of `o.ranks` ranks on `o.nodes` nodes.
struct RanksConfig {
  std::string name;
  int tp = 1, shard = 1;
  Activations activations;
  int micro_batch = 0;              // sequences per data-parallel rank; 0: o.batch x tp
  int64_t global_batch_tokens = 0;  // 0: one micro-step, o.ranks x o.batch x o.seq
  std::vector<int> hosts = {};      // the testbed node of each node rank; empty: node i on i
  bool keep_units_gathered = false;  // replicated with S = 1: compute copies kept (EngineOptions)
  api::Pipeline pipeline = {};       // pipeline stages, their schedule and chunks a stage
  int context = 1;                   // ranks that split each sequence (contextParallelDegree)
  int expert = 1;                    // ranks that split each block's experts (expertParallelDegree)
  int MicroBatch(const BenchTrainOptions& o) const { return micro_batch > 0 ? micro_batch : o.batch * tp; }
  int64_t GlobalTokens(const BenchTrainOptions& o) const {
    return global_batch_tokens > 0 ? global_batch_tokens : int64_t(o.ranks) * o.batch * o.seq;
  }
};

struct RanksResult {
  double step_seconds = 0;  // the slowest rank's
  double tokens_per_second = 0, exposed_seconds = 0, copy_seconds = 0;  // seconds: per step, the largest of any rank
  train::MemoryReport peak;  // the largest of any rank, by category
  int64_t peak_total = 0;    // the largest of any rank's accounted peak (all categories at once)
  int64_t state() const { return peak.params + peak.grads + peak.optimizer; }
};

// The annotation of a bench job whose ranks keep every unit gathered (RanksConfig::
// keep_units_gathered, train::EngineSwitches): a benchmark's switch, not the spec's.
inline constexpr const char* kKeepUnitsGatheredAnnotation = "meshtrain.dev/bench-keep-units-gathered";

// The job of `config` on `o.ranks` ranks over `o.nodes` nodes, training o.model at
// o.seq on the token file `data` for o.warmup + o.steps steps (annotated with
// kKeepUnitsGatheredAnnotation "true" when config.keep_units_gathered).
nlohmann::json BenchJob(const BenchTrainOptions& o, const std::string& data, int ranks, int nodes,
                        const RanksConfig& config, bool bf16);

// A benchmark's temporary file or directory, removed (errors ignored) when this goes out
// of scope, so a benchmark that fails or throws leaves nothing behind.
class RemovedOnExit {
 public:
  explicit RemovedOnExit(std::filesystem::path path) : path_(std::move(path)) {}
  ~RemovedOnExit() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  RemovedOnExit(const RemovedOnExit&) = delete;
  RemovedOnExit& operator=(const RemovedOnExit&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string string() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// `tokens` random tokens of `shape`'s vocabulary in a temporary token file; hold its path
// in a RemovedOnExit.
std::filesystem::path WriteRandomTokens(int64_t tokens, const api::ModelShape& shape);

// Asked for `device` "cuda" where no GPU is usable: says "COMMAND --device cuda: why" on
// `out` and returns true (the caller exits kExitUnreadable); false otherwise. A benchmark
// never falls back to the CPU under a heading that says GPU.
bool RefusedWithoutGpu(const std::string& device, const char* command, std::ostream& out);

// One rank of a multi-rank benchmark: trains the job in $MESHTRAIN_CONFIG and writes its
// step time and peak memory beside it.
int BenchTrainRank();

// Runs the ranks as `config` says (relaunching `self_argv`) and gathers what they measured.
std::optional<RanksResult> RunBenchRanks(const BenchTrainOptions& o, const std::vector<std::string>& self_argv,
                                         const std::string& data, const RanksConfig& config, std::ostream& out);

}  // namespace meshtrain::cli
