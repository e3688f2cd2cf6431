#include "worker/train/checkpoint_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <optional>

#include "worker/train/crc32c.h"

namespace meshtrain::train {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const char* const kSectionNames[3] = {"master weights", "AdamW m", "AdamW v"};

// Reads `bytes` at `offset` of `path`; throws CheckpointError naming the path.
void ReadAt(const std::string& path, int64_t offset, size_t bytes, void* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(path + ": missing or unreadable: " + std::strerror(errno));
  auto* p = static_cast<char*>(out);
  for (size_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd, p + done, bytes - done, off_t(offset + int64_t(done)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n == 0 ? "ends early" : std::strerror(errno);
      ::close(fd);
      throw CheckpointError(path + ": cannot read " + std::to_string(bytes) + " bytes at " + std::to_string(offset) +
                            ": " + why);
    }
    done += size_t(n);
  }
  ::close(fd);
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& directory, const api::ModelShape& shape)
    : directory_(directory), whole_layout_(shape) {
  const fs::path dir(directory), meta_file = dir / "metadata.json";
  const Json meta = ParseCheckpointMetadata(ReadCheckpointFile(meta_file), meta_file.string(), shape);
  position_ = {meta.at("step"), meta.at("dataPosition")};
  const bool chunked = meta.at("version").get<int>() >= 3;
  const Json& layout = meta.at("layout");
  const int T = layout.at("tp"), S = layout.at("shard"), vocab_multiple = meta.value("vocabMultiple", 1);
  const int EP = layout.value("expert", 1);  // checked: it divides S, and each file's expert rank is its shard's
  for (const Json& f : meta.at("files")) {
    const std::string path = (dir / f.at("name").get<std::string>()).string();
    const int shard = f.at("shard");
    // Format 1 and 2 files are one checksummed whole: a chunk per segment, verified below.
    // A pipeline stage's file holds its stage's units; a file of a layout splitting the
    // experts, its shard's (shard % EP).
    std::optional<model::ParameterLayout> slice;
    std::optional<ShardFileLayout> layout_of_file;
    try {
      slice.emplace(shape, f.at("tp").get<int>(), T, vocab_multiple, shard % EP, EP);
      const int64_t chunk_elements = chunked ? f.at("chunkElements").get<int64_t>() : std::max<int64_t>(1, slice->total());
      layout_of_file = LayOutShardFile(*slice, S, shard, chunk_elements, f.value("units", std::vector<int>{}));
    } catch (const std::exception& e) {
      throw CheckpointError(meta_file.string() + ": its layout does not fit the model: " + e.what());
    }
    ShardFile file{path, *slice, std::move(*layout_of_file), {}, {}};
    const int64_t bytes = f.at("bytes"), expected = 3 * file.layout.elements * int64_t(sizeof(float));
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) throw CheckpointError(path + ": missing or unreadable");
    if (!S_ISREG(st.st_mode)) throw CheckpointError(path + ": is not a regular file");
    if (st.st_size != bytes) {
      throw CheckpointError(path + ": truncated or grown: " + std::to_string(st.st_size) + " bytes, the metadata says " +
                            std::to_string(bytes));
    }
    if (bytes != expected) {
      throw CheckpointError(path + ": holds " + std::to_string(bytes) + " bytes, but its shards are " +
                            std::to_string(expected));
    }
    if (chunked) {
      file.checksums = f.at("chunkCrc32c").get<std::vector<uint32_t>>();
      if (file.checksums.size() != 3 * size_t(file.layout.chunks)) {
        throw CheckpointError(meta_file.string() + ": lists " + std::to_string(file.checksums.size()) +
                              " chunk checksums for " + path + ", whose shards make 3 x " +
                              std::to_string(file.layout.chunks) + " chunks");
      }
    } else {
      const std::string data = ReadCheckpointFile(path);
      bytes_read_ += int64_t(data.size());
      if (Crc32c(data.data(), data.size()) != f.at("crc32c").get<uint32_t>()) {
        throw CheckpointError(path + ": checksum mismatch: the data is corrupt");
      }
      file.whole.resize(data.size() / sizeof(float));
      std::memcpy(file.whole.data(), data.data(), data.size());
    }
    files_.push_back(std::move(file));
  }
}

