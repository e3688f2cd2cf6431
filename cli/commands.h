// The `meshtrain` subcommands. Each writes its report to `out` and returns the
// process exit code: 0 success, 1 an invalid job, 2 a file that cannot be read or parsed.

#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "api/model_shape.h"
#include "api/worker_contract.h"

namespace meshtrain::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInvalid = 1;
inline constexpr int kExitUnreadable = 2;

// Prints "ok" or every error, with its field path, for each job in each file.
int ValidateCommand(const std::vector<std::string>& files, std::ostream& out);

// Prints the mesh of each job in `file`: nodes, and the TP, shard and replica groups.
int LayoutCommand(const std::string& file, std::ostream& out);

struct RunOptions {
  std::string file;
  int sample_tokens = api::worker::env::kDefaultSampleTokens;  // text sampled from the trained model at the end
  bool resume = true;       // from the newest checkpoint under spec.checkpoint.path (--no-resume: start fresh)
};

// Trains one job on this machine: validates and lays it out, then trains it showing
// step, loss and tokens/s. A one-rank job trains in this process and ends with a text
// sample from the model; a larger one runs its ranks as `meshtrain-worker train`
// processes on virtual nodes of this machine (found next to this program, or in
// $MESHTRAIN_WORKER, or on PATH).
int RunCommand(const RunOptions& options, std::ostream& out);

// Lists the checkpoints under `path` (a job's spec.checkpoint.path), newest first, and
// verifies each. Exit 0 when all verify, 1 when one is damaged, 2 when there are none.
int CheckpointsCommand(const std::string& path, std::ostream& out);

// Writes the master weights of the checkpoint in `checkpoint` (a step directory) to
// `output` as a GPT-2 in Hugging Face's safetensors layout. Exit 0, or 2 for a checkpoint
// that cannot be read or a format other than safetensors.
// The spec.model fields of a Hugging Face model directory's config.json, as YAML.
int ModelSpecCommand(const std::string& directory, int64_t seq_len, std::ostream& out);

struct ExportOptions {
  std::string checkpoint, output, format = "safetensors", dtype = "f32", max_shard_size = "5GB";
  std::string like;  // a model directory whose token ids and tokenizer files the export takes
};
int ExportCommand(const ExportOptions& options, std::ostream& out);

struct PrepareDataOptions {
  std::string input;        // a text file
  std::string output;       // token file of the text (less the validation split)
  std::string validation;   // optional token file of the last validation_fraction of the text
  double validation_fraction = 0.1;
  // With a tokenizer: `input` may be a glob of .jsonl and text files, `output` is
  // the shards' prefix.
  std::string tokenizer;
  uint64_t shard_tokens = 100'000'000;
  int threads = 0;
};

// Tokenizes text into token files: bytes into MTOK files, or with a model's tokenizer
// (--tokenizer) into llm.c shards (worker/train/prepare_data.h), with progress on stderr.
// Exit 2 when two of the input, output and validation files are one file.
int PrepareDataCommand(const PrepareDataOptions& options, std::ostream& out);

struct SampleOptions {
  std::string checkpoint;  // PATH/step-N, or a job's spec.checkpoint.path (its newest intact one)
  std::string from;        // or a GPT-2 in Hugging Face's safetensors layout
  std::string tokenizer;   // the model's tokenizer directory; needed for text with more than 256 tokens
  std::string prompt;      // empty: start from end-of-text (or a newline for bytes)
  int tokens = 64;
  double temperature = 1.0;
  int top_k = 0;
  uint64_t seed = 1;
  std::string device = "cpu";  // cpu | cuda
};

// Continues a prompt from a checkpoint or a safetensors file; prints the text.
int SampleCommand(const SampleOptions& options, std::ostream& out);

struct PlanOptions {
  std::string job_file;
  std::string cluster_file;  // compact description; or else
  std::string nodes_json;    // kubectl get nodes -o json
  std::string pods_json;     // kubectl get pods -A -o json (optional)
  std::vector<std::string> link_overrides;  // LEVEL=GBPS[,LATENCY_US]
  std::vector<std::string> avoid;           // node names not to use
  std::string links_file;                   // measured links (bench comm --calibrate)
  // The operator's --worker-defaults file (the chart's workerDefaults): what the job's pods
  // get unless it says otherwise, so the preview places what the operator would.
  std::string worker_defaults;
  bool json = false;
  // The planner: the top candidates on the placed nodes and why the rest do not fit.
  bool auto_layout = false;
  std::string device;  // an EKS instance type or "cpu"; empty: the placed nodes' instance type
  int top = 5;
};

