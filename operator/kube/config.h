// Where the API server is and how to authenticate to it.
//
// In a pod: the service account's token, CA and namespace under
// /var/run/secrets/kubernetes.io/serviceaccount, and KUBERNETES_SERVICE_HOST/PORT.
// Elsewhere: a kubeconfig file (--kubeconfig, else $KUBECONFIG's first entry, else
// ~/.kube/config), read at its current context: bearer token (or token file), client
// certificate and key, and CA, each either as a file path or as base64 `*-data`.
// TLS verification is on unless the cluster entry says insecure-skip-tls-verify.

#pragma once

#include <stdexcept>
#include <string>

namespace meshtrain::kube {

struct KubeConfig {
  std::string server;          // https://host:port (or http:// for a local test server)
  std::string token;           // bearer token; empty: none
  std::string ca_pem;          // CA bundle, PEM; empty: the system's roots
  std::string client_cert_pem;
  std::string client_key_pem;
  bool insecure_skip_tls_verify = false;
  std::string namespace_ = "default";  // the context's (or service account's) namespace
  std::string source;                  // "in-cluster" or the kubeconfig path, for messages
};

// A configuration that cannot be loaded; what() names the file and the field.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses kubeconfig text. `path` is used for messages and to resolve relative file names.
KubeConfig ParseKubeconfig(const std::string& text, const std::string& path);

// In-cluster configuration read from `secrets_dir` (the service account mount) and the environment.
KubeConfig InClusterConfig(const std::string& secrets_dir = "/var/run/secrets/kubernetes.io/serviceaccount");

// The configuration a command-line tool should use: `kubeconfig_flag` if set, else $KUBECONFIG,
// else in-cluster when KUBERNETES_SERVICE_HOST is set, else ~/.kube/config.
KubeConfig LoadConfig(const std::string& kubeconfig_flag);

}  // namespace meshtrain::kube
