#include "worker/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "worker/comm/store.h"
#include "worker/model/parameters.h"
#include "worker/train/atomic_file.h"
#include "worker/train/checkpoint_layout.h"
#include "worker/train/checkpoint_reader.h"
#include "worker/train/crc32c.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr auto kWaitForWriters = std::chrono::minutes(2);

std::string StepName(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

// The step of a directory named as StepName names it; nullopt for any other name.
std::optional<int64_t> StepOfName(const std::string& name) {
  if (!name.starts_with("step-") || name.size() > 5 + 18) return std::nullopt;
  const std::string digits = name.substr(5);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  const int64_t step = std::stoll(digits);
  if (StepName(step) != name) return std::nullopt;
  return step;
}

std::string Sidecar(int rank) { return CheckpointRankFile(rank) + ".json"; }

// The model shape metadata (read from `file`) names; throws CheckpointError naming it.
api::ModelShape ModelOf(const Json& meta, const fs::path& file) {
  try {
    return ShapeOfCheckpointJson(meta.at("model"), file.string());
  } catch (const Json::exception& e) {
    throw CheckpointError(file.string() + ": malformed metadata: " + e.what());
  }
}

// The Store key a writer sets once its file and sidecar are durable ("" then) or its
// write failed (the error).
std::string WrittenKey(const std::string& step_name, int rank) {
  return "checkpoint/" + step_name + "/" + CheckpointRankFile(rank);
}

std::string ErrnoText(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

struct Span {
  const void* data;
  size_t bytes;
};

// Writes the spans one after another to `path` and fsyncs it; throws CheckpointError
// naming the path.
void WriteDurably(const std::string& path, std::initializer_list<Span> spans) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError(ErrnoText("cannot create", path));
  for (const Span& span : spans) {
    const auto* p = static_cast<const char*>(span.data);
    for (size_t done = 0; done < span.bytes;) {
      const ssize_t n = ::write(fd, p + done, span.bytes - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string error = ErrnoText("cannot write", path);
        ::close(fd);
        throw CheckpointError(error);
      }
      done += size_t(n);
    }
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) throw CheckpointError(ErrnoText("cannot sync", path));
}

void WriteDurably(const std::string& path, const std::string& text) { WriteDurably(path, {{text.data(), text.size()}}); }

void SyncDirectory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(ErrnoText("cannot open directory", path));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw CheckpointError(ErrnoText("cannot sync directory", path));
}

std::string DescribeLayout(const Json& layout) {
  const int replicas = layout.at("replicas"), shard = layout.at("shard"), tp = layout.at("tp");
  const int stages = layout.value("pipeline", 1);
  const int experts = layout.value("expert", 1);
  return (stages > 1 ? std::to_string(stages) + " stages x " : std::string()) + std::to_string(replicas) +
         (replicas == 1 ? " replica x " : " replicas x ") + std::to_string(shard) + (shard == 1 ? " shard" : " shards") +
         " x tp " + std::to_string(tp) + (experts > 1 ? " x experts split " + std::to_string(experts) + " ways" : "") +
         " (" + std::to_string(stages * replicas * shard * tp) + " ranks)";
}