// Places a job on a cluster and prints the placement, its rank table, the link each
// group uses and the modelled communication per step, beside a topology-blind placement.
// Errors go to `err`, so `out` holds only the result (parseable with --output json).
int PlanCommand(const PlanOptions& options, std::ostream& out, std::ostream& err);

struct BenchPlanOptions {
  int nodes = 2000;
  int time_job_nodes = 128;
  int time_runs = 20;
  int ratio_job_nodes = 64;
  int clusters = 100;
  uint64_t seed = 1;
  // The layout planner (bench_planner.cc).
  bool memory = false;    // the memory model against the accounting, 14 layouts on one node
  // --memory: "cpu" trains fp32 ranks here; "cuda", bf16 ranks sharing GPU 0 (6 layouts)
  std::string device = "cpu";
  bool measure = false;   // every feasible layout on the testbed, modelled and measured
  bool at_scale = false;  // GPT-2 1.5B and a 7B shape on 16 to 128 p5 nodes, on paper
  std::string model = "gpt2-tiny";
  int seq = 64;
  int steps = 3;
  int testbed_nodes = 2;
  int ranks_per_node = 2;
  std::string netbed;
  std::string links_file;
  int memory_mib = 64;  // per rank, what the planner may fill (less its margin)
  int64_t global_batch_tokens = 0;  // 0: 16 sequences per rank
  int max_micro_batch = 8;
  int top = 5;
  int measure_top = 0;  // --measure: the N fastest modelled layouts of each P; 0: every one
};

// Placement time and the topology-aware vs blind step-communication ratio on
// generated EKS-like clusters.
int BenchPlanCommand(const BenchPlanOptions& options, std::ostream& out);
// With --memory, --measure or --at-scale, the planner's benchmarks; otherwise BenchPlanCommand.
// Inside a launched rank, the rank's training.
int BenchPlannerCommand(const BenchPlanOptions& options, const std::vector<std::string>& self_argv, std::ostream& out);

struct BenchTrainOptions {
  std::string model = "gpt2-124m";
  std::string device = "cpu";  // or "cuda": bf16 on GPU 0
  int batch = 4;
  int seq = 64;
  int steps = 5;   // measured
  int warmup = 2;  // not measured
  int ranks = 1;   // above 1: ranks as processes here, each with micro-batches of `batch`
  int tp = 1;      // tensorParallelDegree of those ranks
  int shard = 0;   // hybridShardDegree of those ranks (0: all of them)
  int nodes = 1;   // virtual nodes the ranks spread over (consecutive ranks per node)
  std::string netbed;  // run node i's ranks in the testbed's namespace NAME-i (scripts/netbed.sh)
  int racks = 1;       // the testbed's racks (node i in rack i % racks), for --compare order
  bool checkpointing = false;  // activation checkpointing
  int offload = 0;             // above 0: activation offload with this loading horizon
  // "replicated": the same ranks with shard groups of one as well; "activations": every
  // block's activations kept, checkpointing, and offload (horizon --offload, or 2);
  // "data-parallel": the same ranks without TP, at the same global batch; "order": the
  // scheduler's topology-aware node order against name order on a racked testbed;
  // "context": the ranks splitting each sequence (contextParallelDegree = ranks) against
  // the same ranks holding a whole sequence each; "fp32", "bf16": one rank in --precision
  // against one in this precision (on the CPU bf16 trains in fp32), in one run
  std::string compare;
  // The run's spec.training.precision (empty: bf16 on cuda, fp32 on the CPU) and, with
  // fp8, spec.training.float8.recipe.
  std::string precision;
  std::string float8_recipe = "tensorwise";
  int layers = 0;  // above 0: the preset's layers, replaced (a large model cut to fit)
};

// Single-rank training throughput, FLOP/s, MFU against the matrix rate measured at the
// model's shapes (sgemm on the CPU, cuBLAS bf16 on GPU 0), and memory by category.
// With ranks > 1 or a comparison, runs the ranks as processes (`self_argv` relaunched)
// and reports tokens/s, per-rank peak memory by category and the activation copy
// stream's busy time; with compare, each configuration and its ratios to the first.
int BenchTrainCommand(const BenchTrainOptions& options, const std::vector<std::string>& self_argv,
                      std::ostream& out);

