#include <filesystem>
#include <iostream>

#include "api/layout.h"
#include "cli/bench_ranks.h"
#include "cli/commands.h"
#include "worker/train/checkpoint.h"
#include "worker/train/devices.h"
#include "worker/train/huggingface.h"
#include "worker/train/safetensors.h"
#include "worker/train/sampler.h"

namespace meshtrain::cli {
namespace {

namespace fs = std::filesystem;

// The weights and shape to sample from: a checkpoint directory (PATH/step-N), the newest
// intact checkpoint under a job's spec.checkpoint.path, or a Hugging Face model directory
// or GPT-2 safetensors file.
struct Weights {
  api::ModelShape shape;
  std::vector<float> master;
  std::string from;
};

Weights LoadWeights(const SampleOptions& o) {
  if (!o.from.empty()) return {train::HuggingFaceShape(o.from), {}, o.from};
  auto load = [](const std::string& directory) -> Weights {
    const api::ModelShape shape = train::CheckpointModel(directory);
    return {shape, train::LoadCheckpoint(directory, shape).state.master, directory};
  };
  if (fs::exists(fs::path(o.checkpoint) / "metadata.json")) return load(o.checkpoint);
  // The newest that loads (loading verifies what it reads); each one that does not says why.
  std::string problems;
  for (const train::CheckpointListing& c : train::ListCheckpoints(o.checkpoint, /*verify=*/false)) {  // newest first
    if (c.problem.empty()) {
      try {
        return load(c.directory);
      } catch (const train::CheckpointError& e) {
        problems += "; " + std::string(e.what());  // each names its file
        continue;
      }
    }
    problems += "; " + c.problem;
  }
  throw train::CheckpointError(o.checkpoint + ": no intact checkpoint here" + problems);
}

}  // namespace

int SampleCommand(const SampleOptions& o, std::ostream& out) {
  if (o.checkpoint.empty() == o.from.empty()) {  // a usage error: exit as the parser's own do
    out << "meshtrain sample: give a checkpoint or --from FILE" << (o.from.empty() ? "" : ", not both") << "\n";
    return kExitUnreadable;
  }
  // Asked for the GPU, it refuses where there is none, before it reads any weights.
  if (RefusedWithoutGpu(o.device, "meshtrain sample", out)) return kExitUnreadable;
  try {
    Weights weights = LoadWeights(o);
    if (!o.from.empty()) weights.master = train::LoadHuggingFace(o.from, weights.shape);
    const api::ModelShape& shape = weights.shape;
    const train::TextCodec codec(o.tokenizer, shape.vocab_size, "--tokenizer");
    const std::vector<uint32_t> prompt = o.prompt.empty() ? codec.Start() : codec.Prompt(o.prompt);

    // A one-rank job of that model, on the device asked for.
    // Checkpointed: sampling needs no block's activations kept for a backward.
    api::TrainingJob job;
    job.spec.model = api::SpecOfShape(shape);
    job.spec.training.micro_batch_size = 1;
    job.spec.parallelism.activation_checkpointing = true;
    const runtime::DeviceChoice choice = train::ChooseDeviceHere(o.device == "cuda" ? "bf16" : "fp32", 0);
    job.spec.training.precision = choice.precision;
    runtime::MemoryAccounting accounting;
    std::unique_ptr<parallel::Engine> engine = train::MakeEngine(job, api::ParallelLayout(1, 1, 1, 0), nullptr, nullptr,
                                                                 choice.device, 1, int(shape.seq_len), &accounting);
    parallel::WholeState state;
    state.master = std::move(weights.master);
    state.m.assign(state.master.size(), 0.0f);
    state.v.assign(state.master.size(), 0.0f);
    engine->Restore(state);

    train::SamplingOptions sampling;
    sampling.seed = o.seed;
    sampling.temperature = o.temperature;
    sampling.top_k = o.top_k;
    sampling.vocabulary = codec.vocabulary();
    sampling.stop = codec.Stop();  // the sample ends at the tokenizer's EOS
    const std::vector<uint32_t> ids =
        train::SampleTokens(*engine, prompt, o.tokens, int(shape.seq_len), int(shape.vocab_size), sampling);
    std::cerr << "sampling " << o.tokens << " tokens from " << weights.from << " on " << choice.device.ToString() << "\n";
    out << (o.prompt.empty() ? "" : o.prompt) << codec.Decode(ids) << "\n";
    return kExitOk;
  } catch (const std::invalid_argument& e) {
    out << "meshtrain sample: " << e.what() << "\n";
    return kExitInvalid;
  } catch (const std::exception& e) {
    out << "meshtrain sample: " << e.what() << "\n";
    return kExitUnreadable;
  }
}

}  // namespace meshtrain::cli