// The ranks that write a checkpoint of `layout`: replica 0's of every stage.
std::vector<int> Writers(const api::ParallelLayout& layout) {
  std::vector<int> ranks;
  for (int p = 0; p < layout.pipeline(); ++p) {
    for (int s = 0; s < layout.shard(); ++s) {
      for (int t = 0; t < layout.tp(); ++t) ranks.push_back(layout.RankOf({0, s, t, p}));
    }
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

// `store`, which only a layout with rank 0 its one writer may do without.
comm::StoreClient* StoreOfWriters(comm::StoreClient* store, const api::ParallelLayout& layout) {
  if (store == nullptr && Writers(layout) != std::vector<int>{0}) {
    throw std::invalid_argument("CheckpointWriter: " + std::to_string(Writers(layout).size()) +
                                " ranks write each checkpoint, and rank 0 learns of their writes through the Store");
  }
  return store;
}

}  // namespace

std::string ReadCheckpointFile(const std::filesystem::path& path) {
  if (NotARegularFile(path.string())) throw CheckpointError(path.string() + ": is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path.string() + ": missing or unreadable");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

LoadedCheckpoint LoadCheckpoint(const std::string& directory, const api::ModelShape& shape) {
  CheckpointReader reader(directory, shape);
  LoadedCheckpoint loaded{directory, reader.position(), {}};
  const model::ParameterLayout whole(shape);
  for (auto* part : {&loaded.state.master, &loaded.state.m, &loaded.state.v}) part->assign(size_t(whole.total()), 0.0f);
  std::vector<int64_t> indices;
  for (int u = 0; u < whole.units(); ++u) {
    const auto [begin, end] = whole.Unit(u);
    indices.resize(size_t(end - begin));
    std::iota(indices.begin(), indices.end(), begin);
    reader.ReadUnit(u, indices, &loaded.state.master[size_t(begin)], &loaded.state.m[size_t(begin)],
                    &loaded.state.v[size_t(begin)]);
  }
  return loaded;
}

std::vector<std::string> ResumeCandidates(const std::string& path) {
  std::vector<CheckpointListing> all = ListCheckpoints(path, /*verify=*/false);  // reading verifies
  std::stable_partition(all.begin(), all.end(), [](const CheckpointListing& c) { return c.latest; });
  std::vector<std::string> directories;
  for (const CheckpointListing& c : all) directories.push_back(c.directory);
  return directories;
}

std::optional<std::string> CheckpointRun(const std::string& directory) {
  try {
    const Json run = Json::parse(ReadCheckpointFile(fs::path(directory) / "metadata.json")).value("run", Json(""));
    if (run.is_string()) return run.get<std::string>();
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

api::ModelShape CheckpointModel(const std::string& directory) {
  const fs::path file = fs::path(directory) / "metadata.json";
  try {
    return ModelOf(Json::parse(ReadCheckpointFile(file)), file);
  } catch (const Json::exception& e) {
    throw CheckpointError(file.string() + ": malformed metadata: " + e.what());
  }
}

std::optional<api::ModelShape> WholeCheckpointOfAnotherModel(const std::string& directory,
                                                             const api::ModelShape& shape) {
  const fs::path dir(directory), meta_file = dir / "metadata.json";
  try {
    const std::string text = ReadCheckpointFile(meta_file);
    const api::ModelShape theirs = ModelOf(Json::parse(text), meta_file);
    if (theirs.SameWeights(shape)) return std::nullopt;
    const Json meta = ParseCheckpointMetadata(text, meta_file.string(), theirs);
    for (const Json& f : meta.at("files")) {
      std::error_code error;
      const uintmax_t bytes = fs::file_size(dir / f.at("name").get<std::string>(), error);
      if (error || bytes != f.at("bytes").get<uintmax_t>()) return std::nullopt;
    }
    return theirs;
  } catch (const std::exception&) {  // damaged: not a whole checkpoint
    return std::nullopt;
  }
}

std::vector<CheckpointListing> ListCheckpoints(const std::string& path, bool verify) {
  std::vector<CheckpointListing> all;
  std::error_code error;
  if (!fs::is_directory(path, error)) return all;
  std::string latest;
  try {
    latest = ReadCheckpointFile(fs::path(path) / "latest");
    latest.erase(latest.find_last_not_of("\n ") + 1);
  } catch (const CheckpointError&) {  // no checkpoint completed yet
  }
  for (const fs::directory_entry& entry : fs::directory_iterator(path, error)) {
    const std::string name = entry.path().filename().string();
    const std::optional<int64_t> step = StepOfName(name);  // as pruning counts them
    if (!entry.is_directory() || !step) continue;
    CheckpointListing c;
    c.directory = entry.path().string();
    c.latest = name == latest;
    c.step = *step;
    try {
      const fs::path file = entry.path() / "metadata.json";
      const Json meta = Json::parse(ReadCheckpointFile(file));
      c.layout = DescribeLayout(meta.at("layout"));
      for (const Json& f : meta.at("files")) c.bytes += f.at("bytes").get<int64_t>();
      if (verify) VerifyCheckpoint(c.directory, ModelOf(meta, file));
    } catch (const std::exception& e) {
      c.problem = e.what();
    }
    all.push_back(std::move(c));
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.step > b.step; });
  return all;
}

CheckpointWriter::CheckpointWriter(std::string path, int64_t keep, const api::ModelShape& shape,
                                   const api::ParallelLayout& layout, int vocab_multiple, int rank,
                                   comm::StoreClient* store, std::function<void(const std::string&)> log_error,
                                   std::string run)
    : path_(std::move(path)),
      keep_(keep),
      shape_(shape),
      layout_(layout),
      vocab_multiple_(vocab_multiple),
      run_(std::move(run)),
      rank_(rank),
      store_(StoreOfWriters(store, layout)),
      log_error_(std::move(log_error)),
      thread_([this] { Loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void CheckpointWriter::RemovePartial(const std::string& path) {
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(path, error)) {
    if (entry.path().filename().string().starts_with(".partial-")) fs::remove_all(entry.path(), error);
  }
}

double CheckpointWriter::Save(const TrainingPosition& position, const std::function<void(ShardState*)>& snapshot) {
  const auto start = Clock::now();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !busy_ && !pending_; });
  snapshot(&state_);  // the writer thread is idle until pending_ is set
  pending_ = position;
  lock.unlock();
  changed_.notify_all();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void CheckpointWriter::Wait() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !busy_ && !pending_; });
}

CheckpointStats CheckpointWriter::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CheckpointWriter::Loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || pending_; });
    if (!pending_) return;  // stopping, nothing left
    const TrainingPosition position = *pending_;
    const ShardState& state = state_;
    pending_.reset();
    busy_ = true;
    lock.unlock();
    const auto start = Clock::now();
    std::string error;
    try {
      Write(position, state);
    } catch (const std::exception& e) {
      error = "checkpoint of step " + std::to_string(position.step) + " failed: " + e.what();
      log_error_(error + "; the previous checkpoints stay as they were");
    }
    lock.lock();
    if (error.empty()) {
      ++stats_.written;
      stats_.last_step = position.step;
      stats_.last_bytes = int64_t(3 * size_t(state.size) * sizeof(float));
      stats_.last_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    } else {
      ++stats_.failures;
      stats_.last_error = error;
    }
    busy_ = false;
    changed_.notify_all();
  }
}

