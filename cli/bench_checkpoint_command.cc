// `meshtrain bench checkpoint`: what a checkpoint costs the training step (the stall
// against a blocking write), and what resuming costs a rank in host memory (each rank of
// another layout reading only its own elements, against the whole-model load), and
// starting from a Hugging Face directory (each rank reading only its rows of the files).

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "api/manifest.h"
#include "api/model_shape.h"
#include "cli/bench_ranks.h"
#include "cli/commands.h"
#include "worker/comm/store.h"
#include "worker/parallel/flat_unit.h"
#include "worker/runtime/memory.h"
#include "worker/train/checkpoint.h"
#include "worker/train/checkpoint_layout.h"
#include "worker/train/checkpoint_reader.h"
#include "worker/train/huggingface.h"
#include "worker/train/trainer.h"

namespace meshtrain::cli {
namespace {

using Clock = std::chrono::steady_clock;

// A value of /proc/self/status in bytes ("VmRSS", "VmHWM").
int64_t StatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with(field + ":")) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// What one loading process measured.
struct LoadMemory {
  int64_t peak = 0;         // host memory at its highest while loading, beyond what the process began with
  int64_t shard_state = 0;  // the rank's own state: master, m and v of its shard of every unit
  int64_t read = 0;         // bytes read from the shard files
  bool ok = false;
};

// Runs `load` in a child process of its own and returns its peak resident memory beyond
// what the child began with (the parent's pages it shares are counted in neither).
LoadMemory MeasureInChild(const std::function<LoadMemory()>& load, std::string* error) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) {
    *error = std::string("pipe: ") + std::strerror(errno);
    return {};
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pipe_fds[0]);
    LoadMemory m;
    std::string why;
    // The peak so far becomes what the process holds now (Linux 4.0 and later).
    std::ofstream("/proc/self/clear_refs") << "5";
    const int64_t base = StatusBytes("VmRSS");
    try {
      m = load();
      m.peak = StatusBytes("VmHWM") - base;
      m.ok = true;
    } catch (const std::exception& e) {
      why = e.what();
    }
    std::ostringstream report;
    report << m.ok << " " << m.peak << " " << m.shard_state << " " << m.read << " " << why;
    const std::string text = report.str();
    (void)!::write(pipe_fds[1], text.data(), text.size());
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string text;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;) text.append(buffer, size_t(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  LoadMemory m;
  std::istringstream in(text);
  in >> m.ok >> m.peak >> m.shard_state >> m.read;
  if (!m.ok) {
    std::getline(in >> std::ws, *error);
    if (error->empty()) *error = "the loading process ended with status " + std::to_string(status);
  }
  return m;
}

// Rank `shard` of `shards` (TP 1) resuming from `step` as the engine does: its own state
// allocated, then each unit's shard read into it.
LoadMemory LoadShard(const std::string& step, const api::ModelShape& shape, int vocab_multiple, int shards,
                     int shard) {
  const model::ParameterLayout slice(shape, 0, 1, vocab_multiple);
  int64_t elements = 0;
  for (int u = 0; u < slice.units(); ++u) elements += parallel::ShardOfUnit(slice, u, shards, shard).shard_numel;
  std::vector<float> state(size_t(3 * elements), 0.0f);
  train::CheckpointReader reader(step, shape);
  int64_t at = 0;
  for (int u = 0; u < slice.units(); ++u) {
    const parallel::UnitShard s = parallel::ShardOfUnit(slice, u, shards, shard);
    std::vector<int64_t> indices = slice.WholeIndices(s.unit_begin + s.begin, s.unit_begin + s.begin + s.real);
    indices.resize(size_t(s.shard_numel), -1);
    reader.ReadUnit(u, indices, &state[size_t(at)], &state[size_t(elements + at)], &state[size_t(2 * elements + at)]);
    at += s.shard_numel;
  }
  return {0, int64_t(state.size() * sizeof(float)), reader.bytes_read(), true};
}

// Rank `shard` of `shards` (TP 1) starting from a Hugging Face directory as the Trainer
// does (spec.model.init.from): its own state allocated, then each unit's shard read
// straight from the safetensors files into a staging buffer of one unit and copied in.
LoadMemory LoadHuggingFaceShard(const std::string& directory, const api::ModelShape& shape, int vocab_multiple,
                                int shards, int shard) {
  const model::ParameterLayout slice(shape, 0, 1, vocab_multiple);
  int64_t elements = 0;
  for (int u = 0; u < slice.units(); ++u) elements += parallel::ShardOfUnit(slice, u, shards, shard).shard_numel;
  std::vector<float> state(size_t(3 * elements), 0.0f);
  const train::HuggingFaceWeights weights(directory, shape);
  std::vector<float> staging;
  int64_t at = 0;
  for (int u = 0; u < slice.units(); ++u) {
    const parallel::UnitShard s = parallel::ShardOfUnit(slice, u, shards, shard);
    std::vector<int64_t> indices = slice.WholeIndices(s.unit_begin + s.begin, s.unit_begin + s.begin + s.real);
    indices.resize(size_t(s.shard_numel), -1);
    staging.resize(size_t(s.shard_numel));
    weights.ReadUnit(u, indices, staging.data());
    std::copy(staging.begin(), staging.end(), state.begin() + at);
    at += s.shard_numel;
  }
  return {0, int64_t(state.size() * sizeof(float)), weights.bytes_read(), true};
}

// Writes `state` (one rank's snapshot: the whole model in single-rank order) as the
// `writers` ranks of a 1 x writers x 1 layout would; returns the step directory.
std::string WriteAsShards(const std::string& path, const api::ModelShape& shape, int vocab_multiple, int writers,
                          const train::ShardState& whole, std::string* error) {
  const api::ParallelLayout layout(1, writers, 1, writers);
  comm::StoreServer server("127.0.0.1", 0);
  std::vector<std::unique_ptr<comm::StoreClient>> stores;
  std::vector<std::unique_ptr<train::CheckpointWriter>> ranks;
  for (int rank = 0; rank < writers; ++rank) {
    stores.push_back(std::make_unique<comm::StoreClient>("127.0.0.1:" + std::to_string(server.port()),
                                                         std::chrono::seconds(10)));
    ranks.push_back(std::make_unique<train::CheckpointWriter>(
        path, 1, shape, layout, vocab_multiple, rank, stores.back().get(),
        [error](const std::string& e) { *error = e; }));
  }
  const model::ParameterLayout slice(shape, 0, 1, vocab_multiple);
  for (int rank = writers - 1; rank >= 0; --rank) {
    const train::ShardFileLayout file = train::LayOutShardFile(slice, writers, rank);
    ranks[size_t(rank)]->Save({1, 0}, [&](train::ShardState* into) {
      std::shared_ptr<float[]> arrays(new float[size_t(3 * file.elements)]);
      int64_t at = 0;
      for (const train::ShardFileLayout::Segment& segment : file.units) {
        for (int64_t i : file.WholeIndices(slice, segment, 0, segment.elements)) {
          arrays[size_t(at)] = whole.master[i];
          arrays[size_t(file.elements + at)] = whole.m[i];
          arrays[size_t(2 * file.elements + at)] = whole.v[i];
          ++at;
        }
      }
      *into = {0, rank, 0, file.elements, arrays.get(), arrays.get() + file.elements,
               arrays.get() + 2 * file.elements, arrays, 0, {}};
    });
  }
  for (auto& rank : ranks) rank->Wait();
  return (std::filesystem::path(path) / "step-00000001").string();
}

}  // namespace

