#include "operator/kube/config.h"

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "api/manifest.h"
#include "operator/kube/base64.h"

namespace meshtrain::kube {
namespace {

using nlohmann::json;

std::string ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(what + ": cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string DecodeBase64(const std::string& text, const std::string& what) {
  std::optional<std::string> bytes = kube::DecodeBase64(text);
  if (!bytes) throw ConfigError(what + ": not valid base64");
  return *bytes;
}

// The named entry of a kubeconfig list (clusters, users, contexts), or null.
const json* FindNamed(const json& root, const char* list, const std::string& name) {
  if (!root.contains(list) || !root[list].is_array()) return nullptr;
  for (const auto& entry : root[list]) {
    if (entry.is_object() && entry.value("name", "") == name) return &entry;
  }
  return nullptr;
}

std::string StringField(const json& object, const char* key) {
  auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A credential given either inline as base64 `<key>-data` or as a file `<key>`.
std::string FileOrData(const json& object, const std::string& key, const std::filesystem::path& base,
                       const std::string& where) {
  const std::string data = StringField(object, (key + "-data").c_str());
  if (!data.empty()) return DecodeBase64(data, where + "." + key + "-data");
  std::string file = StringField(object, key.c_str());
  if (file.empty()) return "";
  std::filesystem::path p(file);
  if (p.is_relative()) p = base / p;
  return ReadFile(p.string(), where + "." + key);
}

}  // namespace

KubeConfig ParseKubeconfig(const std::string& text, const std::string& path) {
  std::vector<api::ManifestDocument> docs;
  try {
    docs = api::ParseManifestText(text, path);
  } catch (const api::ManifestError& e) {
    throw ConfigError(std::string("kubeconfig ") + e.what());
  }
  if (docs.empty() || !docs[0].object.is_object()) throw ConfigError("kubeconfig " + path + ": empty");
  const json& root = docs[0].object;
  const std::string context_name = StringField(root, "current-context");
  if (context_name.empty()) throw ConfigError("kubeconfig " + path + ": current-context is not set");
  const json* context = FindNamed(root, "contexts", context_name);
  if (!context || !context->contains("context"))
    throw ConfigError("kubeconfig " + path + ": contexts has no entry named \"" + context_name + "\"");
  const json& ctx = (*context)["context"];
  const std::string cluster_name = StringField(ctx, "cluster");
  const json* cluster = FindNamed(root, "clusters", cluster_name);
  if (!cluster || !cluster->contains("cluster"))
    throw ConfigError("kubeconfig " + path + ": clusters has no entry named \"" + cluster_name + "\" (context \"" +
                      context_name + "\")");
  const json& c = (*cluster)["cluster"];
  const auto base = std::filesystem::path(path).parent_path();

  KubeConfig config;
  config.source = path;
  config.server = StringField(c, "server");
  if (config.server.empty())
    throw ConfigError("kubeconfig " + path + ": clusters[" + cluster_name + "].cluster.server is not set");
  config.insecure_skip_tls_verify = c.value("insecure-skip-tls-verify", false);
  config.ca_pem = FileOrData(c, "certificate-authority", base, "kubeconfig " + path + ": cluster " + cluster_name);
  if (const std::string ns = StringField(ctx, "namespace"); !ns.empty()) config.namespace_ = ns;

  const std::string user_name = StringField(ctx, "user");
  if (const json* user = FindNamed(root, "users", user_name); user && user->contains("user")) {
    const json& u = (*user)["user"];
    const std::string where = "kubeconfig " + path + ": user " + user_name;
    config.token = StringField(u, "token");
    if (config.token.empty()) {
      if (const std::string file = StringField(u, "tokenFile"); !file.empty())
        config.token = ReadFile(file, where + ".tokenFile");
    }
    config.client_cert_pem = FileOrData(u, "client-certificate", base, where);
    config.client_key_pem = FileOrData(u, "client-key", base, where);
    if (config.client_cert_pem.empty() != config.client_key_pem.empty())
      throw ConfigError(where + ": client-certificate and client-key must be given together");
  }
  while (!config.token.empty() && (config.token.back() == '\n' || config.token.back() == '\r')) config.token.pop_back();
  return config;
}

KubeConfig InClusterConfig(const std::string& secrets_dir) {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
  if (!host || !*host || !port || !*port)
    throw ConfigError("in-cluster configuration: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be set");
  KubeConfig config;
  config.source = "in-cluster";
  const std::string h = host;
  config.server = "https://" + (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + port;
  config.token = ReadFile(secrets_dir + "/token", "in-cluster configuration");
  while (!config.token.empty() && (config.token.back() == '\n' || config.token.back() == '\r')) config.token.pop_back();
  config.ca_pem = ReadFile(secrets_dir + "/ca.crt", "in-cluster configuration");
  if (std::filesystem::exists(secrets_dir + "/namespace")) {
    config.namespace_ = ReadFile(secrets_dir + "/namespace", "in-cluster configuration");
    while (!config.namespace_.empty() && std::isspace(static_cast<unsigned char>(config.namespace_.back())))
      config.namespace_.pop_back();
  }
  return config;
}

KubeConfig LoadConfig(const std::string& kubeconfig_flag) {
  std::string path = kubeconfig_flag;
  if (path.empty()) {
    if (const char* env = std::getenv("KUBECONFIG"); env && *env) {
      path = env;
      path = path.substr(0, path.find(':'));  // the first of a list, as client-go's loader prefers
    }
  }
  if (path.empty()) {
    if (const char* host = std::getenv("KUBERNETES_SERVICE_HOST"); host && *host) return InClusterConfig();
    const char* home = std::getenv("HOME");
    path = std::string(home ? home : "") + "/.kube/config";
  }
  return ParseKubeconfig(ReadFile(path, "kubeconfig"), path);
}

}  // namespace meshtrain::kube