void CheckpointWriter::Write(const TrainingPosition& position, const ShardState& state) {
  const std::string name = StepName(position.step);
  const std::string partial = (fs::path(path_) / (".partial-" + name)).string();
  try {
    if (state.replica == 0) WriteShards(state, partial, name);
    if (rank_ == 0) Finish(position, partial, name);
  } catch (const std::exception&) {
    // A failed checkpoint leaves nothing behind (a full disk gets its space back). Rank 0
    // removes the directory (the checkpoint has failed for every writer); the others their
    // own files, and the directory if it is left empty.
    std::error_code ignored;
    if (rank_ == 0) {
      fs::remove_all(partial, ignored);
    } else {
      fs::remove(fs::path(partial) / CheckpointRankFile(rank_), ignored);
      fs::remove(fs::path(partial) / Sidecar(rank_), ignored);
      fs::remove(partial, ignored);  // only if empty
    }
    throw;
  }
}

void CheckpointWriter::WriteShards(const ShardState& state, const std::string& partial, const std::string& name) {
  const std::string file = (fs::path(partial) / CheckpointRankFile(rank_)).string();
  Json sidecar = {{"tp", state.tp_rank},  {"shard", state.shard_rank},   {"stage", state.stage},
                  {"units", state.units}, {"expert", state.expert_rank}};
  try {
    const ShardFileLayout chunks = LayOutShardFile(
        model::ParameterLayout(shape_, state.tp_rank, layout_.tp(), vocab_multiple_, state.expert_rank, layout_.expert()),
        layout_.shard(), state.shard_rank, kChunkElements, state.units);
    if (chunks.elements != state.size) {
      throw CheckpointError("rank " + std::to_string(rank_) + " holds " + std::to_string(state.size) +
                            " elements, but its shards are " + std::to_string(chunks.elements));
    }
    std::error_code error;
    fs::create_directories(partial, error);
    if (error) throw CheckpointError("cannot create " + partial + ": " + error.message());
    const size_t part = size_t(state.size) * sizeof(float);
    WriteDurably(file, {{state.master, part}, {state.m, part}, {state.v, part}});
    Json checksums = Json::array();
    for (const float* section : {state.master, state.m, state.v}) {
      for (const ShardFileLayout::Segment& segment : chunks.units) {
        for (int64_t from = 0; from < segment.elements; from += chunks.chunk_elements) {
          const int64_t n = std::min(chunks.chunk_elements, segment.elements - from);
          checksums.push_back(Crc32c(section + segment.offset + from, size_t(n) * sizeof(float)));
        }
      }
    }
    sidecar["bytes"] = 3 * part;
    sidecar["chunkElements"] = chunks.chunk_elements;
    sidecar["chunkCrc32c"] = std::move(checksums);
    WriteDurably((fs::path(partial) / Sidecar(rank_)).string(), sidecar.dump());
  } catch (const CheckpointError& e) {
    // Tell rank 0; if even that fails, rank 0 times out.
    if (store_ != nullptr && rank_ != 0) store_->Set(WrittenKey(name, rank_), e.what());
    throw;
  }
  if (store_ != nullptr && rank_ != 0) store_->Set(WrittenKey(name, rank_), "");
}

