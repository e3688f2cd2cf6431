#include "api/manifest.h"

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "api/defaults.h"
#include "api/json_codec.h"
#include "api/validation.h"

namespace meshtrain::api {
namespace {

using Json = nlohmann::json;

constexpr int kMaxDepth = 64;
// Bounds alias expansion ("billion laughs"): the converted documents may be at
// most this much larger than the text, counting each value as 64 bytes plus its scalar.
constexpr size_t kExpansionFactor = 4;
constexpr size_t kExpansionAllowance = size_t(1) << 20;

std::string Located(std::string_view source, int line, int column, std::string_view message) {
  std::ostringstream out;
  out << source;
  if (line > 0) out << ":" << line << ":" << column;
  out << ": " << message;
  return out.str();
}

[[noreturn]] void FailAt(std::string_view source, const YAML::Mark& mark, std::string_view message) {
  throw ManifestError(Located(source, mark.is_null() ? 0 : mark.line + 1, mark.column + 1, message));
}

// YAML 1.1 booleans, as kubectl (go-yaml v2) reads them.
std::optional<bool> PlainBool(std::string_view s) {
  for (std::string_view t : {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON", "y", "Y"}) {
    if (s == t) return true;
  }
  for (std::string_view f : {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF", "n", "N"}) {
    if (s == f) return false;
  }
  return std::nullopt;
}

std::optional<Json> PlainInteger(std::string_view s) {
  std::string_view digits = s;
  bool negative = false;
  if (!digits.empty() && (digits[0] == '+' || digits[0] == '-')) {
    negative = digits[0] == '-';
    digits.remove_prefix(1);
  }
  int base = 10;
  if (digits.starts_with("0x")) base = 16, digits.remove_prefix(2);
  else if (digits.starts_with("0o")) base = 8, digits.remove_prefix(2);
  if (digits.empty()) return std::nullopt;
  uint64_t magnitude = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), magnitude, base);
  if (end != digits.data() + digits.size()) return std::nullopt;
  if (ec == std::errc::result_out_of_range) return std::nullopt;  // falls through to float
  if (!negative) return Json(magnitude);
  if (magnitude > uint64_t(std::numeric_limits<int64_t>::max()) + 1) return std::nullopt;
  return Json(static_cast<int64_t>(0 - magnitude));
}

std::optional<Json> PlainFloat(std::string_view s) {
  std::string_view body = s;
  bool negative = false;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    negative = body[0] == '-';
    body.remove_prefix(1);
  }
  if (body == ".inf" || body == ".Inf" || body == ".INF") {
    return Json(negative ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity());
  }
  if (s == ".nan" || s == ".NaN" || s == ".NAN") return Json(std::numeric_limits<double>::quiet_NaN());
  // [0-9]*(.[0-9]*)?([eE][-+]?[0-9]+)? with at least one digit before the exponent.
  size_t i = 0, mantissa_digits = 0;
  while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++mantissa_digits;
  if (i < body.size() && body[i] == '.') {
    ++i;
    while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++mantissa_digits;
  }
  if (mantissa_digits == 0) return std::nullopt;
  if (i < body.size() && (body[i] == 'e' || body[i] == 'E')) {
    ++i;
    if (i < body.size() && (body[i] == '+' || body[i] == '-')) ++i;
    size_t exponent_digits = 0;
    while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++exponent_digits;
    if (exponent_digits == 0) return std::nullopt;
  }
  if (i != body.size()) return std::nullopt;
  double value = 0;
  auto [end, ec] = std::from_chars(body.data(), body.data() + body.size(), value);
  if (end != body.data() + body.size() || ec != std::errc()) value = std::numeric_limits<double>::infinity();
  return Json(negative ? -value : value);
}

Json PlainScalar(const std::string& s) {
  if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
  if (auto b = PlainBool(s)) return *b;
  if (auto i = PlainInteger(s)) return *i;
  if (auto f = PlainFloat(s)) return *f;
  return s;
}

class YamlConverter {
 public:
  YamlConverter(std::string_view source, size_t text_size)
      : source_(source), budget_bytes_(kExpansionAllowance + kExpansionFactor * text_size) {}

