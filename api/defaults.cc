#include "api/defaults.h"

#include "api/model_shape.h"

namespace meshtrain::api {

std::vector<std::string> DefaultTopologyLevels() {
  return {"topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/network-node-layer-2",
          "topology.k8s.aws/network-node-layer-3", "kubernetes.io/hostname"};
}

void ApplyDefaults(TrainingJob* job) {
  TrainingJobSpec& spec = job->spec;
  if (!spec.resources.gpu) spec.resources.gpu = spec.gpus_per_node;

  if (const ModelShape* preset = FindPreset(spec.model.preset)) {
    ModelSpec& m = spec.model;
    if (!m.layers) m.layers = preset->layers;
    if (!m.heads) m.heads = preset->heads;
    if (!m.hidden) m.hidden = preset->hidden;
    if (!m.vocab_size) m.vocab_size = preset->vocab_size;
    if (!m.seq_len) m.seq_len = preset->seq_len;
  }

  TopologySpec& topology = spec.topology;
  if (topology.levels.empty()) topology.levels = DefaultTopologyLevels();
  if (topology.required_level.empty()) {
    topology.required_level = topology.levels[topology.levels.size() >= 2 ? topology.levels.size() - 2 : 0];
  }
}

}  // namespace meshtrain::api
