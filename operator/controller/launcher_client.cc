#include "operator/controller/launcher_client.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include <cpprest/uri_builder.h>

namespace meshtrain::controller {

std::string LoadLauncherKey(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("the launcher key file " + path + ": cannot open it: " + std::strerror(errno));
  std::string key{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  if (file.bad()) throw std::runtime_error("the launcher key file " + path + ": cannot read it: " + std::strerror(errno));
  if (key.size() < kLauncherKeyMinBytes) {
    throw std::runtime_error("the launcher key file " + path + " holds " + std::to_string(key.size()) +
                             " bytes; the key must have at least " + std::to_string(kLauncherKeyMinBytes));
  }
  return key;
}

std::string LauncherToken(std::string_view key, std::string_view job_uid, int64_t node_rank) {
  // NUL separates the fields: no uid holds one, so no two (uid, rank) give one message.
  std::string message = "meshtrain launcher token";
  message.append(1, '\0').append(job_uid).append(1, '\0').append(std::to_string(node_rank));
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest, &length))
    throw std::runtime_error("deriving a launcher token failed (OpenSSL HMAC-SHA256)");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned int i = 0; i < length; ++i) {
    token += kHex[digest[i] >> 4];
    token += kHex[digest[i] & 15];
  }
  return token;
}

std::string LauncherCallTarget(const LauncherCall& call, const std::string& token) {
  web::uri_builder target("/attempt/" + call.action);
  target.append_query("attempt", std::to_string(call.attempt));
  target.append_query("token", token);
  return target.to_string();
}

}  // namespace meshtrain::controller
