// Base64 (RFC 4648, standard alphabet, padded), as Kubernetes carries bytes in JSON:
// kubeconfig `*-data` credentials, Secret data.
//
// Thread-safety: pure functions.

#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace meshtrain::kube {

std::string EncodeBase64(std::string_view bytes);

// The bytes of `text` (padding and line breaks ignored); nullopt when a character is
// outside the alphabet.
std::optional<std::string> DecodeBase64(std::string_view text);

}  // namespace meshtrain::kube
