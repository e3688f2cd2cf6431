#include "api/manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/exceptions.h>
#include <yaml-cpp/mark.h>
#include <yaml-cpp/parser.h>

#include "api/defaults.h"
#include "api/hf_config.h"
#include "api/json_codec.h"
#include "api/json_depth.h"
#include "api/validation.h"
#include "api/warnings.h"

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

// Removes a leading '+' or '-' from *s; true if it was '-'.
bool TakeSign(std::string_view* s) {
  if (s->empty() || (s->front() != '+' && s->front() != '-')) return false;
  const bool negative = s->front() == '-';
  s->remove_prefix(1);
  return negative;
}

std::optional<Json> PlainInteger(std::string_view s) {
  std::string_view digits = s;
  const bool negative = TakeSign(&digits);
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
  const bool negative = TakeSign(&body);
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

// Builds JSON values straight from yaml-cpp's parse events. Keeping no node tree
// lets it type scalars as kubectl does, bound alias expansion, and report every
// problem at the event's mark.
class JsonEventBuilder : public YAML::EventHandler {
 public:
  JsonEventBuilder(std::string_view source, size_t text_size)
      : source_(source), budget_bytes_(kExpansionAllowance + kExpansionFactor * text_size) {}

  std::vector<ManifestDocument> TakeDocuments() { return std::move(documents_); }
  const YAML::Mark& document_mark() const { return document_mark_; }

  void OnDocumentStart(const YAML::Mark& mark) override {
    document_mark_ = mark;
    anchors_.clear();
  }
  void OnDocumentEnd() override {
    if (!root_.is_null()) documents_.push_back({int(documents_.size()), root_line_, std::move(root_)});
    root_ = nullptr;
  }

  void OnNull(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    if (ExpectingKey()) FailAt(source_, mark, "map keys must be plain strings, got an empty key");
    Charge(mark, 64);
    Attach(mark, nullptr, anchor, 64);
  }

  void OnAlias(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    if (ExpectingKey()) FailAt(source_, mark, "map keys must be plain strings, got an alias");
    auto it = anchors_.find(anchor);
    if (it == anchors_.end()) FailAt(source_, mark, "alias refers to an anchor that is not complete here");
    Charge(mark, it->second.cost);
    Attach(mark, it->second.value, YAML::NullAnchor, it->second.cost);
  }

  void OnScalar(const YAML::Mark& mark, const std::string& tag, YAML::anchor_t anchor,
                const std::string& value) override {
    const size_t cost = 64 + value.size();
    Charge(mark, cost);
    if (ExpectingKey()) {
      Frame& map = stack_.back();
      if (map.value.contains(value)) FailAt(source_, mark, "duplicate key \"" + value + "\"");
      map.key = value;
      return;
    }
    // "!" marks a quoted scalar, !!str an explicit string; everything else is resolved.
    const bool string = tag == "!" || tag == "tag:yaml.org,2002:str";
    Attach(mark, string ? Json(value) : PlainScalar(value), anchor, cost);
  }

  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    Open(mark, Json::array(), anchor);
  }
  void OnSequenceEnd() override { Close(); }

  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    Open(mark, Json::object(), anchor);
  }
  void OnMapEnd() override { Close(); }

 private:
  struct Frame {
    Json value;  // the array or object being filled
    YAML::Mark mark;
    YAML::anchor_t anchor;
    size_t cost_at_start;
    std::optional<std::string> key;  // for objects: the key whose value comes next
  };
  struct Anchored {
    Json value;
    size_t cost;
  };

  bool ExpectingKey() const { return !stack_.empty() && stack_.back().value.is_object() && !stack_.back().key; }

  void Charge(const YAML::Mark& mark, size_t bytes) {
    cost_ += bytes;
    if (cost_ > budget_bytes_) FailAt(source_, mark, "document expands to too many values (aliases repeated too often?)");
  }

  void Open(const YAML::Mark& mark, Json container, YAML::anchor_t anchor) {
    if (ExpectingKey()) FailAt(source_, mark, "map keys must be plain strings, got a collection");
    if (int(stack_.size()) >= kMaxDepth) FailAt(source_, mark, "nesting is deeper than " + std::to_string(kMaxDepth));
    Charge(mark, 64);
    stack_.push_back({std::move(container), mark, anchor, cost_ - 64, std::nullopt});
  }

  void Close() {
    Frame frame = std::move(stack_.back());
    stack_.pop_back();
    Attach(frame.mark, std::move(frame.value), frame.anchor, cost_ - frame.cost_at_start);
  }

  // Places a finished value into its parent, or makes it the document's root.
  void Attach(const YAML::Mark& mark, Json value, YAML::anchor_t anchor, size_t cost) {
    if (anchor != YAML::NullAnchor) anchors_[anchor] = {value, cost};
    if (stack_.empty()) {
      root_ = std::move(value);
      root_line_ = mark.is_null() ? 0 : mark.line + 1;
      return;
    }
    Frame& parent = stack_.back();
    if (parent.value.is_array()) {
      parent.value.push_back(std::move(value));
    } else {
      parent.value[*parent.key] = std::move(value);
      parent.key.reset();
    }
  }

  std::string_view source_;
  size_t budget_bytes_;
  size_t cost_ = 0;
  YAML::Mark document_mark_;
  std::vector<Frame> stack_;
  std::map<YAML::anchor_t, Anchored> anchors_;
  Json root_;
  int root_line_ = 0;
  std::vector<ManifestDocument> documents_;
};

