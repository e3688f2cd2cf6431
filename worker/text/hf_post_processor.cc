#include "worker/text/hf_post_processor.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "worker/text/tokenizer.h"

namespace meshtrain::text::hf {

void ParsePostProcessor(const Json& j, const std::string& source, const std::string& path,
                        TokenizerEngine::Specials& specials) {
  if (j.is_null()) return;
  const std::string type = TypeOf(j, source, path);
  if (type == "Sequence") {
    const Json& list = j.value("processors", Json());
    if (!list.is_array()) Fail(source, path + ".processors", "expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      ParsePostProcessor(list[i], source, path + ".processors[" + std::to_string(i) + "]", specials);
    }
  } else if (type == "ByteLevel") {
    // Only offsets: no ids.
  } else if (type == "TemplateProcessing") {
    const Json& single = j.value("single", Json());
    const Json& tokens = j.value("special_tokens", Json::object());
    if (!single.is_array()) Fail(source, path + ".single", "expected an array");
    specials.has_template = true;
    bool after = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string at = path + ".single[" + std::to_string(i) + "]";
      const Json& piece = single[i];
      if (piece.contains("Sequence")) {
        after = true;
      } else if (piece.contains("SpecialToken") && piece["SpecialToken"].contains("id")) {
        const std::string name = StringField(piece["SpecialToken"], "id", source, at + ".SpecialToken");
        if (!tokens.contains(name) || !tokens[name].contains("ids") || !tokens[name]["ids"].is_array()) {
          Fail(source, at, "special token \"" + name + "\" is not in " + path + ".special_tokens");
        }
        for (const Json& id : tokens[name]["ids"]) {
          if (!id.is_number_unsigned() || id.get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
            Fail(source, path + ".special_tokens." + name + ".ids", "expected ids, got " + id.dump());
          }
          (after ? specials.template_after : specials.template_before).push_back(id.get<uint32_t>());
        }
      } else {
        Fail(source, at, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
  } else {
    Fail(source, path, "post-processor type \"" + type + "\" is not implemented");
  }
}

void CheckTemplateIds(const TokenizerEngine::Specials& specials, size_t vocab_size, const std::string& source) {
  for (const std::vector<uint32_t>* ids : {&specials.template_before, &specials.template_after}) {
    for (uint32_t id : *ids) {
      if (id >= vocab_size) {
        throw TokenizerError(source + ": post_processor: id " + std::to_string(id) + " is past the vocabulary");
      }
    }
  }
}

}  // namespace meshtrain::text::hf
