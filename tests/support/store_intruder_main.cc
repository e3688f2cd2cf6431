// meshtrain-store-intruder HOST:PORT CAPTURED_KEY_FILE: plays every stranger of
// store_intruder.h against a live job's Store and prints one line each. Exits 0 when each
// was refused, 1 when one was not, 2 on bad arguments or a Store it cannot reach.

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "tests/support/store_intruder.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: meshtrain-store-intruder HOST:PORT CAPTURED_KEY_FILE\n");
    return 2;
  }
  const std::string address = argv[1];
  const size_t colon = address.rfind(':');
  std::ifstream in(argv[2], std::ios::binary);
  const std::string key((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (colon == std::string::npos || key.empty()) {
    std::fprintf(stderr, "meshtrain-store-intruder: need HOST:PORT and a readable key file (%s)\n", argv[2]);
    return 2;
  }
  try {
    bool all_refused = true;
    for (const auto& i : meshtrain::testing::IntrudeOnStore(address.substr(0, colon),
                                                            uint16_t(std::stoi(address.substr(colon + 1))), key)) {
      std::printf("%s: %s%s%s\n", i.what.c_str(), i.refused ? "refused" : "NOT REFUSED", i.detail.empty() ? "" : ": ",
                  i.detail.c_str());
      all_refused = all_refused && i.refused;
    }
    return all_refused ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain-store-intruder: %s\n", e.what());
    return 2;
  }
}
