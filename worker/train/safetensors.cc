#include "worker/train/safetensors.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "worker/train/atomic_file.h"

namespace meshtrain::train {
namespace {

using Json = nlohmann::json;

// The header may not be larger than this (the format's own limit is 100 MB).
constexpr uint64_t kMaxHeader = 100u << 20;

float FromHalf(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24
    const float value = float(mantissa) * (1.0f / 16777216.0f);
    return sign ? -value : value;
  }
  const uint32_t bits = exponent == 31 ? sign | 0x7F800000u | (mantissa << 13)
                                       : sign | ((exponent + 112) << 23) | (mantissa << 13);
  return std::bit_cast<float>(bits);
}

}  // namespace

std::map<std::string, Tensor> ReadSafetensors(const std::string& path) {
  if (NotARegularFile(path)) throw SafetensorsError(path + ": is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SafetensorsError(path + ": missing or unreadable");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 8) throw SafetensorsError(path + ": too short for a safetensors header");
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = header_size << 8 | uint8_t(bytes[size_t(i)]);
  if (header_size > kMaxHeader || header_size > bytes.size() - 8) {
    throw SafetensorsError(path + ": header of " + std::to_string(header_size) + " bytes does not fit the file");
  }
  Json header;
  try {
    header = Json::parse(bytes.substr(8, header_size));
  } catch (const Json::exception& e) {
    throw SafetensorsError(path + ": header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) throw SafetensorsError(path + ": header is not a JSON object");
  const size_t data_begin = 8 + header_size, data_size = bytes.size() - data_begin;
  std::map<std::string, Tensor> tensors;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = path + ": tensor " + name;
    try {
      const std::string dtype = entry.at("dtype");
      const size_t element = dtype == "F32" ? 4 : dtype == "F16" || dtype == "BF16" ? 2 : 0;
      if (element == 0) throw SafetensorsError(where + ": dtype " + dtype + " (F32, F16 or BF16 expected)");
      Tensor t;
      uint64_t count = 1;
      for (const Json& d : entry.at("shape")) {
        const int64_t dim = d.get<int64_t>();
        if (dim < 0 || (dim > 0 && count > (uint64_t(1) << 40) / uint64_t(dim))) {
          throw SafetensorsError(where + ": shape " + entry.at("shape").dump() + " is not a tensor's");
        }
        t.shape.push_back(dim);
        count *= uint64_t(dim);
      }
      const uint64_t begin = entry.at("data_offsets").at(0), end = entry.at("data_offsets").at(1);
      if (begin > end || end > data_size || end - begin != count * element) {
        throw SafetensorsError(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                               ") do not hold " + std::to_string(count) + " " + dtype + " values in " +
                               std::to_string(data_size) + " bytes of data");
      }
      const char* data = bytes.data() + data_begin + begin;
      t.values.resize(count);
      for (uint64_t i = 0; i < count; ++i) {
        if (element == 4) {
          uint32_t bits = 0;
          for (int b = 3; b >= 0; --b) bits = bits << 8 | uint8_t(data[4 * i + uint64_t(b)]);
          t.values[i] = std::bit_cast<float>(bits);
        } else {
          const uint16_t half = uint16_t(uint8_t(data[2 * i]) | uint8_t(data[2 * i + 1]) << 8);
          t.values[i] = dtype == "BF16" ? std::bit_cast<float>(uint32_t(half) << 16) : FromHalf(half);
        }
      }
      tensors.emplace(name, std::move(t));
    } catch (const Json::exception& e) {
      throw SafetensorsError(where + ": malformed entry: " + e.what());
    }
  }
  return tensors;
}

void WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t bytes = t.values.size() * 4;
    header[name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned, as the format advises
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(text.size()) >> (8 * i)) & 0xFF);
  out += text;
  for (const auto& [name, t] : tensors) {
    for (float v : t.values) {
      const uint32_t bits = std::bit_cast<uint32_t>(v);
      for (int b = 0; b < 4; ++b) out.push_back(char((bits >> (8 * b)) & 0xFF));
    }
  }
  // Never in place: a full disk would leave the previous good file truncated.
  if (const std::string error = WriteFileAtomically(path, out.data(), out.size()); !error.empty()) {
    throw SafetensorsError(path + ": " + error);
  }
}

}  // namespace meshtrain::train
