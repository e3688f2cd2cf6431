#include <fstream>
#include <iterator>

#include "cli/commands.h"
#include "worker/train/token_file.h"

namespace meshtrain::cli {

int PrepareDataCommand(const PrepareDataOptions& options, std::ostream& out) {
  std::ifstream in(options.input, std::ios::binary);
  if (!in) {
    out << options.input << ": cannot open\n";
    return kExitUnreadable;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    out << options.input << ": read error\n";
    return kExitUnreadable;
  }
  const std::vector<uint32_t> tokens = train::ByteTokens(text);
  // The validation split is the end of the text, so the two never share a passage.
  const size_t validation = options.validation.empty() ? 0 : size_t(double(tokens.size()) * options.validation_fraction);
  const std::span<const uint32_t> all(tokens);
  try {
    train::WriteTokenFile(options.output, all.first(tokens.size() - validation));
    out << options.output << ": " << tokens.size() - validation << " tokens\n";
    if (validation > 0) {
      train::WriteTokenFile(options.validation, all.last(validation));
      out << options.validation << ": " << validation << " tokens\n";
    }
  } catch (const train::TokenFileError& e) {
    out << e.what() << "\n";
    return kExitUnreadable;
  }
  return kExitOk;
}

}  // namespace meshtrain::cli
