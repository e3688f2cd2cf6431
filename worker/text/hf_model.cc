#include "worker/text/hf_model.h"

#include <sstream>

#include "worker/text/tokenizer.h"

namespace meshtrain::text::hf {

void CheckModelType(const Json& model, const std::string& source) {
  const std::string type = model.is_object() && model.contains("type") && model["type"].is_string()
                               ? model["type"].get<std::string>()
                               : "";
  if (type != "BPE") {
    Fail(source, "model.type", "\"" + type + "\" is not implemented; only \"BPE\" (tokenizer.model for SentencePiece)");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0)) {
    Fail(source, "model.dropout", "BPE dropout (random merges) is not implemented; it must be null");
  }
}

BpeModel ParseBpeModel(const Json& model, bool byte_level, const std::string& source,
                       std::vector<std::pair<std::string, uint32_t>>& vocab) {
  BpeModel::Options options;
  options.byte_level = byte_level;
  options.byte_fallback = BoolField(model, "byte_fallback", false, source, "model");
  options.fuse_unk = BoolField(model, "fuse_unk", false, source, "model");
  options.ignore_merges = BoolField(model, "ignore_merges", false, source, "model");
  if (model.contains("unk_token") && !model["unk_token"].is_null()) options.unk_token = StringField(model, "unk_token", source, "model");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null()) {
      (key[0] == 'c' ? options.continuing_subword_prefix : options.end_of_word_suffix) = StringField(model, key, source, "model");
    }
  }
  const Json& tokens = model.value("vocab", Json());
  if (!tokens.is_object() || tokens.empty()) Fail(source, "model.vocab", "expected a non-empty object");
  vocab.clear();
  for (const auto& [token, id] : tokens.items()) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() >= (uint64_t(1) << 31)) {
      Fail(source, "model.vocab", "token \"" + token + "\" has id " + id.dump() + ", not an id");
    }
    vocab.emplace_back(token, id.get<uint32_t>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  const Json& merge_list = model.value("merges", Json::array());
  if (!merge_list.is_array()) Fail(source, "model.merges", "expected an array");
  for (size_t i = 0; i < merge_list.size(); ++i) {
    const Json& m = merge_list[i];
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      const size_t space = line.find(' ', 1);
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        Fail(source, "model.merges[" + std::to_string(i) + "]", "\"" + line + "\" is not a merge of two tokens");
      }
      merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      Fail(source, "model.merges[" + std::to_string(i) + "]", m.dump().substr(0, 80) + " is not a merge");
    }
  }
  return BpeModel::Build(vocab, merges, options, source);
}

std::vector<std::pair<std::string, std::string>> ParseMergeLines(std::string_view text, const std::string& source) {
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream lines{std::string(text)};
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (number == 1 && line.rfind("#version", 0) == 0) continue;
    if (line.empty()) continue;
    std::istringstream parts(line);
    std::string left, right, extra;
    if (!(parts >> left >> right) || (parts >> extra)) {
      throw TokenizerError(source + ": line " + std::to_string(number) + " is not a merge of two tokens: \"" + line + "\"");
    }
    merges.emplace_back(left, right);
  }
  return merges;
}

}  // namespace meshtrain::text::hf