void CheckpointReader::ReadChunk(const ShardFile& file, int section, int chunk, int64_t from, int64_t n, float* out) {
  const int64_t at = section * file.layout.elements + from;
  if (file.checksums.empty()) {  // format 1 or 2, verified whole
    std::memcpy(out, file.whole.data() + at, size_t(n) * sizeof(float));
    return;
  }
  const size_t bytes = size_t(n) * sizeof(float);
  ReadAt(file.path, at * int64_t(sizeof(float)), bytes, out);
  bytes_read_ += int64_t(bytes);
  if (Crc32c(out, bytes) != file.checksums[size_t(section) * size_t(file.layout.chunks) + size_t(chunk)]) {
    throw CheckpointError(file.path + ": checksum mismatch in chunk " + std::to_string(chunk) + " of its " +
                          kSectionNames[section] + ": the data is corrupt");
  }
}

void CheckpointReader::ReadUnit(int unit, const std::vector<int64_t>& whole_indices, float* master, float* m,
                                float* v) {
  const std::pair<int64_t, int64_t> range = whole_layout_.Unit(unit);
  const int64_t begin = range.first, end = range.second;  // not bindings: a lambda below captures them
  if (whole_indices.size() > size_t(INT32_MAX)) throw std::length_error("ReadUnit: a shard of over 2^31 elements");
  // Where each element of the unit goes in the caller's arrays; -1 once it is there, or
  // if the caller does not want it.
  std::vector<int32_t> slot(size_t(end - begin), -1);
  int64_t wanted = 0;
  for (size_t i = 0; i < whole_indices.size(); ++i) {
    const int64_t at = whole_indices[i];
    if (at < 0) {
      master[i] = 0;
      if (m != nullptr) m[i] = v[i] = 0;
      continue;
    }
    if (at < begin || at >= end) {
      throw std::invalid_argument("ReadUnit: element " + std::to_string(at) + " is not in unit " + std::to_string(unit));
    }
    slot[size_t(at - begin)] = int32_t(i);
    ++wanted;
  }
  std::vector<float> chunk[3];
  for (const ShardFile& file : files_) {
    const ShardFileLayout::Segment* found = file.layout.Find(unit);
    if (found == nullptr) continue;  // another stage's
    const ShardFileLayout::Segment& segment = *found;
    for (int c = 0; c < segment.chunks && wanted > 0; ++c) {
      const int64_t from = c * file.layout.chunk_elements;
      const int64_t n = std::min(file.layout.chunk_elements, segment.elements - from);
      const std::vector<int64_t> at = file.layout.WholeIndices(file.slice, segment, from, from + n);
      if (std::none_of(at.begin(), at.end(), [&](int64_t a) { return slot[size_t(a - begin)] >= 0; })) continue;
      const int sections = m != nullptr ? 3 : 1;  // master weights alone: one section
      for (int section = 0; section < sections; ++section) {
        chunk[section].resize(size_t(n));
        ReadChunk(file, section, segment.first_chunk + c, segment.offset + from, n, chunk[section].data());
      }
      for (size_t k = 0; k < at.size(); ++k) {
        int32_t& to = slot[size_t(at[k] - begin)];
        if (to < 0) continue;
        master[to] = chunk[0][k];
        if (m != nullptr) {
          m[to] = chunk[1][k];
          v[to] = chunk[2][k];
        }
        to = -1;
        --wanted;
      }
    }
  }
  if (wanted > 0) {
    const auto gap = std::find_if(slot.begin(), slot.end(), [](int32_t s) { return s >= 0; });
    throw CheckpointError((fs::path(directory_) / "metadata.json").string() + ": the shard files leave element " +
                          std::to_string(begin + (gap - slot.begin())) + " of the model out");
  }
}

void VerifyCheckpoint(const std::string& directory, const api::ModelShape& shape) {
  CheckpointReader reader(directory, shape);
  const model::ParameterLayout whole(shape);
  std::vector<int64_t> indices;
  std::vector<float> master, m, v;
  for (int u = 0; u < whole.units(); ++u) {
    const auto [begin, end] = whole.Unit(u);
    indices.resize(size_t(end - begin));
    std::iota(indices.begin(), indices.end(), begin);
    for (auto* part : {&master, &m, &v}) part->resize(indices.size());
    reader.ReadUnit(u, indices, master.data(), m.data(), v.data());
  }
}

}  // namespace meshtrain::train
