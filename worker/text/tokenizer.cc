#include "worker/text/tokenizer.h"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "api/hf_config.h"
#include "worker/text/tokenizer_engine.h"
#include "worker/text/utf8.h"

namespace meshtrain::text {
namespace {

using Json = nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw TokenizerError(path + ": cannot open");
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw TokenizerError(path + ": read error");
  return data;
}

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

const std::array<uint32_t, 256>& ByteCodePoints() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

// tokenizer_config.json's bos_token or eos_token: a string, an AddedToken object
// ({"content": ...}), or null/absent (nullopt).
std::optional<std::string> ConfigToken(const Json& config, const char* key, const std::string& source) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  const Json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  throw TokenizerError(source + ": " + key + ": expected a string or {\"content\": ...}, got " + v.dump().substr(0, 80));
}

}  // namespace

uint32_t Gpt2ByteCodePoint(uint8_t byte) { return ByteCodePoints()[byte]; }

void RunTasks(size_t n, int threads, const std::function<void(size_t task, int worker)>& task,
              const std::function<size_t(size_t task)>& bytes, const ProgressFn& progress) {
  std::atomic<size_t> next{0}, done_bytes{0};
  std::mutex mutex;
  std::condition_variable changed;
  std::exception_ptr error;
  int running = threads;
  auto work = [&](int worker) {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        task(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        next = n;  // the others stop after their current task
      }
      done_bytes += bytes(i);
    }
    std::lock_guard<std::mutex> lock(mutex);
    --running;
    changed.notify_one();
  };
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) workers.emplace_back(work, t);
  {
    std::unique_lock<std::mutex> lock(mutex);
    while (running > 0) {
      changed.wait_for(lock, std::chrono::seconds(1));
      if (progress && running > 0) {
        lock.unlock();
        progress(done_bytes);
        lock.lock();
      }
    }
  }
  for (std::thread& w : workers) w.join();
  if (error) std::rethrow_exception(error);
}

Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::Load(const std::string& dir) {
  const std::string hf = dir + "/tokenizer.json", spm = dir + "/tokenizer.model", config = dir + "/tokenizer_config.json";
  const std::string encoder = dir + "/encoder.json", merges = dir + "/vocab.bpe";
  const std::string config_json = Exists(config) ? ReadFile(config) : std::string();
  if (Exists(hf)) return FromHuggingFaceFile(ReadFile(hf), hf, config_json, config);
  if (Exists(spm)) return FromSentencePieceModel(ReadFile(spm), spm, config_json, config);
  if (Exists(encoder) && Exists(merges)) {
    Tokenizer t;
    const std::string source = dir + "/{encoder.json,vocab.bpe}";
    t.engine_ = MakeOpenAiEngine(ReadFile(encoder), ReadFile(merges), source);
    t.Configure(config_json, config, source);
    return t;
  }
  throw TokenizerError(dir + ": no tokenizer here: expected tokenizer.json, tokenizer.model, or encoder.json and vocab.bpe");
}

Tokenizer Tokenizer::FromOpenAiFiles(std::string_view encoder_json, std::string_view vocab_bpe, const std::string& source) {
  Tokenizer t;
  t.engine_ = MakeOpenAiEngine(encoder_json, vocab_bpe, source);
  t.Configure({}, {}, source);
  return t;
}

Tokenizer Tokenizer::FromHuggingFaceFile(std::string_view tokenizer_json, const std::string& source,
                                         std::string_view config_json, const std::string& config_source) {
  Tokenizer t;
  t.engine_ = MakeHuggingFaceEngine(tokenizer_json, source);
  t.Configure(config_json, config_source, source);
  return t;
}

Tokenizer Tokenizer::FromSentencePieceModel(std::string_view model, const std::string& source,
                                            std::string_view config_json, const std::string& config_source) {
  Tokenizer t;
  t.engine_ = MakeSentencePieceEngine(model, source);
  t.Configure(config_json, config_source, source);
  return t;
}