int BenchCheckpointCommand(const BenchCheckpointOptions& o, std::ostream& out) {
  const api::ModelShape* preset = api::FindPreset(o.model);
  if (preset == nullptr) {
    out << "--model " << o.model << ": unknown preset\n";
    return kExitUnreadable;
  }
  if (RefusedWithoutGpu(o.device, "bench checkpoint", out)) return kExitUnreadable;
  if (std::error_code error; !o.dir.empty() && !std::filesystem::is_directory(o.dir, error)) {
    out << "bench checkpoint: --dir " << o.dir << ": is not a directory\n";
    return kExitUnreadable;
  }
  BenchTrainOptions train_options;
  train_options.model = o.model;
  train_options.batch = 1;
  train_options.seq = 64;
  train_options.steps = 1;
  train_options.warmup = 0;
  api::ModelShape wanted = *preset;
  if (o.layers > 0) wanted.layers = o.layers;
  if (o.hidden > 0) wanted.hidden = o.hidden;
  if (o.vocab > 0) wanted.vocab_size = o.vocab;
  const RemovedOnExit data(
      WriteRandomTokens(int64_t(train_options.batch) * train_options.seq * (train_options.steps + 1), wanted));
  const std::string model = o.model + (o.layers > 0 || o.hidden > 0 || o.vocab > 0
                                            ? " at " + std::to_string(wanted.layers) + " layers, hidden " +
                                                  std::to_string(wanted.hidden) + ", vocabulary " +
                                                  std::to_string(wanted.vocab_size)
                                            : "");
  const bool cuda = o.device == "cuda";
  nlohmann::json spec = BenchJob(train_options, data.string(), 1, 1, {"one rank", 1, 1, {}}, cuda);
  spec["spec"]["model"].update({{"layers", wanted.layers}, {"hidden", wanted.hidden}, {"vocabSize", wanted.vocab_size}});
  const api::CheckedJob job = api::CheckTrainingJob(spec, "bench", 0);
  if (!job.ok()) {
    out << "bench checkpoint: " << job.errors.front().ToString() << "\n";
    return kExitInvalid;
  }
  const RemovedOnExit dir((o.dir.empty() ? std::filesystem::temp_directory_path() : std::filesystem::path(o.dir)) /
                          ("meshtrain-bench-checkpoint-" + std::to_string(::getpid())));
  // On a GPU the snapshot copies the fp32 master weights and AdamW state from the device.
  train::Trainer trainer(job.job, nullptr, cuda ? runtime::Device::Cuda(0) : runtime::Device::Cpu());
  trainer.Step();  // AdamW state that is not all zeros
  const api::ModelShape shape = api::ShapeOf(job.job.spec.model);
  const int vocab_multiple = trainer.model().vocab_multiple();
  bool failed = false;
  train::CheckpointWriter writer((dir.path() / "one-rank").string(), 1, shape,
                                 api::ParallelLayout::ForSpec(job.job.spec), vocab_multiple, 0, nullptr,
                                 [&](const std::string& error) {
                                   out << "bench checkpoint: " << error << "\n";
                                   failed = true;
                                 });
  // A first checkpoint, not measured: it faults in the snapshot buffer the writer then
  // reuses for every later one.
  writer.Save({0, 0}, [&](train::ShardState* into) { trainer.model().Snapshot(into); });
  writer.Wait();
  double stall = 0, blocking = 0;
  for (int i = 0; i < o.repeats && !failed; ++i) {
    // Asynchronous: the step waits for the snapshot only.
    stall += writer.Save({2 * i + 1, 0}, [&](train::ShardState* into) { trainer.model().Snapshot(into); });
    writer.Wait();
    // Blocking: the step would wait for the whole write.
    const auto start = Clock::now();
    writer.Save({2 * i + 2, 0}, [&](train::ShardState* into) { trainer.model().Snapshot(into); });
    writer.Wait();
    blocking += SecondsSince(start);
  }
  const int64_t bytes = writer.stats().last_bytes;
  if (failed) return kExitInvalid;
  stall /= o.repeats;
  blocking /= o.repeats;
  char line[400];
  std::snprintf(line, sizeof line,
                "checkpoint of %s (%s on one rank: master weights, AdamW m and v) from %s under %s, mean of %d "
                "after one unmeasured:\n"
                "stall %.3f s (snapshot to host memory; the write goes on in the background)\n"
                "blocking write %.3f s (snapshot, files written and fsynced, renamed into place)\n"
                "stall / blocking %.3f\n",
                model.c_str(), runtime::FormatBytes(size_t(bytes)).c_str(), cuda ? "GPU 0" : "the CPU",
                dir.path().parent_path().c_str(), o.repeats,
                stall, blocking, stall / blocking);
  out << line;

  // Resume: the state written by `writers` ranks, loaded by each rank of each reading
  // layout in a process of its own; the peer is the whole-model load every rank did before.
  train::ShardState whole;
  trainer.model().Snapshot(&whole);  // one rank: the whole model, single-rank order
  std::string error;
  const std::string step =
      WriteAsShards((dir.path() / "sharded").string(), shape, vocab_multiple, o.writers, whole, &error);
  if (!error.empty()) {
    out << "bench checkpoint: " << error << "\n";
    return kExitInvalid;
  }
  const model::ParameterLayout single(shape);
  int64_t unit_bytes = 0;  // one unit's master, m and v: the most the load holds beyond the rank's own state
  for (int u = 0; u < single.units(); ++u) {
    unit_bytes = std::max(unit_bytes, 3 * int64_t(sizeof(float)) * (single.Unit(u).second - single.Unit(u).first));
  }
  const LoadMemory assembled = MeasureInChild(
      [&] {
        const train::LoadedCheckpoint loaded = train::LoadCheckpoint(step, shape);
        return LoadMemory{0, int64_t(3 * loaded.state.master.size() * sizeof(float)), 0, true};
      },
      &error);
  std::snprintf(line, sizeof line,
                "\nresume of that state written by %d ranks (1 x %d shards x tp 1), each reading rank in a process of "
                "its own; one unit (the largest, master, m and v) is %s:\n",
                o.writers, o.writers, runtime::FormatBytes(size_t(unit_bytes)).c_str());
  out << line;
  // A small model's figures are mostly the process's fixed costs (code and libraries paged in).
  out << "ranks  rank  shard state  peak loading  peak - shard state  read from files  within shard state + one unit\n";
  std::string beyond;  // the first rank past the bound
  for (int readers : o.readers) {
    for (int rank = 0; rank < readers && error.empty(); ++rank) {
      const LoadMemory m = MeasureInChild([&] { return LoadShard(step, shape, vocab_multiple, readers, rank); }, &error);
      if (!m.ok) break;
      const bool within = m.peak <= m.shard_state + unit_bytes;
      if (!within && beyond.empty()) {
        beyond = "rank " + std::to_string(rank) + " of " + std::to_string(readers) + " peaked at " +
                 runtime::FormatBytes(size_t(m.peak)) + " while loading, past its shard state (" +
                 runtime::FormatBytes(size_t(m.shard_state)) + ") plus one unit";
      }
      std::snprintf(line, sizeof line, "%5d  %4d  %11s  %12s  %18s  %15s  %s\n", readers, rank,
                    runtime::FormatBytes(size_t(m.shard_state)).c_str(), runtime::FormatBytes(size_t(m.peak)).c_str(),
                    runtime::FormatBytes(size_t(std::max<int64_t>(0, m.peak - m.shard_state))).c_str(),
                    runtime::FormatBytes(size_t(m.read)).c_str(), within ? "yes" : "NO");
      out << line;
    }
  }
  if (!error.empty()) {
    out << "bench checkpoint: " << error << "\n";
    return kExitInvalid;
  }
  std::snprintf(line, sizeof line, "whole-model load (every rank, before): peak %s for a state of %s\n",
                runtime::FormatBytes(size_t(assembled.peak)).c_str(),
                runtime::FormatBytes(size_t(assembled.shard_state)).c_str());
  out << line;

  // The same model as a Hugging Face directory in bf16 (spec.model.init.from), each rank
  // reading only the rows it holds, one unit at a time, straight from the files.
  const std::string hf = (dir.path() / "hugging-face").string();
  const std::vector<std::string> files = train::ExportHuggingFace(
      hf, shape, {train::Dtype::kBF16, uint64_t(1) << 27, ""}, [&](int, int64_t first, int64_t count, float* values) {
        std::copy(whole.master + first, whole.master + first + count, values);
      });
  std::snprintf(line, sizeof line,
                "\ninit.from of that model as a Hugging Face directory (bf16, %zu safetensors files), each reading "
                "rank in a process of its own (its state is master, m and v):\n",
                files.size());
  out << line;
  out << "ranks  rank  shard state  peak loading  peak - shard state  read from files  within shard state + one unit\n";
  for (int readers : o.readers) {
    for (int rank = 0; rank < readers && error.empty(); ++rank) {
      const LoadMemory m =
          MeasureInChild([&] { return LoadHuggingFaceShard(hf, shape, vocab_multiple, readers, rank); }, &error);
      if (!m.ok) break;
      const bool within = m.peak <= m.shard_state + unit_bytes;
      if (!within && beyond.empty()) {
        beyond = "rank " + std::to_string(rank) + " of " + std::to_string(readers) + " peaked at " +
                 runtime::FormatBytes(size_t(m.peak)) + " loading the Hugging Face directory, past its shard state (" +
                 runtime::FormatBytes(size_t(m.shard_state)) + ") plus one unit";
      }
      std::snprintf(line, sizeof line, "%5d  %4d  %11s  %12s  %18s  %15s  %s\n", readers, rank,
                    runtime::FormatBytes(size_t(m.shard_state)).c_str(), runtime::FormatBytes(size_t(m.peak)).c_str(),
                    runtime::FormatBytes(size_t(std::max<int64_t>(0, m.peak - m.shard_state))).c_str(),
                    runtime::FormatBytes(size_t(m.read)).c_str(), within ? "yes" : "NO");
      out << line;
    }
  }
  if (!error.empty()) {
    out << "bench checkpoint: " << error << "\n";
    return kExitInvalid;
  }
  if (o.check && !beyond.empty()) {
    out << "bench checkpoint: " << beyond << "\n";
    return kExitInvalid;
  }
  return kExitOk;
}

}  // namespace meshtrain::cli
