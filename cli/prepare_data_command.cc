#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <utility>

#include "cli/commands.h"
#include "worker/train/prepare_data.h"
#include "worker/train/token_file.h"

namespace meshtrain::cli {
namespace {

std::string Megabytes(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", double(bytes) / 1e6);
  return text;
}

int PrepareTokenizedShards(const PrepareDataOptions& options, std::ostream& out) {
  if (!options.validation.empty()) {
    out << "meshtrain prepare-data: --validation names a file; with --tokenizer the validation shard is "
        << options.output << "_val_000000.bin\n";
    return kExitInvalid;
  }
  const text::Tokenizer tokenizer = text::Tokenizer::Load(options.tokenizer);
  train::PrepareOptions prepare;
  prepare.inputs = {options.input};
  prepare.prefix = options.output;
  prepare.shard_tokens = options.shard_tokens;
  prepare.validation_fraction = options.validation_fraction;
  prepare.threads = options.threads;
  const auto start = std::chrono::steady_clock::now();
  const train::PrepareResult result =
      train::PrepareTokenShards(tokenizer, prepare, [start](uint64_t done, uint64_t total) {
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const double rate = seconds > 0 ? double(done) / seconds : 0;
        const double left = rate > 0 ? double(total - done) / rate : 0;
        std::fprintf(stderr, "prepare-data: %s of %s, %.1f MB/s, %.0f s left\n", Megabytes(done).c_str(),
                     Megabytes(total).c_str(), rate / 1e6, left);
      });
  uint64_t tokens = 0;
  for (const auto* split : {&result.validation, &result.train}) {
    for (const train::PreparedShard& shard : *split) {
      out << shard.path << ": " << shard.tokens << " tokens" << (shard.masked ? " (loss mask in " + shard.path + ".mask)" : "")
          << "\n";
      tokens += shard.tokens;
    }
  }
  out << result.documents << " documents"
      << (result.prompt_completion > 0 ? " (" + std::to_string(result.prompt_completion) + " prompt/completion)" : "")
      << ", " << Megabytes(result.bytes) << ", " << tokens << " tokens (" << tokenizer.kind() << ", "
      << (tokenizer.vocab_size() > 65536 ? "llm.c's uint32 Llama 3 shards" : "llm.c's uint16 shards") << ")\n";
  for (const std::string& warning : result.warnings) std::cerr << "warning: " << warning << "\n";
  if (result.invalid_utf8 > 0) {
    std::cerr << "warning: " << result.invalid_utf8 << " invalid UTF-8 sequences were replaced by U+FFFD\n";
  }
  return kExitOk;
}

// Whether `a` and `b` name the same file: the same inode where both exist, else the same
// path once made absolute and normal (an output not written yet).
bool SameFile(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  std::error_code error_a, error_b;
  if (fs::exists(a, error_a) && fs::exists(b, error_b)) return fs::equivalent(a, b, error_a);
  const fs::path path_a = fs::weakly_canonical(a, error_a), path_b = fs::weakly_canonical(b, error_b);
  return !error_a && !error_b && path_a == path_b;
}

// The input, output and validation file, when two of them are one file: writing it would
// replace the text with its tokens, or the training tokens with the validation ones.
std::string SameFileError(const PrepareDataOptions& o) {
  const std::pair<const char*, const std::string*> files[] = {
      {"input", &o.input}, {"output", &o.output}, {"--validation", &o.validation}};
  for (size_t i = 0; i < std::size(files); ++i) {
    for (size_t j = i + 1; j < std::size(files); ++j) {
      const auto& [name_a, a] = files[i];
      const auto& [name_b, b] = files[j];
      if (!a->empty() && !b->empty() && SameFile(*a, *b)) {
        return std::string(name_a) + " " + *a + " and " + name_b + " " + *b + " are the same file";
      }
    }
  }
  return "";
}

}  // namespace

int PrepareDataCommand(const PrepareDataOptions& options, std::ostream& out) {
  try {
    if (!options.tokenizer.empty()) return PrepareTokenizedShards(options, out);
    if (const std::string error = SameFileError(options); !error.empty()) {
      out << "meshtrain prepare-data: " << error << "\n";
      return kExitUnreadable;  // a usage error
    }
    const train::TokenSplit split =
        train::WriteTextAsTokenFiles(options.input, options.output, options.validation, options.validation_fraction);
    out << options.output << ": " << split.train << " tokens\n";
    if (!options.validation.empty()) out << options.validation << ": " << split.validation << " tokens\n";
  } catch (const train::TokenFileError& e) {
    out << e.what() << "\n";
    return kExitUnreadable;
  } catch (const text::TokenizerError& e) {
    out << "--tokenizer: " << e.what() << "\n";
    return kExitUnreadable;
  } catch (const std::invalid_argument& e) {
    out << "meshtrain prepare-data: " << e.what() << "\n";
    return kExitInvalid;
  }
  return kExitOk;
}

}  // namespace meshtrain::cli