void Tokenizer::Configure(std::string_view config_json, const std::string& config_source, const std::string& source) {
  kind_ = engine_->kind();
  Json config = Json::object();
  if (!config_json.empty()) {
    try {
      config = api::ParseModelJson(config_json, config_source);
    } catch (const api::ModelJsonError& e) {
      throw TokenizerError(e.what());
    }
    if (!config.is_object()) throw TokenizerError(config_source + ": expected a JSON object");
  }
  auto id_of = [&](const std::string& token, const char* key) {
    const auto id = engine_->IdOf(token);
    if (!id) throw TokenizerError(config_source + ": " + key + " \"" + token + "\" is not a token of the tokenizer");
    return *id;
  };
  const TokenizerEngine::Specials specials = engine_->specials();
  const std::optional<std::string> bos_name = ConfigToken(config, "bos_token", config_source);
  const std::optional<std::string> eos_name = ConfigToken(config, "eos_token", config_source);
  // EOS: the config's, else the model's own (SentencePiece), else <|endoftext|> (GPT-2's
  // and Qwen's files name no other).
  bool gpt2_style = false;
  if (eos_name) {
    eos_ = id_of(*eos_name, "eos_token");
    gpt2_style = bos_name && *bos_name == *eos_name;
  } else if (specials.eos) {
    eos_ = *specials.eos;
  } else if (const auto eot = engine_->IdOf("<|endoftext|>")) {
    eos_ = *eot;
    gpt2_style = !specials.has_template;
  } else {
    throw TokenizerError((config_json.empty() ? source : config_source) +
                         ": no EOS: tokenizer_config.json names no eos_token, and there is no \"<|endoftext|>\" token");
  }
  // BOS: what add_bos_token says, else the template's, else the model's own.
  std::vector<uint32_t> before;
  if (config.contains("add_bos_token") && !config["add_bos_token"].is_null()) {
    if (!config["add_bos_token"].is_boolean()) throw TokenizerError(config_source + ": add_bos_token: expected true or false");
    if (config["add_bos_token"].get<bool>()) {
      if (!bos_name) throw TokenizerError(config_source + ": add_bos_token is true but bos_token is not set");
      before = {id_of(*bos_name, "bos_token")};
    }
  } else if (specials.has_template) {
    before = specials.template_before;
  } else if (specials.bos) {
    before = {*specials.bos};
  }
  if (bos_name) id_of(*bos_name, "bos_token");  // named, it must exist
  if (gpt2_style) {
    frame_ = {{eos_}, {}};
  } else {
    frame_ = {before, {eos_}};
  }
  if (frame_.before.size() == 1) bos_ = frame_.before[0];
}

struct Tokenizer::Session::State {
  std::unique_ptr<TokenizerEngine::Session> engine;
};

Tokenizer::Session::Session(const Tokenizer& tokenizer) : state_(std::make_unique<State>()) {
  state_->engine = tokenizer.engine_->NewSession();
}
Tokenizer::Session::Session(Session&&) noexcept = default;
Tokenizer::Session::~Session() = default;

size_t Tokenizer::Session::Encode(std::string_view text, std::vector<uint32_t>& ids) {
  size_t replaced = 0;
  if (IsValidUtf8(text)) {
    state_->engine->Encode(text, ids);
  } else {
    state_->engine->Encode(ScrubUtf8(text, &replaced), ids);
  }
  return replaced;
}

std::vector<uint32_t> Tokenizer::Encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  Session(*this).Encode(text, ids);
  return ids;
}

size_t Tokenizer::EncodeParallel(std::string_view text, int threads, std::vector<uint32_t>& ids,
                                 const std::function<void(size_t)>& progress) const {
  size_t replaced = 0;
  if (IsValidUtf8(text)) {
    engine_->EncodeParallel(text, threads, ids, progress);
  } else {
    engine_->EncodeParallel(ScrubUtf8(text, &replaced), threads, ids, progress);
  }
  return replaced;
}

std::string Tokenizer::Decode(std::span<const uint32_t> ids) const { return engine_->Decode(ids); }

uint32_t Tokenizer::vocab_size() const { return engine_->vocab_size(); }

}  // namespace meshtrain::text
