#include "cli/bench_tokenize_command.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "worker/text/tokenizer.h"

namespace meshtrain::cli {
namespace {

namespace fs = std::filesystem;

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

struct ReferenceRun {
  std::string name;
  uint64_t tokens = 0;
  double seconds = 0;
};

// Runs `command`, whose standard output is `out_file`; throws naming the command.
void Run(const std::string& command) {
  if (std::system(command.c_str()) != 0) throw std::runtime_error("the reference failed: " + command);
}

std::string Quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

ReferenceRun RunReference(const BenchTokenizeOptions& o, const std::string& text_file, const fs::path& scratch) {
  const fs::path dir = o.tokenizer;
  const fs::path result = scratch / "reference.json";
  if (fs::exists(dir / "tokenizer.json")) {
    Run("node " + Quote(o.scripts + "/hf_reference_encode.js") + " " + Quote(o.node_modules) + " " + Quote(dir) + " " +
        Quote(text_file) + " --time > " + Quote(result));
  } else if (fs::exists(dir / "tokenizer.model")) {
    // spm_encode's whole run, loading the model included, timed here.
    const auto start = std::chrono::steady_clock::now();
    Run("spm_encode --model=" + Quote(dir / "tokenizer.model") + " --output_format=id < " + Quote(text_file) + " > " +
        Quote(scratch / "ids.txt"));
    const double seconds = Seconds(start);
    std::ifstream ids(scratch / "ids.txt");
    uint64_t tokens = 0;
    for (std::string id; ids >> id;) ++tokens;
    return {"spm_encode (Debian's sentencepiece, one process, per line)", tokens, seconds};
  } else {
    Run("node " + Quote(o.scripts + "/gpt2_reference_encode.js") + " " + Quote(o.node_modules + "/gpt-3-encoder") + " " +
        Quote(text_file) + " --time > " + Quote(result));
  }
  std::ifstream in(result);
  const nlohmann::json j = nlohmann::json::parse(in);
  return {fs::exists(dir / "tokenizer.json") ? "transformers.js (@lenml/tokenizers on node)" : "gpt-3-encoder (node)",
          j.at("tokens").get<uint64_t>(), j.at("seconds").get<double>()};
}

}  // namespace

int BenchTokenizeCommand(const BenchTokenizeOptions& o, std::ostream& out) {
  std::string text;
  try {
    const text::Tokenizer tokenizer = text::Tokenizer::Load(o.tokenizer);
    std::ifstream in(o.text, std::ios::binary);
    if (!in) {
      out << "meshtrain bench tokenize: " << o.text << ": cannot open\n";
      return kExitUnreadable;
    }
    const std::string one((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (int i = 0; i < o.repeat; ++i) text += one;
    const fs::path scratch = fs::temp_directory_path() / ("meshtrain-bench-tokenize-" + std::to_string(::getpid()));
    fs::create_directories(scratch);
    const std::string text_file = (scratch / "text.txt").string();
    std::ofstream(text_file, std::ios::binary) << text;
    const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));

    out << "tokenize: " << o.tokenizer << " (" << tokenizer.kind() << ", " << tokenizer.vocab_size() << " tokens), "
        << o.text << (o.repeat > 1 ? " x" + std::to_string(o.repeat) : "") << ": " << text.size() << " bytes\n";
    tokenizer.Encode(text.substr(0, 10000));  // the first call's page faults are not the rate
    text::Tokenizer::Session session(tokenizer);
    std::vector<uint32_t> ids;
    auto start = std::chrono::steady_clock::now();
    session.Encode(text, ids);
    const double one_thread = Seconds(start);
    std::vector<uint32_t> parallel;
    start = std::chrono::steady_clock::now();
    tokenizer.EncodeParallel(text, threads, parallel);
    const double all_threads = Seconds(start);
    ReferenceRun reference;
    try {
      reference = RunReference(o, text_file, scratch);
    } catch (const std::exception& e) {
      fs::remove_all(scratch);
      out << "meshtrain bench tokenize: " << e.what() << " (scripts/install-tokenizer-references.sh installs the npm "
          << "references; run from the repository root or give --node-modules and --scripts)\n";
      return kExitUnreadable;
    }
    fs::remove_all(scratch);
    char line[256];
    auto rate = [](uint64_t tokens, double seconds) { return double(tokens) / seconds / 1e6; };
    std::snprintf(line, sizeof line, "  meshtrain, 1 thread:   %8.3f M tokens/s (%llu tokens in %.3f s)\n",
                  rate(ids.size(), one_thread), static_cast<unsigned long long>(ids.size()), one_thread);
    out << line;
    std::snprintf(line, sizeof line, "  meshtrain, %d threads: %8.3f M tokens/s (%.3f s)%s\n", threads,
                  rate(parallel.size(), all_threads), all_threads, parallel == ids ? "" : ": IDS DIFFER");
    out << line;
    std::snprintf(line, sizeof line, "  reference, 1 thread:   %8.3f M tokens/s (%llu tokens in %.3f s): %s\n",
                  rate(reference.tokens, reference.seconds), static_cast<unsigned long long>(reference.tokens),
                  reference.seconds, reference.name.c_str());
    out << line;
    std::snprintf(line, sizeof line, "  one thread: %.1fx the reference%s\n", reference.seconds / one_thread *
                  double(ids.size()) / double(std::max<uint64_t>(1, reference.tokens)),
                  reference.tokens == ids.size() ? "" : " (the token counts differ: see above)");
    out << line;
    return parallel == ids ? kExitOk : kExitInvalid;
  } catch (const text::TokenizerError& e) {
    out << "meshtrain bench tokenize: --tokenizer: " << e.what() << "\n";
    return kExitUnreadable;
  }
}

}  // namespace meshtrain::cli
