// The manifests of docs/operator.md's "Kueue" section against the CRDs they are for:
// Kueue's own (tests/data/kueue, from Kueue v0.19.2) and the TrainingJob CRD. Each passes
// its CRD's openAPIV3Schema as the API server checks it (tests/support/kube/schema_validation.h:
// types, required fields, enums, patterns and limits; unknown fields, which a structural
// schema would prune, are errors; CEL rules are not run), and they name each other. A
// ClusterQueue with a mistake in it fails, so the check can fail.

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "api/manifest.h"
#include "tests/support/kube/schema_validation.h"

namespace meshtrain::testing {
namespace {

using nlohmann::json;

constexpr const char* kDocs = "docs/operator.md";
constexpr const char* kSection = "## Kueue";
constexpr const char* kKueueCrds[] = {
    "tests/data/kueue/kueue.x-k8s.io_clusterqueues.yaml", "tests/data/kueue/kueue.x-k8s.io_localqueues.yaml",
    "tests/data/kueue/kueue.x-k8s.io_resourceflavors.yaml", "tests/data/kueue/kueue.x-k8s.io_topologies.yaml",
    "tests/data/kueue/kueue.x-k8s.io_workloads.yaml",
    "tests/data/kueue/kueue.x-k8s.io_workloadpriorityclasses.yaml"};
constexpr const char* kTrainingJobCrd = "crds/trainingjobs.meshtrain.dev.yaml";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read (run from the repository root)");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

json ReadOne(const std::string& path) {
  const auto documents = api::ReadManifestFile(path);
  if (documents.size() != 1) throw std::runtime_error(path + ": not one document");
  return documents[0].object;
}

// The objects of the ```yaml blocks of `section` (a "## " heading) of the Markdown file
// `path`, each with "FILE:LINE" of its block.
std::vector<std::pair<std::string, json>> SectionManifests(const std::string& path, const std::string& section) {
  std::istringstream lines(ReadFile(path));
  std::vector<std::pair<std::string, json>> out;
  std::string line, block;
  bool in_section = false, in_block = false;
  int number = 0, start = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (!in_block && line.rfind("## ", 0) == 0) in_section = line == section;
    if (!in_section) continue;
    if (!in_block && line == "```yaml") {
      in_block = true, start = number, block.clear();
    } else if (in_block && line == "```") {
      in_block = false;
      const std::string where = path + ":" + std::to_string(start);
      for (auto& document : api::ParseManifestText(block, where)) out.emplace_back(where, std::move(document.object));
    } else if (in_block) {
      block += line + "\n";
    }
  }
  return out;
}

// The CRDs, by "group/Kind".
const std::map<std::string, json>& Crds() {
  static const std::map<std::string, json> crds = [] {
    std::map<std::string, json> out;
    std::vector<std::string> paths(std::begin(kKueueCrds), std::end(kKueueCrds));
    paths.push_back(kTrainingJobCrd);
    for (const auto& path : paths) {
      json crd = ReadOne(path);
      const std::string key = crd["spec"]["group"].get<std::string>() + "/" + crd["spec"]["names"]["kind"].get<std::string>();
      out[key] = std::move(crd);
    }
    return out;
  }();
  return crds;
}

// The errors of `object` as an API server with Crds() installed would answer a create
// with fieldValidation=Strict: its apiVersion served, its scope respected, its schema met.
std::vector<std::string> Check(json object) {
  const std::string api_version = object.value("apiVersion", ""), kind = object.value("kind", "");
  const size_t slash = api_version.find('/');
  if (slash == std::string::npos) return {"apiVersion " + api_version + ": not group/version"};
  const std::string group = api_version.substr(0, slash), version = api_version.substr(slash + 1);
  const auto crd = Crds().find(group + "/" + kind);
  if (crd == Crds().end()) return {"no CRD for " + kind + " in " + group};
  const json& spec = crd->second["spec"];
  const auto served = std::find_if(spec["versions"].begin(), spec["versions"].end(), [&](const json& v) {
    return v["name"] == version && v.value("served", false);
  });
  if (served == spec["versions"].end()) return {"no " + kind + " served at " + api_version};
  std::vector<std::string> errors;
  const json& metadata = object.value("metadata", json::object());
  if (metadata.value("name", "").empty()) errors.push_back("metadata.name: Required value");
  const bool namespaced = spec["scope"] == "Namespaced";
  if (!namespaced && metadata.contains("namespace"))
    errors.push_back("metadata.namespace: " + kind + " is cluster-scoped");
  const auto schema_errors = ValidateAgainstSchema((*served)["schema"]["openAPIV3Schema"], object, true);
  errors.insert(errors.end(), schema_errors.begin(), schema_errors.end());
  return errors;
}

std::string Joined(const std::vector<std::string>& errors) {
  std::string out;
  for (const auto& e : errors) out += "\n  " + e;
  return out;
}

// The one object of `kind` among `manifests`.
json OneOf(const std::vector<std::pair<std::string, json>>& manifests, const std::string& kind) {
  json found;
  for (const auto& [where, object] : manifests) {
    if (object.value("kind", "") != kind) continue;
    EXPECT_TRUE(found.is_null()) << "two " << kind << "s in " << kDocs << " " << kSection;
    found = object;
  }
  EXPECT_FALSE(found.is_null()) << "no " << kind << " in " << kDocs << " " << kSection;
  return found;
}

TEST(KueueManifests, TheCrdsAreKueuesAtV1beta2) {
  std::set<std::string> kinds;
  for (const char* path : kKueueCrds) {
    const json crd = ReadOne(path);
    EXPECT_EQ(crd["spec"]["group"], "kueue.x-k8s.io") << path;
    kinds.insert(crd["spec"]["names"]["kind"].get<std::string>());
    bool storage = false;
    for (const json& version : crd["spec"]["versions"])
      storage = storage || (version["name"] == "v1beta2" && version.value("served", false) && version.value("storage", false));
    EXPECT_TRUE(storage) << path << ": v1beta2 is not served and stored";
  }
  EXPECT_EQ(kinds, (std::set<std::string>{"ClusterQueue", "LocalQueue", "ResourceFlavor", "Topology", "Workload",
                                          "WorkloadPriorityClass"}));
}

TEST(KueueManifests, EveryManifestOfTheDocsPassesItsCrd) {
  const auto manifests = SectionManifests(kDocs, kSection);
  std::set<std::string> kinds;
  for (const auto& [where, object] : manifests) {
    kinds.insert(object.value("kind", ""));
    const auto errors = Check(object);
    EXPECT_TRUE(errors.empty()) << where << ": " << object.value("kind", "") << " "
                                << object["metadata"].value("name", "") << ":" << Joined(errors);
  }
  EXPECT_EQ(kinds, (std::set<std::string>{"ClusterQueue", "LocalQueue", "ResourceFlavor", "Topology", "TrainingJob",
                                          "WorkloadPriorityClass"}));
  // The job is one meshtrain runs as written (docs_test.sh holds it to `meshtrain validate` too).
  const api::CheckedJob job = api::CheckTrainingJob(OneOf(manifests, "TrainingJob"), kDocs, 0);
  EXPECT_TRUE(job.ok() && job.warnings.empty()) << Joined([&] {
    std::vector<std::string> out;
    for (const auto& e : job.errors) out.push_back(e.ToString());
    for (const auto& w : job.warnings) out.push_back(w.ToString());
    return out;
  }());
}

TEST(KueueManifests, TheManifestsNameEachOther) {
  const auto manifests = SectionManifests(kDocs, kSection);
  // Not const: a field a mistake left out reads as null.
  json job = OneOf(manifests, "TrainingJob"), local = OneOf(manifests, "LocalQueue"),
       cluster = OneOf(manifests, "ClusterQueue"), flavor = OneOf(manifests, "ResourceFlavor"),
       topology = OneOf(manifests, "Topology"), priority = OneOf(manifests, "WorkloadPriorityClass");
  ASSERT_FALSE(job.is_null() || local.is_null() || cluster.is_null() || flavor.is_null() || topology.is_null() ||
               priority.is_null());
  EXPECT_EQ(job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], local["metadata"]["name"]);
  EXPECT_EQ(job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"], priority["metadata"]["name"]);
  EXPECT_EQ(job["metadata"]["namespace"], local["metadata"]["namespace"]);
  EXPECT_EQ(local["spec"]["clusterQueue"], cluster["metadata"]["name"]);
  EXPECT_EQ(cluster["spec"]["resourceGroups"][0]["flavors"][0]["name"], flavor["metadata"]["name"]);
  EXPECT_EQ(flavor["spec"]["topologyName"], topology["metadata"]["name"]);
  // The Topology's levels are the chart's: what the operator places by.
  std::vector<std::string> levels;
  for (const json& level : topology["spec"]["levels"]) levels.push_back(level["nodeLabel"]);
  json values = ReadOne("helm/meshtrain/values.yaml");
  EXPECT_EQ(levels, values["workerDefaults"]["topologyLevels"].get<std::vector<std::string>>());
}

// The check fails a ClusterQueue with a misspelt field, a wrong type, a value outside its
// enum or pattern, a missing required field, or an apiVersion Kueue does not serve.
TEST(KueueManifests, AClusterQueueWithAMistakeIsRejected) {
  const json good = OneOf(SectionManifests(kDocs, kSection), "ClusterQueue");
  ASSERT_FALSE(good.is_null());
  ASSERT_TRUE(Check(good).empty());
  const auto rejected = [&](const std::string& want, const std::function<void(json&)>& spoil) {
    json bad = good;
    spoil(bad);
    const auto errors = Check(bad);
    const bool found =
        std::any_of(errors.begin(), errors.end(), [&](const std::string& e) { return e.find(want) != std::string::npos; });
    EXPECT_TRUE(found) << "want an error with '" << want << "' for " << bad["spec"].dump() << ", got:" << Joined(errors);
  };
  rejected("spec.resourceGroup: unknown field", [](json& q) {
    q["spec"]["resourceGroup"] = q["spec"]["resourceGroups"];
    q["spec"].erase("resourceGroups");
  });
  rejected("spec.resourceGroups[0].coveredResources: Invalid value: \"nvidia.com/gpu\": must be of type array",
           [](json& q) { q["spec"]["resourceGroups"][0]["coveredResources"] = "nvidia.com/gpu"; });
  rejected("spec.queueingStrategy: Unsupported value: \"FIFO\"", [](json& q) { q["spec"]["queueingStrategy"] = "FIFO"; });
  rejected("spec.resourceGroups[0].flavors[0].resources[0].nominalQuota: Required value",
           [](json& q) { q["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0].erase("nominalQuota"); });
  rejected("spec.resourceGroups[0].flavors[0].resources[0].nominalQuota: Invalid value: \"64 GPUs\": should match",
           [](json& q) { q["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] = "64 GPUs"; });
  rejected("spec.resourceGroups[0].flavors[0].name: Invalid value: \"P5_nodes\": should match",
           [](json& q) { q["spec"]["resourceGroups"][0]["flavors"][0]["name"] = "P5_nodes"; });
  rejected("metadata.namespace: ClusterQueue is cluster-scoped", [](json& q) { q["metadata"]["namespace"] = "research"; });
  rejected("no ClusterQueue served at kueue.x-k8s.io/v1", [](json& q) { q["apiVersion"] = "kueue.x-k8s.io/v1"; });
}

}  // namespace
}  // namespace meshtrain::testing