void CheckpointWriter::Finish(const TrainingPosition& position, const std::string& partial, const std::string& name) {
  Json files = Json::array();
  const auto deadline = Clock::now() + kWaitForWriters;
  for (int writer : Writers(layout_)) {
    if (writer != 0) {  // rank 0's own write is done: this thread wrote it
      std::string error;
      try {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        error = store_->Get(WrittenKey(name, writer), std::max(left, std::chrono::milliseconds(1)));
      } catch (const comm::StoreError& e) {
        throw CheckpointError("rank " + std::to_string(writer) + " did not finish writing " +
                              (fs::path(partial) / CheckpointRankFile(writer)).string() + " within 2 minutes (" + e.what() + ")");
      }
      if (!error.empty()) {
        throw CheckpointError("rank " + std::to_string(writer) + ": " + error);
      }
    }
    const fs::path sidecar = fs::path(partial) / Sidecar(writer);
    Json done;
    try {
      done = Json::parse(ReadCheckpointFile(sidecar));
    } catch (const std::exception& e) {
      throw CheckpointError(sidecar.string() + ": unreadable after rank " + std::to_string(writer) +
                            " wrote it: " + e.what());
    }
    files.push_back({{"name", CheckpointRankFile(writer)}, {"rank", writer}, {"tp", done.at("tp")}, {"shard", done.at("shard")},
                     {"bytes", done.at("bytes")}, {"chunkElements", done.at("chunkElements")},
                     {"chunkCrc32c", done.at("chunkCrc32c")}});
    if (layout_.pipeline() > 1) {
      files.back()["stage"] = done.at("stage");
      files.back()["units"] = done.at("units");
    }
    if (layout_.expert() > 1) files.back()["expert"] = done.at("expert");
  }
  Json layout = {{"tp", layout_.tp()}, {"shard", layout_.shard()}, {"replicas", layout_.replicas()},
                 {"pipeline", layout_.pipeline()}, {"world", layout_.world()}};
  // Version 5 only where the experts are split: a checkpoint without is version 4's, byte
  // for byte, and a reader of version 4 refuses one whose files it would misread.
  if (layout_.expert() > 1) layout["expert"] = layout_.expert();
  const Json meta = {{"format", kCheckpointFormat},
                     {"version", layout_.expert() > 1 ? kCheckpointVersion : 4},
                     {"vocabMultiple", vocab_multiple_},
                     {"step", position.step},
                     {"dataPosition", position.data_position},
                     {"dataOrder", "windows"},
                     {"run", run_},
                     {"model", CheckpointShapeJson(shape_)},
                     {"layout", layout},
                     {"files", files}};
  WriteDurably((fs::path(partial) / "metadata.json").string(), meta.dump(2));
  for (int writer : Writers(layout_)) fs::remove(fs::path(partial) / Sidecar(writer));
  SyncDirectory(partial);
  const fs::path final_dir = fs::path(path_) / name;
  // A checkpoint of this step from a run that was resumed before it is replaced; another
  // model's is not this run's to delete.
  if (WholeCheckpointOfAnotherModel(final_dir.string(), shape_)) {
    throw CheckpointError(final_dir.string() + " holds a checkpoint of another model, which stays");
  }
  std::error_code error;
  fs::remove_all(final_dir, error);
  fs::rename(partial, final_dir, error);
  if (error) throw CheckpointError("cannot rename " + partial + " to " + final_dir.string() + ": " + error.message());
  SyncDirectory(path_);
  const std::string latest_tmp = (fs::path(path_) / "latest.tmp").string();
  WriteDurably(latest_tmp, name + "\n");
  fs::rename(latest_tmp, fs::path(path_) / "latest", error);
  if (error) throw CheckpointError("cannot rename " + latest_tmp + ": " + error.message());
  SyncDirectory(path_);
  // Keep the newest `keep` checkpoints of this run's lineage, this one among them. That
  // lineage is the directories named as StepName names them, of an earlier step, whose
  // metadata reads as this model's. Nothing else is counted or deleted: stray names,
  // damaged checkpoints and other models' stay for a person to look at, as do newer steps
  // (ones a resume skipped). Partial directories of earlier steps are failed checkpoints
  // (a later one may be in progress already: it stays).
  std::vector<std::pair<int64_t, fs::path>> older;
  for (const fs::directory_entry& entry : fs::directory_iterator(path_, error)) {
    const std::string entry_name = entry.path().filename().string();
    if (entry_name.starts_with(".partial-step-") && entry_name < ".partial-" + name) fs::remove_all(entry.path(), error);
    const std::optional<int64_t> step = StepOfName(entry_name);
    if (!step || *step >= position.step || !entry.is_directory()) continue;
    try {
      const fs::path file = entry.path() / "metadata.json";
      ParseCheckpointMetadata(ReadCheckpointFile(file), file.string(), shape_);
      older.emplace_back(*step, entry.path());
    } catch (const CheckpointError&) {  // not this run's
    }
  }
  std::sort(older.begin(), older.end(), std::greater<>());
  for (size_t i = size_t(keep_ - 1); i < older.size(); ++i) fs::remove_all(older[i].second, error);
}

}  // namespace meshtrain::train