struct BenchCheckpointOptions {
  std::string model = "gpt2-124m";
  std::string device = "cpu";  // where the training state is snapshot from: cpu (fp32) or cuda (bf16 on GPU 0)
  std::string dir;  // where to write (default: the system's temporary directory)
  int repeats = 2;
  int writers = 4;                // ranks (shards) that write the checkpoint resumed from
  std::vector<int> readers{2, 8};  // ranks (shards) of each layout that resumes from it
  int layers = 0, hidden = 0;      // above 0: the preset's, replaced
  int64_t vocab = 0;               // above 0: the preset's vocabSize, replaced
  // Fail (exit 1) when a resuming rank's peak passes its shard state plus one unit. A
  // model whose units are smaller than a process's own costs (code and libraries paged
  // in, a few MiB) cannot show the bound; the default, gpt2-124m, can.
  bool check = false;
};

// One rank's checkpoint of `model` after a training step: the stall a checkpoint step
// sees (the snapshot to host memory, then training goes on) against the time a blocking
// write takes (snapshot, files written and fsynced, renamed into place), and their ratio.
// Then that state written by `writers` ranks and resumed by every rank of each `readers`
// layout, each in a process of its own: its peak host memory while loading against its
// own shard state and one unit, and the whole-model load's peak; with `check`, a rank
// past that bound fails the command.
int BenchCheckpointCommand(const BenchCheckpointOptions& options, std::ostream& out);

// The whole CLI: parses argv and dispatches.
int Main(int argc, char** argv);

struct BenchCommOptions {
  int ranks = 2;
  int nodes = 1;
  std::string op = "all_reduce";  // all_gather | reduce_scatter | all_reduce | broadcast
  size_t min_bytes = 1024, max_bytes = 64 << 20;
  std::string algorithm;  // empty: MESHTRAIN_COMM_ALGORITHM or auto
  bool in_place = false;
  bool heap_buffers = false;  // plain heap memory instead of Communicator::AllocateBuffer
  int warmup = 3;
  size_t max_iterations = 200;
  std::string netbed;  // run node i's ranks in the testbed's namespace NAME-i (scripts/netbed.sh)
  std::string calibrate;  // a link file to write: the intra-node and between-node links, fitted
};

// Collective bandwidth, one row per size as in nccl-tests (time, algbw, busbw). Started
// by a user it launches `self_argv` as --ranks ranks on --nodes virtual nodes; inside a
// launched rank it runs the measurement and rank 0 prints.
int BenchCommCommand(const BenchCommOptions& options, const std::vector<std::string>& self_argv,
                     std::ostream& out);

struct LaunchOptions {
  int nodes = 1;
  int ranks_per_node = 1;
  int timeout_seconds = 0;  // 0: none
  std::vector<std::string> command;
};

// Runs `command` as nodes x ranks_per_node ranks on this machine with the worker
// contract's environment; one failing rank stops the rest. Returns the first failure's status.
int LaunchCommand(const LaunchOptions& options, std::ostream& out);

struct BenchOperatorOptions {
  int nodes = 2000;
  int jobs = 200;
  int job_nodes = 16;
  int gpus_per_node = 4;  // two pods per 8-GPU node, so 200 x 16 pods fit on 2,000 nodes
  int interval_ms = 50;   // between job creations
  int workers = 4;
  double qps = 500;
  int burst = 1000;
  int timeout_seconds = 120;
  int hanging_metrics = 0;  // jobs whose metrics endpoints hang, during a second half of `jobs`
  // The Kueue path: the test server's Kueue admission simulator (TAS, quota for every
  // node), the operator with --kueue, every job in a queue; reports the Workload round trip.
  bool kueue = false;
  std::string kueue_crds = "tests/data/kueue";  // Kueue's CRDs, one YAML file each
  std::string crd = "crds/trainingjobs.meshtrain.dev.yaml";
  std::string apiserver;        // default: next to this binary's build tree
  std::string operator_binary;  // default: next to this binary's build tree
};

// Runs meshtrain-operator against the test API server with a synthetic cluster and
// reports job-to-pods latency, API requests per job and the operator's peak memory.
int BenchOperatorCommand(const BenchOperatorOptions& options, std::ostream& out);

}  // namespace meshtrain::cli
