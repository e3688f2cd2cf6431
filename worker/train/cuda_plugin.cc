#include "worker/train/cuda_plugin.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "api/environment.h"

namespace meshtrain::train {

const char* CudaPluginBuild() { return MESHTRAIN_PLUGIN_BUILD; }

const CudaPlugin* LoadCudaPlugin(const std::string& path, std::string* why) {
  // RTLD_LOCAL: the plugin's copies of meshtrain's code never stand in for the program's.
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = ::dlerror();
    *why = "cannot load the CUDA plugin " + path + ": " + (error ? error : "unknown error");
    return nullptr;
  }
  auto refuse = [&](const std::string& reason) -> const CudaPlugin* {
    *why = reason;
    ::dlclose(library);
    return nullptr;
  };
  using BuildEntry = const char* (*)();
  using Entry = const CudaPlugin* (*)();
  auto build = reinterpret_cast<BuildEntry>(::dlsym(library, kCudaPluginBuildEntry));
  auto entry = reinterpret_cast<Entry>(::dlsym(library, kCudaPluginEntry));
  if (entry == nullptr) return refuse(path + " is not a meshtrain CUDA plugin: it has no " + kCudaPluginEntry);
  // Nothing of the plugin's types is touched before the builds are known to agree.
  const std::string theirs = build ? build() : "a meshtrain older than build fingerprints";
  if (theirs != CudaPluginBuild()) {
    return refuse(path + " comes from another meshtrain build: the plugin is \"" + theirs + "\", this program is \"" +
                  CudaPluginBuild() + "\"; use the plugin built with this program");
  }
  const CudaPlugin* plugin = entry();
  if (plugin == nullptr) return refuse(path + ": " + kCudaPluginEntry + " returned nothing");
  return plugin;  // the library stays loaded for the life of the process
}

const CudaPlugin* CudaPluginOrNull(std::string* why) {
  static std::once_flag once;
  static const CudaPlugin* plugin = nullptr;
  static std::string failure;
  std::call_once(once, [] {
#ifndef MESHTRAIN_CUDA_PLUGIN_BUILT
    failure = "this meshtrain was built without CUDA (MESHTRAIN_CUDA=OFF or no toolkit)";
#else
    std::vector<std::string> candidates;
    if (const char* path = std::getenv("MESHTRAIN_CUDA_PLUGIN")) {
      candidates.push_back(path);  // an explicit choice: no fallback past it
    } else {
      if (const std::filesystem::path self = api::ThisProgram(); !self.empty()) {
        for (const auto& beside : {self.parent_path() / kCudaPluginFile,
                                   self.parent_path().parent_path() / "lib" / kCudaPluginFile}) {
          if (std::filesystem::exists(beside)) candidates.push_back(beside.string());
        }
      }
      candidates.push_back(MESHTRAIN_CUDA_PLUGIN_BUILT);
    }
    for (const std::string& candidate : candidates) {
      if ((plugin = LoadCudaPlugin(candidate, &failure)) != nullptr) return;
    }
#endif
  });
  if (plugin == nullptr && why != nullptr) *why = failure;
  return plugin;
}

}  // namespace meshtrain::train
