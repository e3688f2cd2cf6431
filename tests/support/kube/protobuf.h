// Kubernetes' protobuf encoding, decoded for the few built-in kinds that clients send
// that way to the test API server: client-go's typed clients (helm's release storage,
// `kubectl create namespace`) encode Secrets, ConfigMaps and Namespaces as protobuf
// ("k8s\0", then a runtime.Unknown wrapping the object), and accept JSON back.
//
// Thread-safety: pure functions.

#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace meshtrain::testing {

inline constexpr const char* kProtobufContentType = "application/vnd.kubernetes.protobuf";

// The object as the JSON the API would have received. Throws std::runtime_error for a
// malformed body, or a kind other than v1 Secret, ConfigMap and Namespace.
nlohmann::json DecodeKubernetesProtobuf(const std::string& body);

}  // namespace meshtrain::testing