// Rejects deep [ { nesting before nlohmann's parser sees it.
void CheckJsonDepth(std::string_view text, std::string_view source) {
  if (FirstJsonLevelDeeperThan(text, kMaxDepth) != std::string_view::npos) {
    throw ManifestError(Located(source, 0, 0, "JSON nesting is too deep"));
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
  } catch (const Json::exception& e) {  // out_of_range: a number too large for a double
    std::string message = e.what();
    if (auto bracket = message.find("] "); bracket != std::string::npos) message = message.substr(bracket + 2);
    throw ManifestError(Located(source, 0, 0, message));
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
  std::istringstream in{std::string(text)};
  JsonEventBuilder builder(source, text.size());
  try {
    YAML::Parser parser(in);
    std::optional<int> last_start;
    while (parser.HandleNextDocument(builder)) {
      // yaml-cpp 0.7 reports an empty document at the same place forever when a
      // token cannot start a node (a stray ','): yaml-cpp issue 1040.
      if (last_start == builder.document_mark().pos) {
        FailAt(source, builder.document_mark(), "unexpected character: no YAML node can start here");
      }
      last_start = builder.document_mark().pos;
    }
  } catch (const YAML::Exception& e) {
    FailAt(source, e.mark, e.msg);
  }
  return builder.TakeDocuments();
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

std::string ManifestSourceName(const std::string& path) { return path == "-" ? "<stdin>" : path; }

std::vector<ManifestDocument> ReadManifestFile(const std::string& path) {
  const bool standard_input = path == "-";
  const std::string source = ManifestSourceName(path);
  // O_NONBLOCK: the open of a FIFO would otherwise wait for a writer, perhaps forever.
  // Reads block again once it is open, so a pipe is read to its end, and a FIFO no one
  // holds open for writing reads as empty.
  const int fd = standard_input ? STDIN_FILENO : ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw ManifestError(source + ": cannot open: " + std::strerror(errno));
  struct Closer {
    int fd;
    bool owned;
    ~Closer() {
      if (owned) ::close(fd);
    }
  } closer{fd, !standard_input};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw ManifestError(source + ": cannot stat: " + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw ManifestError(source + ": is a directory, not a manifest file");
  if (!standard_input && ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
    throw ManifestError(source + ": cannot read: " + std::strerror(errno));
  }
  std::string text;
  char buffer[1 << 16];
  while (text.size() <= kMaxManifestBytes) {  // one byte past the limit: ParseManifestText reports it
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      throw ManifestError(source + ": read error: " + std::strerror(errno));
    }
    text.append(buffer, size_t(got));
  }
  return ParseManifestText(text, source);
}

std::string CheckedJob::Where() const {
  std::string where = source;
  if (document > 0) where += " (document " + std::to_string(document + 1) + ")";
  if (!job.metadata.name.empty()) where += " TrainingJob \"" + job.metadata.name + "\"";
  return where;
}

namespace {

// "3", "3 or 5", "2, 3 or 5"
std::string SizeList(const std::vector<int64_t>& sizes) {
  std::string list;
  for (size_t i = 0; i < sizes.size(); ++i)
    list += (i == 0 ? "" : i + 1 == sizes.size() ? " or " : ", ") + std::to_string(sizes[i]);
  return list;
}

// spec.elastic.minNodes of a valid job in manual mode: each size from spec.nodes - 1 down
// to it is checked as the operator checks a shrunk gang's spec (without spec.elastic), and
// the sizes that cannot run the layout are named in a warning, which says so when that is
// every size. A warning, not an error: a job the operator already runs stays valid under
// an operator that checks more. With mode auto the planner chooses each size's layout.
// `as_written` is the job as decoded, before defaults: each size derives its own.
void CheckElasticSizes(const TrainingJob& as_written, const FieldPaths& written, CheckedJob* checked) {
  const std::optional<int64_t> min_nodes = checked->job.spec.elastic.min_nodes;
  const int64_t nodes = checked->job.spec.nodes;
  if (!min_nodes || *min_nodes >= nodes || checked->job.spec.parallelism.mode == "auto") return;
  std::vector<int64_t> refused;
  std::string first_reason;
  for (int64_t size = nodes - 1; size >= *min_nodes; --size) {
    TrainingJob smaller = as_written;
    smaller.spec.elastic = {};
    smaller.spec.nodes = size;
    ApplyDefaults(&smaller, written);
    const FieldErrors errors = ValidateTrainingJob(smaller);
    if (errors.empty()) continue;
    refused.insert(refused.begin(), size);
    if (first_reason.empty()) first_reason = "at " + std::to_string(size) + " nodes, " + errors.front().ToString();
  }
  if (refused.empty()) return;
  if (int64_t(refused.size()) == nodes - *min_nodes) {
    checked->warnings.push_back({"spec.elastic.minNodes",
                                 "no smaller gang (" + SizeList(refused) + " nodes) can run this job's layout (" +
                                     first_reason + "), so the job can never shrink; it has no effect"});
  } else {
    checked->warnings.push_back({"spec.elastic.minNodes", "a gang of " + SizeList(refused) +
                                                               " nodes cannot run this job's layout (" + first_reason +
                                                               "); a shrink skips those sizes"});
  }
}

// Merges spec.model.init.from's config.json into the job's model before defaults, as
// `directory` says (ModelDirectory); notes go to the warnings of a valid job.
void ReadModelDirectory(ModelDirectory directory, CheckedJob* checked, FieldErrors* notes) {
  ModelSpec& model = checked->job.spec.model;
  const std::string& from = model.init.from;
  if (from.empty()) return;
  struct stat st {};
  const bool exists = ::stat(from.c_str(), &st) == 0;
  // Not on this machine (a volume of the pods'), or a single GPT-2 file: the shape is
  // spec.model's, and each worker checks it against the files when it starts.
  if (!exists || !S_ISDIR(st.st_mode)) return;
  const bool shape_written = model.layers || model.hidden || !model.preset.empty();
  try {
    const HuggingFaceConfig config = ReadHuggingFaceConfig(from);
    for (FieldError& e : MergeHuggingFaceConfig(config, &model)) checked->errors.push_back(std::move(e));
    // Its load-balancing loss, unless the job sets its own coefficient.
    std::optional<double>& coef = checked->job.spec.training.router_aux_loss_coef;
    if (config.router_aux_loss_coef && !coef) {
      coef = config.router_aux_loss_coef;
      notes->push_back({"spec.training.routerAuxLossCoef",
                        config.file + ": output_router_logits is true: the load-balancing loss is on, coefficient " +
                            std::to_string(*coef)});
    }
    for (const std::string& note : config.notes) notes->push_back({"spec.model.init.from", config.file + ": " + note});
  } catch (const HuggingFaceConfigError& e) {
    checked->errors.push_back({"spec.model.init.from", e.what()});
    return;
  }
  if (!shape_written && directory == ModelDirectory::kIfPresent) {
    notes->push_back({"spec.model", "the shape comes from " + from + "/config.json here; under the operator, which "
                                    "cannot read it, give it in spec.model (`meshtrain model-spec " + from +
                                    "` prints the fields)"});
  }
}

}  // namespace

CheckedJob CheckTrainingJob(const Json& object, std::string source, int document, ModelDirectory directory) {
  CheckedJob checked{std::move(source), document, object, {}, {}, {}, {}};
  checked.job = DecodeTrainingJob(object, &checked.errors);
  const FieldPaths written = WrittenFields(object);
  FieldErrors notes;
  if (directory != ModelDirectory::kNotRead) ReadModelDirectory(directory, &checked, &notes);
  const TrainingJob as_written = checked.job;  // with the shape config.json gave, before defaults
  checked.defaults = ApplyDefaults(&checked.job, written);
  // A field that failed to decode holds its default, and checks against it would
  // report problems the manifest does not have: validate once every value decoded.
  for (const FieldError& e : checked.errors) {
    if (e.type == FieldErrorType::kUndecodable) return checked;
  }
  for (FieldError& e : ValidateTrainingJob(checked.job)) checked.errors.push_back(std::move(e));
  for (FieldError& e : FieldsThePlannerChooses(checked.job, written)) checked.errors.push_back(std::move(e));
  if (checked.ok()) checked.warnings = FieldsWithoutEffect(checked.job, written);
  if (checked.ok()) CheckElasticSizes(as_written, written, &checked);
  for (FieldError& note : notes) checked.warnings.push_back(std::move(note));
  return checked;
}

std::vector<CheckedJob> LoadTrainingJobs(const std::string& path, const std::string& name,
                                         ModelDirectory directory) {
  std::vector<CheckedJob> jobs;
  const std::string source = name.empty() ? ManifestSourceName(path) : name;
  for (const ManifestDocument& doc : ReadManifestFile(path)) {
    jobs.push_back(CheckTrainingJob(doc.object, source, doc.index, directory));
  }
  if (jobs.empty()) throw ManifestError(source + ": holds no documents");
  return jobs;
}

}  // namespace meshtrain::api