  Json Convert(const YAML::Node& node, int depth) {
    if (depth > kMaxDepth) FailAt(source_, node.Mark(), "nesting is deeper than " + std::to_string(kMaxDepth));
    expanded_bytes_ += 64 + (node.IsScalar() ? node.Scalar().size() : 0);
    if (expanded_bytes_ > budget_bytes_) {
      FailAt(source_, node.Mark(), "document expands to too many values (aliases repeated too often?)");
    }
    switch (node.Type()) {
      case YAML::NodeType::Null:
      case YAML::NodeType::Undefined:
        return nullptr;
      case YAML::NodeType::Scalar:
        // "!" marks a quoted scalar; !!str an explicit string. Everything else is resolved.
        if (node.Tag() == "!" || node.Tag() == "tag:yaml.org,2002:str") return node.Scalar();
        return PlainScalar(node.Scalar());
      case YAML::NodeType::Sequence: {
        Json out = Json::array();
        for (const YAML::Node& item : node) out.push_back(Convert(item, depth + 1));
        return out;
      }
      case YAML::NodeType::Map: {
        Json out = Json::object();
        for (const auto& entry : node) {
          const YAML::Node& key = entry.first;
          if (!key.IsScalar()) FailAt(source_, key.Mark(), "map keys must be plain strings");
          if (out.contains(key.Scalar())) FailAt(source_, key.Mark(), "duplicate key \"" + key.Scalar() + "\"");
          out[key.Scalar()] = Convert(entry.second, depth + 1);
        }
        return out;
      }
    }
    return nullptr;
  }

 private:
  std::string_view source_;
  size_t budget_bytes_;
  size_t expanded_bytes_ = 0;
};

// Rejects deep [ { nesting before nlohmann's parser sees it.
void CheckJsonDepth(std::string_view text, std::string_view source) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxDepth) throw ManifestError(Located(source, 0, 0, "JSON nesting is too deep"));
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

std::pair<int, int> LineColumnOf(std::string_view text, size_t offset) {
  int line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') ++line, column = 1;
    else ++column;
  }
  return {line, column};
}

// The offset of the first byte that is not well-formed UTF-8 (no overlong forms,
// surrogates or code points past U+10FFFF), or npos.
size_t FirstInvalidUtf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t length = 0;
    unsigned char min_second = 0x80, max_second = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) length = 2;
    else if (c >= 0xE0 && c <= 0xEF) length = 3, min_second = c == 0xE0 ? 0xA0 : 0x80, max_second = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) length = 4, min_second = c == 0xF0 ? 0x90 : 0x80, max_second = c == 0xF4 ? 0x8F : 0xBF;
    else return i;
    if (i + length > n || s[i + 1] < min_second || s[i + 1] > max_second) return i;
    for (size_t k = 2; k < length; ++k) {
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
    }
    i += length;
  }
  return std::string_view::npos;
}

std::vector<ManifestDocument> ParseJson(std::string_view text, std::string_view source) {
  CheckJsonDepth(text, source);
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::parse_error& e) {
    auto [line, column] = LineColumnOf(text, e.byte == 0 ? 0 : e.byte - 1);
    std::string message = e.what();
    // nlohmann prefixes "[json.exception.parse_error.101] parse error at line 1, column 2: ".
    if (auto colon = message.find(": "); colon != std::string::npos) message = message.substr(colon + 2);
    throw ManifestError(Located(source, line, column, message));
  }
  std::vector<ManifestDocument> documents;
  if (root.is_array()) {
    for (size_t i = 0; i < root.size(); ++i) documents.push_back({int(i), 0, std::move(root[i])});
  } else {
    documents.push_back({0, 1, std::move(root)});
  }
  return documents;
}

