#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "api/logging.h"
#include "cli/bench_tokenize_command.h"
#include "cli/commands.h"
#include "worker/launch/local_launcher.h"

namespace meshtrain::cli {

namespace {

// "1K..256M" (K, M, G are powers of 1024; "64M" alone means 64M..64M).
bool ParseSizeRange(const std::string& text, size_t* min_bytes, size_t* max_bytes) {
  auto parse = [](std::string part, size_t* value) {
    if (part.empty()) return false;
    size_t unit = 1;
    switch (part.back()) {
      case 'K': case 'k': unit = size_t{1} << 10; break;
      case 'M': case 'm': unit = size_t{1} << 20; break;
      case 'G': case 'g': unit = size_t{1} << 30; break;
      default: break;
    }
    if (unit != 1) part.pop_back();
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos || part.size() > 6) return false;
    *value = std::stoull(part) * unit;
    return *value > 0;
  };
  size_t dots = text.find("..");
  if (dots == std::string::npos) return parse(text, min_bytes) && parse(text, max_bytes);
  return parse(text.substr(0, dots), min_bytes) && parse(text.substr(dots + 2), max_bytes) &&
         *min_bytes <= *max_bytes;
}

std::string VersionString() {
#ifdef MESHTRAIN_HAVE_CUDA
  constexpr const char* cuda = "on";
#else
  constexpr const char* cuda = "off";
#endif
  return std::string("meshtrain ") + MESHTRAIN_VERSION + " (cuda " + cuda + ")";
}

// "bench train": a subcommand's name under its parents, less the program's.
std::string CommandName(const CLI::App& command) {
  std::string name = command.get_name();
  for (const CLI::App* parent = command.get_parent(); parent != nullptr && parent->get_parent() != nullptr;
       parent = parent->get_parent()) {
    name = parent->get_name() + " " + name;
  }
  return name;
}

// A command of the table: its declaration on the parser, and what it does once the
// command line is parsed. Its options live in shared state that the action holds.
struct Command {
  CLI::App* app;
  std::function<int()> run;
};

template <typename Options>
std::shared_ptr<Options> Make() {
  return std::make_shared<Options>();
}

Command Validate(CLI::App& parent) {
  auto files = Make<std::vector<std::string>>();
  CLI::App* c = parent.add_subcommand("validate", "Check TrainingJob manifests; print ok or each error with its field path");
  c->add_option("files", *files, "Manifest files (YAML or JSON)")->required();
  return {c, [files] { return ValidateCommand(*files, std::cout); }};
}

Command Layout(CLI::App& parent) {
  auto file = Make<std::string>();
  CLI::App* c = parent.add_subcommand("layout", "Print a job's mesh: its pipeline stages and which ranks form each TP, shard and replica group");
  c->add_option("file", *file, "Manifest file")->required();
  return {c, [file] { return LayoutCommand(*file, std::cout); }};
}

Command Run(CLI::App& parent) {
  auto o = Make<RunOptions>();
  CLI::App* c = parent.add_subcommand("run", "Train a job on this machine");
  c->add_option("file", o->file, "Manifest file with one TrainingJob")->required();
  c->add_flag("--resume,!--no-resume", o->resume,
              "Resume from the newest intact checkpoint under spec.checkpoint.path (the default); with "
              "--no-resume, only a restart of this run resumes, from its own");
  c->add_option("--sample-tokens", o->sample_tokens, "Tokens of text to sample after training")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  return {c, [o] { return RunCommand(*o, std::cout); }};
}

Command Checkpoints(CLI::App& parent) {
  auto path = Make<std::string>();
  CLI::App* c = parent.add_subcommand("checkpoints", "List a job's checkpoints and verify their files");
  c->add_option("path", *path, "The job's spec.checkpoint.path")->required();
  return {c, [path] { return CheckpointsCommand(*path, std::cout); }};
}

Command Export(CLI::App& parent) {
  auto o = Make<ExportOptions>();
  CLI::App* c = parent.add_subcommand("export", "Write a checkpoint's weights as a Hugging Face model directory");
  c->add_option("checkpoint", o->checkpoint, "A checkpoint directory (PATH/step-N)")->required();
  c->add_option("output", o->output,
                "The directory to write (config.json and safetensors); a GPT-2 may go to one FILE.safetensors")
      ->required();
  c->add_option("--format", o->format, "safetensors")->capture_default_str();
  c->add_option("--dtype", o->dtype, "f32 (the master weights), bf16 or f16")->capture_default_str();
  c->add_option("--max-shard-size", o->max_shard_size, "The largest safetensors file (5GB, 500MB, 1GiB)")
      ->capture_default_str();
  c->add_option("--like", o->like,
                "The Hugging Face directory training started from: its token ids (config.json) and tokenizer files "
                "go into the export");
  return {c, [o] { return ExportCommand(*o, std::cout); }};
}

Command ModelSpec(CLI::App& parent) {
  struct Options {
    std::string directory;
    int64_t seq_len = 0;
  };
  auto o = Make<Options>();
  CLI::App* c = parent.add_subcommand(
      "model-spec", "Print the spec.model fields of a Hugging Face model directory, for jobs the operator runs");
  c->add_option("directory", o->directory, "A directory with config.json")->required();
  c->add_option("--seq-len", o->seq_len, "The training window (default: the model's, at most 2048 for the Llama class)")
      ->check(CLI::PositiveNumber);
  return {c, [o] { return ModelSpecCommand(o->directory, o->seq_len, std::cout); }};
}

Command PrepareData(CLI::App& parent) {
  auto o = Make<PrepareDataOptions>();
  CLI::App* c = parent.add_subcommand(
      "prepare-data", "Turn text into token files: bytes, or a model's tokens in llm.c shards (--tokenizer)");
  c->add_option("input", o->input, "Text file; with --tokenizer, a glob of .jsonl (\"text\", or \"prompt\" and \"completion\") and text files")
      ->required();
  c->add_option("output", o->output, "Token file to write; with --tokenizer, the shards' prefix (PREFIX_train_000001.bin)")
      ->required();
  c->add_option("--validation", o->validation, "Also write the end of the text here, for validation (bytes only)");
  auto* fraction = c->add_option("--validation-fraction", o->validation_fraction,
                                 "Share of the text for validation (with --validation or --tokenizer)")
                       ->check(CLI::Range(0.0, 0.5))
                       ->capture_default_str();
  auto* tokenizer = c->add_option("--tokenizer", o->tokenizer,
                                  "A model directory: tokenizer.json, tokenizer.model, or encoder.json and vocab.bpe (and tokenizer_config.json)");
  c->add_option("--shard-tokens", o->shard_tokens, "Tokens per shard (with --tokenizer)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->needs(tokenizer);
  c->add_option("--threads", o->threads, "Tokenizing threads (0: every core; with --tokenizer)")
      ->capture_default_str()
      ->needs(tokenizer);
  return {c, [o, fraction] {
            if (fraction->count() > 0 && o->validation.empty() && o->tokenizer.empty()) {
              std::cerr << "meshtrain prepare-data: --validation-fraction needs --validation FILE (or --tokenizer, "
                           "whose validation shard it sizes)\n";
              return kExitUnreadable;
            }
            return PrepareDataCommand(*o, std::cout);
          }};
}

Command Sample(CLI::App& parent) {
  auto o = Make<SampleOptions>();
  CLI::App* c = parent.add_subcommand("sample", "Continue a prompt from a checkpoint or a safetensors GPT-2");
  c->add_option("checkpoint", o->checkpoint, "A checkpoint (PATH/step-N), or a job's checkpoint path (its newest)");
  c->add_option("--from", o->from, "A GPT-2 in Hugging Face's safetensors layout, instead of a checkpoint");
  c->add_option("--tokenizer", o->tokenizer, "The model's tokenizer directory (tokenizer.json, tokenizer.model, or encoder.json and vocab.bpe)");
  c->add_option("--prompt", o->prompt, "Text to continue (default: start of a document)");
  c->add_option("--tokens", o->tokens, "Tokens to sample")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  c->add_option("--temperature", o->temperature, "Sampling temperature")
      ->check(CLI::Range(1e-6, 1e6))
      ->capture_default_str();
  c->add_option("--top-k", o->top_k, "Sample only among the k likeliest tokens (0: all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  c->add_option("--seed", o->seed, "Sampling seed")->capture_default_str();
  c->add_option("--device", o->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  return {c, [o] { return SampleCommand(*o, std::cout); }};
}

Command Plan(CLI::App& parent) {
  auto o = Make<PlanOptions>();
  auto output = std::make_shared<std::string>("text");
  CLI::App* c =
      parent.add_subcommand("plan", "Place a job on a cluster by topology and compare with a topology-blind placement");
  c->add_option("job", o->job_file, "Manifest file with one TrainingJob")->required();
  auto* cluster = c->add_option("--cluster", o->cluster_file, "Compact cluster description (YAML or JSON)");
  auto* nodes = c->add_option("--nodes-json", o->nodes_json, "Output of kubectl get nodes -o json");
  c->add_option("--pods-json", o->pods_json, "Output of kubectl get pods -A -o json")->needs(nodes);
  cluster->excludes(nodes);
  c->add_option("--link", o->link_overrides,
                "Override a link: LEVEL=GBPS[,LATENCY_US], LEVEL being nvlink, cluster or a topology level");
  c->add_option("--avoid", o->avoid, "A node not to use");
  c->add_option("--links", o->links_file, "Measured links (meshtrain bench comm --calibrate writes the file)");
  c->add_option("--worker-defaults", o->worker_defaults,
                "The operator's worker defaults (the chart's workerDefaults): tolerations, EFA, topology levels");
  auto* auto_layout = c->add_flag(
      "--auto", o->auto_layout,
      "Plan the layout (T, S, micro-batch, activations): the top candidates, and why the others do not fit");
  c->add_option("--device", o->device,
                "With --auto: the nodes' instance type (p5.48xlarge, ...) or cpu (default: the placed nodes' label)")
      ->needs(auto_layout);
  c->add_option("--top", o->top, "With --auto: candidates to print")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str()
      ->needs(auto_layout);
  c->add_option("--output,-o", *output, "text or json")->check(CLI::IsMember({"text", "json"}))->capture_default_str();
  return {c, [o, output] {
            if (o->cluster_file.empty() && o->nodes_json.empty()) {
              std::cerr << "meshtrain plan: give --cluster FILE or --nodes-json FILE\n";
              return kExitUnreadable;
            }
            o->json = *output == "json";
            return PlanCommand(*o, std::cout, std::cerr);
          }};
}

Command BenchPlan(CLI::App& bench, const std::vector<std::string>& self) {
  auto o = Make<BenchPlanOptions>();
  CLI::App* c = bench.add_subcommand(
      "plan", "Placement time and topology-aware vs blind communication; the layout planner against the engine");
  c->add_option("--nodes", o->nodes, "Nodes per generated cluster")->capture_default_str();
  c->add_option("--clusters", o->clusters, "Clusters for the ratio")->capture_default_str();
  c->add_option("--seed", o->seed, "First random seed")->capture_default_str();
  auto* memory = c->add_flag("--memory", o->memory, "The memory model against the engine's accounting, 14 layouts");
  auto* measure = c->add_flag("--measure", o->measure,
                              "Every layout the planner finds feasible, run on the testbed: modelled against measured");
  auto* at_scale = c->add_flag("--at-scale", o->at_scale, "The planner's choice for GPT-2 1.5B and Llama 3.1 8B and 70B on 16-128 p5 nodes");
  memory->excludes(measure)->excludes(at_scale);
  measure->excludes(at_scale);
  c->add_option("--model", o->model, "Model preset (--memory, --measure)")->capture_default_str();
  c->add_option("--device", o->device, "--memory: cpu (fp32 ranks) or cuda (bf16 ranks sharing GPU 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str()
      ->needs(memory);
  c->add_option("--seq", o->seq, "Sequence length")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  c->add_option("--steps", o->steps, "Measured steps per layout")->check(CLI::Range(1, 1000))->capture_default_str();
  c->add_option("--testbed-nodes", o->testbed_nodes, "Virtual nodes (--measure)")->check(CLI::Range(1, 16))->capture_default_str();
  c->add_option("--ranks-per-node", o->ranks_per_node, "Ranks per virtual node (--measure)")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  c->add_option("--netbed", o->netbed, "Run node i's ranks in network namespace NAME-i (scripts/netbed.sh up NAME ...)");
  c->add_option("--links", o->links_file, "Measured links (meshtrain bench comm --calibrate)");
  c->add_option("--memory-mib", o->memory_mib, "Memory per rank the planner plans for (--measure)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  c->add_option("--global-batch", o->global_batch_tokens, "Global batch in tokens (--measure; default 16 sequences a rank)");
  c->add_option("--max-micro-batch", o->max_micro_batch, "Largest micro-batch searched")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  c->add_option("--top", o->top, "Candidates printed")->check(CLI::Range(1, 1000))->capture_default_str();
  c->add_option("--measure-top", o->measure_top,
                "--measure: only the N fastest modelled layouts of each pipeline degree (0: every feasible one)")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str()
      ->needs(measure);
  return {c, [o, self] { return BenchPlannerCommand(*o, self, std::cout); }};
}

Command BenchTrain(CLI::App& bench, const std::vector<std::string>& self) {
  auto o = Make<BenchTrainOptions>();
  CLI::App* c = bench.add_subcommand("train", "Training throughput and MFU on this machine");
  c->add_option("--model", o->model, "Model preset")->capture_default_str();
  c->add_option("--batch", o->batch, "Micro-batch size")->check(CLI::Range(1, 4096))->capture_default_str();
  c->add_option("--seq", o->seq, "Sequence length")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  c->add_option("--steps", o->steps, "Measured steps")->check(CLI::Range(1, 100000))->capture_default_str();
  c->add_option("--layers", o->layers, "The preset's layers, replaced (a large model cut to fit)")
      ->check(CLI::Range(1, 1024));
  c->add_option("--ranks", o->ranks, "Ranks, as processes on this machine (cpu)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  c->add_option("--shard", o->shard, "hybridShardDegree of the ranks (0: all)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  c->add_option("--tp", o->tp, "tensorParallelDegree of the ranks")->check(CLI::Range(1, 64))->capture_default_str();
  c->add_option("--nodes", o->nodes, "Virtual nodes the ranks spread over (they divide --ranks)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  c->add_option("--netbed", o->netbed,
                "Run node i's ranks in network namespace NAME-i of a testbed (scripts/netbed.sh up NAME ...)");
  auto* checkpointing = c->add_flag("--checkpointing", o->checkpointing, "Activation checkpointing");
  c->add_option("--offload", o->offload, "Offload activations with this loading horizon (turns checkpointing on)")
      ->check(CLI::Range(1, 1024));
  c->add_option("--compare", o->compare,
                "replicated: also run the ranks replicated; activations: keep all, checkpointing and "
                "offload side by side; data-parallel: the ranks without TP; hybrid: shard groups of one "
                "node's ranks against one of all ranks; order: the scheduler's node order against name order "
                "on a racked testbed; context: the ranks splitting each sequence (ring attention) against the same "
                "ranks holding a whole sequence each; fp32 or bf16: one rank in --precision against one in this "
                "precision; with ratios")
      ->check(CLI::IsMember({"replicated", "activations", "data-parallel", "hybrid", "order", "context", "fp32", "bf16"}));
  auto* precision = c->add_option("--precision", o->precision, "fp32, bf16 or fp8 (default: bf16 on cuda, fp32 on cpu)")
                        ->check(CLI::IsMember({"fp32", "bf16", "fp8"}));
  auto* recipe = c->add_option("--float8-recipe", o->float8_recipe, "With --precision fp8: tensorwise or rowwise")
                     ->check(CLI::IsMember({"tensorwise", "rowwise"}))
                     ->capture_default_str();
  auto* racks = c->add_option("--racks", o->racks,
                              "With --compare order: racks of the testbed (scripts/netbed.sh up NAME NODES RATE RACKS UPLINK)")
                    ->check(CLI::Range(1, 64))
                    ->capture_default_str();
  c->add_option("--device", o->device, "cpu (fp32) or cuda (bf16 on GPU 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  return {c, [o, self, checkpointing, racks, precision, recipe] {
            if (recipe->count() > 0 && o->precision != "fp8") {
              std::cerr << "meshtrain bench train: --float8-recipe is fp8's; add --precision fp8\n";
              return kExitUnreadable;
            }
            const bool precisions = o->compare == "fp32" || o->compare == "bf16";
            if (precisions && (o->ranks > 1 || o->tp > 1)) {
              std::cerr << "meshtrain bench train: --compare " << o->compare << " compares one rank's precisions; "
                        << "leave out --ranks and --tp\n";
              return kExitUnreadable;
            }
            if (precision->count() > 0 && (o->ranks > 1 || o->tp > 1 || (!o->compare.empty() && !precisions))) {
              std::cerr << "meshtrain bench train: --precision runs one rank, alone or with --compare fp32|bf16\n";
              return kExitUnreadable;
            }
            if (racks->count() > 0 && o->compare != "order") {
              std::cerr << "meshtrain bench train: --racks describes the testbed of --compare order\n";
              return kExitUnreadable;
            }
            if (checkpointing->count() > 0 && o->compare == "activations") {
              std::cerr << "meshtrain bench train: --compare activations runs keep all, checkpointing and offload "
                           "itself; leave out --checkpointing\n";
              return kExitUnreadable;
            }
            return BenchTrainCommand(*o, self, std::cout);
          }};
}

Command BenchCheckpoint(CLI::App& bench) {
  auto o = Make<BenchCheckpointOptions>();
  CLI::App* c = bench.add_subcommand(
      "checkpoint", "A checkpoint's stall on the training step against a blocking write, and each resuming rank's memory");
  c->add_option("--model", o->model, "Model preset")->capture_default_str();
  c->add_option("--dir", o->dir, "Where to write (default: a temporary directory)");
  c->add_option("--repeats", o->repeats, "Checkpoints of each kind")->check(CLI::Range(1, 100))->capture_default_str();
  c->add_option("--writers", o->writers, "Ranks (shards) that write the checkpoint to resume from")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  c->add_option("--readers", o->readers, "Ranks (shards) of each layout that resumes from it")
      ->check(CLI::Range(1, 64))
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--layers", o->layers, "The preset's layers, replaced")->check(CLI::Range(1, 1024));
  c->add_option("--hidden", o->hidden, "The preset's hidden size, replaced")->check(CLI::Range(1, 1 << 16));
  c->add_option("--vocab", o->vocab, "The preset's vocabulary size, replaced")->check(CLI::Range(1, 1 << 24));
  c->add_flag("--check", o->check, "Exit 1 when a resuming rank's peak passes its shard state plus one unit");
  c->add_option("--device", o->device, "Where the state is snapshot from: cpu (fp32) or cuda (bf16 on GPU 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  return {c, [o] { return BenchCheckpointCommand(*o, std::cout); }};
}

Command BenchTokenize(CLI::App& bench) {
  auto o = Make<BenchTokenizeOptions>();
  CLI::App* c = bench.add_subcommand("tokenize", "Tokens/s of a model directory's tokenizer against a reference encoder");
  c->add_option("--tokenizer", o->tokenizer, "The model directory (tokenizer.json, tokenizer.model, ...)")->required();
  c->add_option("--text", o->text, "Text to encode")->capture_default_str();
  c->add_option("--repeat", o->repeat, "The text this many times over")->check(CLI::Range(1, 1000))->capture_default_str();
  c->add_option("--threads", o->threads, "Threads of the second run (0: every core)")->capture_default_str();
  c->add_option("--node-modules", o->node_modules, "Where the npm references are")->capture_default_str();
  c->add_option("--scripts", o->scripts, "Where the references' scripts are")->capture_default_str();
  return {c, [o] { return BenchTokenizeCommand(*o, std::cout); }};
}

Command BenchComm(CLI::App& bench, const std::vector<std::string>& self) {
  auto o = Make<BenchCommOptions>();
  auto sizes = std::make_shared<std::string>("1K..64M");
  CLI::App* c = bench.add_subcommand("comm", "Collective bandwidth over the fabric backend, ranks on virtual nodes");
  c->add_option("--ranks", o->ranks, "Ranks")->check(CLI::Range(1, 64))->capture_default_str();
  c->add_option("--nodes", o->nodes, "Virtual nodes (ranks divide evenly)")->check(CLI::Range(1, 64))->capture_default_str();
  auto* op = c->add_option("--op", o->op, "Collective")
      ->check(CLI::IsMember({"all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "all_to_all_v"}))
      ->capture_default_str();
  auto* size_range =
      c->add_option("--sizes", *sizes, "Sizes MIN..MAX in bytes (K, M, G suffixes), doubling")->capture_default_str();
  c->add_option("--algorithm", o->algorithm, "Force auto, ring, log or hierarchical");
  auto* in_place = c->add_flag("--in-place", o->in_place, "Operate in place");
  auto* heap_buffers = c->add_flag("--heap-buffers", o->heap_buffers,
              "Use heap memory instead of the communicator's (intra-node peers then copy through the provider)");
  auto* warmup = c->add_option("--warmup", o->warmup, "Unmeasured iterations per size")->capture_default_str();
  c->add_option("--netbed", o->netbed,
                "Run node i's ranks in network namespace NAME-i of a testbed (scripts/netbed.sh up NAME ...)");
  c->add_option("--calibrate", o->calibrate,
                "Fit the intra-node and between-node links (alpha-beta, per rank, all ranks at once) and write them "
                "to this link file for meshtrain plan --links (its own sizes and collectives)")
      ->excludes(op)
      ->excludes(size_range)
      ->excludes(in_place)
      ->excludes(heap_buffers)
      ->excludes(warmup);
  return {c, [o, sizes, self] {
            if (!ParseSizeRange(*sizes, &o->min_bytes, &o->max_bytes)) {
              std::cerr << "meshtrain bench comm: --sizes \"" << *sizes << "\" is not MIN..MAX (like 1K..256M)\n";
              return kExitUnreadable;
            }
            return BenchCommCommand(*o, self, std::cout);
          }};
}

Command BenchOperator(CLI::App& bench) {
  auto o = Make<BenchOperatorOptions>();
  CLI::App* c = bench.add_subcommand("operator", "The operator against the test API server: job-to-pods latency, requests, memory");
  c->add_option("--nodes", o->nodes, "Nodes in the synthetic cluster")->check(CLI::Range(1, 100000))->capture_default_str();
  c->add_option("--jobs", o->jobs, "Jobs to create")->check(CLI::Range(1, 100000))->capture_default_str();
  c->add_option("--job-nodes", o->job_nodes, "Nodes per job")->check(CLI::Range(1, 4096))->capture_default_str();
  c->add_option("--gpus-per-node", o->gpus_per_node, "GPUs per pod")->check(CLI::Range(1, 8))->capture_default_str();
  c->add_option("--interval-ms", o->interval_ms, "Time between job creations")->check(CLI::Range(0, 60000))->capture_default_str();
  c->add_option("--workers", o->workers, "Operator --workers")->capture_default_str();
  c->add_option("--qps", o->qps, "Operator --qps")->capture_default_str();
  c->add_option("--burst", o->burst, "Operator --burst")->capture_default_str();
  c->add_option("--timeout", o->timeout_seconds, "Seconds to wait for all pods")->capture_default_str();
  c->add_option("--hanging-metrics", o->hanging_metrics,
                "Then as many jobs again, while this many jobs' metrics endpoints hang")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  c->add_flag("--kueue", o->kueue,
              "Jobs through Kueue (the test server's admission simulator, TAS, quota for every node): "
              "also report job -> Workload -> admission -> pods")
      ->excludes("--hanging-metrics");
  c->add_option("--kueue-crds", o->kueue_crds, "Directory of Kueue's CRDs, for --kueue")->capture_default_str();
  c->add_option("--crd", o->crd, "The TrainingJob CRD")->capture_default_str();
  c->add_option("--apiserver", o->apiserver, "meshtrain-test-apiserver binary");
  c->add_option("--operator", o->operator_binary, "meshtrain-operator binary");
  return {c, [o] { return BenchOperatorCommand(*o, std::cout); }};
}

Command Launch(CLI::App& parent) {
  auto o = Make<LaunchOptions>();
  CLI::App* c = parent.add_subcommand("launch", "Run a command as the ranks of a job on virtual nodes of this machine");
  c->fallthrough(false);  // the rank command's own flags are not meshtrain's
  c->add_option("--nodes", o->nodes, "Virtual nodes")->check(CLI::Range(1, 256))->capture_default_str();
  c->add_option("--nproc-per-node", o->ranks_per_node, "Ranks per node")->check(CLI::Range(1, 256))->capture_default_str();
  c->add_option("--timeout", o->timeout_seconds, "Stop the job after this many seconds (0: never)")->capture_default_str();
  c->add_option("command", o->command, "The rank command (after --)")->required();
  return {c, [o] { return LaunchCommand(*o, std::cout); }};
}

}  // namespace

int Main(int argc, char** argv) {
  CLI::App app{"meshtrain: train large models across GPU clusters, or on this machine", "meshtrain"};
  app.set_version_flag("--version", VersionString());
  app.require_subcommand(1);
  app.fallthrough();  // --log-level after the command too (subcommands inherit this as they are made)
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "Log level")
      ->check(CLI::IsMember(LogLevelNames()))
      ->capture_default_str();
  const std::vector<std::string> self = launch::SelfCommand(argc, argv);  // how ranks re-run this program
  // The commands, in the order `meshtrain --help` lists them.
  std::vector<Command> commands = {Validate(app), Layout(app),      Run(app), Checkpoints(app),
                                   Export(app),   ModelSpec(app),   PrepareData(app), Sample(app), Plan(app)};
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  for (Command& c : std::vector<Command>{BenchPlan(*bench, self), BenchTrain(*bench, self), BenchCheckpoint(*bench),
                                         BenchComm(*bench, self), BenchOperator(*bench), BenchTokenize(*bench)})
    commands.push_back(std::move(c));
  commands.push_back(Launch(app));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUnreadable;
  }
  InitLogging("meshtrain", log_level);
  for (const Command& command : commands) {
    if (!command.app->parsed()) continue;
    // Each command reports the errors it expects; any other still ends in a message, not abort().
    try {
      return command.run();
    } catch (const std::exception& e) {
      std::cerr << "meshtrain " << CommandName(*command.app) << ": " << e.what() << "\n";
      return kExitUnreadable;
    }
  }
  return kExitUnreadable;
}

}  // namespace meshtrain::cli
