#include <chrono>
#include <cstdio>
#include <iostream>

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

int PrepareGpt2Shards(const PrepareDataOptions& options, std::ostream& out) {
  if (!options.validation.empty()) {
    out << "meshtrain prepare-data: --validation names a file; with --tokenizer the validation shard is "
        << options.output << "_val_000000.bin\n";
    return kExitInvalid;
  }
  const text::Gpt2Tokenizer tokenizer = text::Gpt2Tokenizer::Load(options.tokenizer);
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
      out << shard.path << ": " << shard.tokens << " tokens\n";
      tokens += shard.tokens;
    }
  }
  out << result.documents << " documents, " << Megabytes(result.bytes) << ", " << tokens
      << " tokens (GPT-2's tokenizer, llm.c's format)\n";
  if (result.invalid_utf8 > 0) {
    std::cerr << "warning: " << result.invalid_utf8 << " invalid UTF-8 sequences were replaced by U+FFFD\n";
  }
  return kExitOk;
}

}  // namespace

int PrepareDataCommand(const PrepareDataOptions& options, std::ostream& out) {
  try {
    if (!options.tokenizer.empty()) return PrepareGpt2Shards(options, out);
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