std::vector<ManifestDocument> ParseYaml(std::string_view text, std::string_view source) {
  std::vector<YAML::Node> nodes;
  try {
    nodes = YAML::LoadAll(std::string(text));
  } catch (const YAML::Exception& e) {
    FailAt(source, e.mark, e.msg);
  }
  std::vector<ManifestDocument> documents;
  YamlConverter converter(source, text.size());
  for (const YAML::Node& node : nodes) {
    if (node.IsNull()) continue;  // an empty document, such as a trailing `---`
    try {
      const int line = node.Mark().is_null() ? 0 : node.Mark().line + 1;
      documents.push_back({int(documents.size()), line, converter.Convert(node, 0)});
    } catch (const YAML::Exception& e) {
      FailAt(source, e.mark, e.msg);
    }
  }
  return documents;
}

// kubectl's `kind: List` wraps other objects in `items`.
std::vector<ManifestDocument> ExpandLists(std::vector<ManifestDocument> documents) {
  std::vector<ManifestDocument> out;
  for (ManifestDocument& doc : documents) {
    const Json& obj = doc.object;
    if (obj.is_object() && obj.value("kind", Json()) == "List" && obj.contains("items") && obj["items"].is_array()) {
      for (const Json& item : obj["items"]) out.push_back({int(out.size()), doc.line, item});
    } else {
      doc.index = int(out.size());
      out.push_back(std::move(doc));
    }
  }
  return out;
}

}  // namespace

std::vector<ManifestDocument> ParseManifestText(std::string_view text, std::string_view source) {
  if (text.size() > kMaxManifestBytes) {
    throw ManifestError(Located(source, 0, 0, "is larger than " + std::to_string(kMaxManifestBytes >> 20) + " MiB"));
  }
  if (text.find('\0') != std::string_view::npos) {
    throw ManifestError(Located(source, 0, 0, "is not text (it contains NUL bytes)"));
  }
  if (const size_t bad = FirstInvalidUtf8(text); bad != std::string_view::npos) {
    auto [line, column] = LineColumnOf(text, bad);
    throw ManifestError(Located(source, line, column, "is not valid UTF-8"));
  }
  const size_t first = text.find_first_not_of(" \t\r\n");
  const bool json = first != std::string_view::npos && (text[first] == '{' || text[first] == '[');
  return ExpandLists(json ? ParseJson(text, source) : ParseYaml(text, source));
}

std::vector<ManifestDocument> ReadManifestFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ManifestError(path + ": cannot open: " + std::strerror(errno));
  std::string text;
  char buffer[1 << 16];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    text.append(buffer, size_t(in.gcount()));
    if (text.size() > kMaxManifestBytes) break;  // ParseManifestText reports it
  }
  if (in.bad()) throw ManifestError(path + ": read error: " + std::strerror(errno));
  return ParseManifestText(text, path);
}

std::string CheckedJob::Where() const {
  std::string where = source;
  if (document > 0) where += " (document " + std::to_string(document + 1) + ")";
  if (!job.metadata.name.empty()) where += " TrainingJob \"" + job.metadata.name + "\"";
  return where;
}

CheckedJob CheckTrainingJob(const Json& object, std::string source, int document) {
  CheckedJob checked{std::move(source), document, {}, {}};
  checked.job = DecodeTrainingJob(object, &checked.errors);
  ApplyDefaults(&checked.job);
  // A field that failed to decode holds its default, and checks against it would
  // report problems the manifest does not have: validate once every value decoded.
  for (const FieldError& e : checked.errors) {
    if (e.type == FieldErrorType::kUndecodable) return checked;
  }
  for (FieldError& e : ValidateTrainingJob(checked.job)) checked.errors.push_back(std::move(e));
  return checked;
}

std::vector<CheckedJob> LoadTrainingJobs(const std::string& path) {
  std::vector<CheckedJob> jobs;
  for (const ManifestDocument& doc : ReadManifestFile(path)) {
    jobs.push_back(CheckTrainingJob(doc.object, path, doc.index));
  }
  if (jobs.empty()) throw ManifestError(path + ": holds no documents");
  return jobs;
}

}  // namespace meshtrain::api
