#include "api/pipeline.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

#include "api/model_family.h"

namespace meshtrain::api {

PipelineSchedule ParsePipelineSchedule(const std::string& name) {
  if (name == "GPipe") return PipelineSchedule::kGPipe;
  if (name == "1F1B") return PipelineSchedule::kOneFOneB;
  if (name == "Interleaved1F1B") return PipelineSchedule::kInterleaved;
  throw std::invalid_argument("spec.parallelism.pipelineSchedule: must be one of GPipe, 1F1B, Interleaved1F1B, got \"" +
                              name + "\"");
}

const char* PipelineScheduleName(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe: return "GPipe";
    case PipelineSchedule::kOneFOneB: return "1F1B";
    case PipelineSchedule::kInterleaved: return "Interleaved1F1B";
  }
  return "?";
}

Pipeline Pipeline::Of(const ParallelismSpec& p) {
  return {int(p.pipeline_parallel_degree), int(p.pipeline_virtual_stages), ParsePipelineSchedule(p.pipeline_schedule)};
}

std::vector<int> SplitBlocks(const ModelShape& shape, int64_t seq, int chunks) {
  const int L = int(shape.layers);
  if (chunks < 1 || chunks > L) {
    throw std::invalid_argument("SplitBlocks: " + std::to_string(chunks) + " chunks of " + std::to_string(L) +
                                " blocks");
  }
  // Costs in blocks' forward FLOPs: the head's product against the vocabulary on the last
  // chunk; the embedding's lookup is free.
  const double block = BlockForwardFlopsPerToken(shape, seq, 1);
  const double head = 2.0 * double(shape.vocab_size) * double(shape.hidden) / block;
  std::vector<int> blocks(size_t(chunks), 1);
  auto cost = [&](int c, int n) { return double(n) + (c == chunks - 1 ? head : 0.0); };
  for (int left = L - chunks; left > 0; --left) {
    int best = 0;
    for (int c = 1; c < chunks; ++c) {
      if (cost(c, blocks[size_t(c)] + 1) < cost(best, blocks[size_t(best)] + 1)) best = c;
    }
    ++blocks[size_t(best)];
  }
  std::vector<int> first(1, 0);
  for (int n : blocks) first.push_back(first.back() + n);
  return first;
}

std::vector<int> ChunksOf(const Pipeline& pipeline, int stage) {
  std::vector<int> chunks;
  for (int v = 0; v < pipeline.virtual_stages; ++v) chunks.push_back(v * pipeline.stages + stage);
  return chunks;
}

std::string ToString(const PipeAction& a) {
  const char* name = "?";
  switch (a.op) {
    case PipeOp::kForward: name = "F"; break;
    case PipeOp::kBackward: name = "B"; break;
    case PipeOp::kRecvActivation: name = "RECV_F"; break;
    case PipeOp::kSendActivation: name = "SEND_F"; break;
    case PipeOp::kRecvGradient: name = "RECV_B"; break;
    case PipeOp::kSendGradient: name = "SEND_B"; break;
    case PipeOp::kUnshardForward: name = "UNSHARD_F"; break;
    case PipeOp::kUnshardBackward: name = "UNSHARD_B"; break;
    case PipeOp::kReshard: name = "RESHARD"; break;
  }
  return name + std::to_string(a.micro) + "." + std::to_string(a.chunk);
}

std::vector<PipeAction> StageActions(const Pipeline& pipeline, int stage, int micro_batches) {
  const int P = pipeline.stages, V = pipeline.virtual_stages, M = micro_batches;
  if (stage < 0 || stage >= P) throw std::invalid_argument("StageActions: stage " + std::to_string(stage));
  if (P > 1 && M < P) {
    throw std::invalid_argument("a pipeline of " + std::to_string(P) + " stages needs at least as many micro-batches, got " +
                                std::to_string(M));
  }
  if (V > 1 && M % P != 0) {
    throw std::invalid_argument("Interleaved1F1B needs micro-batches in multiples of the " + std::to_string(P) +
                                " stages, got " + std::to_string(M));
  }
  std::vector<PipeAction> actions;
  auto forward = [&](int m, int c) { actions.push_back({PipeOp::kForward, m, c}); };
  auto backward = [&](int m, int c) { actions.push_back({PipeOp::kBackward, m, c}); };
  if (V == 1) {
    // GPipe fills with every forward; 1F1B with the P - 1 - p the later stages need first.
    const int warmup = pipeline.schedule == PipelineSchedule::kGPipe ? M : std::min(P - 1 - stage, M);
    for (int m = 0; m < warmup; ++m) forward(m, stage);
    for (int m = 0; m < M - warmup; ++m) {
      forward(warmup + m, stage);
      backward(m, stage);
    }
    for (int m = M - warmup; m < M; ++m) backward(m, stage);
    return actions;
  }
  // Interleaved: the k-th forward (and backward) of the stage, of M x V, goes through
  // the chunk and micro-batch below; groups of P micro-batches pass chunk after chunk.
  const int total = M * V;
  auto micro = [&](int k) { return k / (P * V) * P + k % P; };
  auto chunk = [&](int k, bool is_forward) {
    const int v = k % (P * V) / P;
    return (is_forward ? v : V - 1 - v) * P + stage;
  };
  const int warmup = M == P ? total : std::min(total, (P - stage - 1) * 2 + (V - 1) * P);
  for (int k = 0; k < warmup; ++k) forward(micro(k), chunk(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    forward(micro(k + warmup), chunk(k + warmup, true));
    backward(micro(k), chunk(k, false));
  }
  for (int k = total - warmup; k < total; ++k) backward(micro(k), chunk(k, false));
  return actions;
}

std::vector<PipeAction> WithTransfers(const Pipeline& pipeline, const std::vector<PipeAction>& compute,
                                      bool training) {
  const int C = pipeline.chunks();
  std::vector<PipeAction> program;
  for (size_t i = 0; i < compute.size(); ++i) {
    const PipeAction& a = compute[i];
    const bool forward = a.op == PipeOp::kForward;
    const bool kept = !forward && i > 0 && compute[i - 1] == PipeAction{PipeOp::kForward, a.micro, a.chunk};
    const bool backward_next = forward && i + 1 < compute.size() &&
                               compute[i + 1] == PipeAction{PipeOp::kBackward, a.micro, a.chunk};
    if (!kept) program.push_back({forward ? PipeOp::kUnshardForward : PipeOp::kUnshardBackward, a.micro, a.chunk});
    if (forward && a.chunk > 0) program.push_back({PipeOp::kRecvActivation, a.micro, a.chunk});
    if (!forward && a.chunk + 1 < C) program.push_back({PipeOp::kRecvGradient, a.micro, a.chunk});
    program.push_back(a);
    if (training && forward && !backward_next) program.push_back({PipeOp::kReshard, a.micro, a.chunk});
    if (forward && a.chunk + 1 < C) program.push_back({PipeOp::kSendActivation, a.micro, a.chunk});
    if (!forward && a.chunk > 0) program.push_back({PipeOp::kSendGradient, a.micro, a.chunk});
  }
  return program;
}

std::vector<PipeAction> StageProgram(const Pipeline& pipeline, int stage, int micro_batches) {
  Pipeline schedule = pipeline;
  if (pipeline.stages == 1) schedule.schedule = PipelineSchedule::kOneFOneB;  // with no fill: F0 B0 F1 B1 ...
  return WithTransfers(pipeline, StageActions(schedule, stage, micro_batches), /*training=*/true);
}

std::vector<PipeAction> ForwardProgram(const Pipeline& pipeline, int stage) {
  std::vector<PipeAction> forwards;
  for (int c : ChunksOf(pipeline, stage)) forwards.push_back({PipeOp::kForward, 0, c});
  return WithTransfers(pipeline, forwards, /*training=*/false);
}

std::vector<int> LanesOf(const Pipeline& pipeline, int stage, int micro_batches) {
  std::vector<int> lanes(size_t(pipeline.virtual_stages), 0), live(lanes.size(), 0);
  for (const PipeAction& a : StageActions(pipeline, stage, micro_batches)) {
    const size_t v = size_t(a.chunk / pipeline.stages);
    live[v] += a.op == PipeOp::kForward ? 1 : -1;
    lanes[v] = std::max(lanes[v], live[v]);
  }
  return lanes;
}

PipelineTimeline SimulateSchedule(const Pipeline& pipeline, int micro_batches, double forward, double backward) {
  const int P = pipeline.stages, C = pipeline.chunks(), M = micro_batches;
  std::vector<std::vector<PipeAction>> actions;
  for (int p = 0; p < P; ++p) actions.push_back(StageActions(pipeline, p, M));

  // Each link carries its sender's messages in order; the receiver must want them in it.
  // A link: (sender stage, receiver stage, direction); a message: the chunk that sends it.
  std::map<std::tuple<int, int, PipeOp>, std::vector<PipeAction>> sent, wanted;
  for (int p = 0; p < P; ++p) {
    for (const PipeAction& a : WithTransfers(pipeline, actions[size_t(p)], /*training=*/true)) {
      const int m = a.micro, c = a.chunk;
      switch (a.op) {
        case PipeOp::kSendActivation: sent[{p, (c + 1) % P, PipeOp::kForward}].push_back({PipeOp::kForward, m, c}); break;
        case PipeOp::kRecvActivation:
          wanted[{(c - 1) % P, p, PipeOp::kForward}].push_back({PipeOp::kForward, m, c - 1});
          break;
        case PipeOp::kSendGradient: sent[{p, (c - 1) % P, PipeOp::kBackward}].push_back({PipeOp::kBackward, m, c}); break;
        case PipeOp::kRecvGradient:
          wanted[{(c + 1) % P, p, PipeOp::kBackward}].push_back({PipeOp::kBackward, m, c + 1});
          break;
        case PipeOp::kForward:
        case PipeOp::kBackward:
        case PipeOp::kUnshardForward:
        case PipeOp::kUnshardBackward:
        case PipeOp::kReshard: break;
      }
    }
  }
  if (sent != wanted) throw std::logic_error("pipeline schedule: a link's messages come out of the order they are wanted");

  std::map<std::tuple<int, int, PipeOp>, double> done;  // (micro, chunk, op) -> end
  std::vector<size_t> next(size_t(P), 0);
  std::vector<double> clock(size_t(P), 0);
  PipelineTimeline timeline;
  timeline.busy.assign(size_t(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int p = 0; p < P; ++p) {
      while (next[size_t(p)] < actions[size_t(p)].size()) {
        const PipeAction& a = actions[size_t(p)][next[size_t(p)]];
        const bool fwd = a.op == PipeOp::kForward;
        double ready = clock[size_t(p)];
        if (fwd && a.chunk > 0) {
          auto it = done.find({a.micro, a.chunk - 1, PipeOp::kForward});
          if (it == done.end()) break;
          ready = std::max(ready, it->second);
        }
        if (!fwd) {
          auto it = a.chunk + 1 < C ? done.find({a.micro, a.chunk + 1, PipeOp::kBackward})
                                    : done.find({a.micro, a.chunk, PipeOp::kForward});
          if (it == done.end()) break;
          ready = std::max(ready, it->second);
        }
        const double took = fwd ? forward : backward;
        clock[size_t(p)] = ready + took;
        timeline.busy[size_t(p)] += took;
        done[{a.micro, a.chunk, a.op}] = clock[size_t(p)];
        ++next[size_t(p)];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int p = 0; p < P; ++p) {
    if (next[size_t(p)] < actions[size_t(p)].size()) {
      stuck += " stage " + std::to_string(p) + " at " + ToString(actions[size_t(p)][next[size_t(p)]]) + ";";
    }
  }
  if (!stuck.empty()) throw std::logic_error("pipeline schedule deadlocks:" + stuck);
  timeline.makespan = *std::max_element(clock.begin(), clock.end());
  return timeline;
}

StageShape StageShapeOf(const ModelShape& shape, const Pipeline& pipeline, int stage, int micro_batches, int64_t seq) {
  if (pipeline.stages == 1) return {};
  const std::vector<int> first = SplitBlocks(shape, seq, pipeline.chunks());
  StageShape s;
  const bool last = stage == pipeline.stages - 1;
  s.embedding_unit = stage == 0 || (last && shape.tied);
  s.head = last;
  s.blocks = 0;
  s.pipelined = true;
  const std::vector<int> lanes = LanesOf(pipeline, stage, micro_batches);
  const std::vector<int> chunks = ChunksOf(pipeline, stage);
  for (size_t v = 0; v < chunks.size(); ++v) {
    const int blocks = first[size_t(chunks[v]) + 1] - first[size_t(chunks[v])];
    s.blocks += blocks;
    s.dense_blocks += int(shape.DenseBlocks(first[size_t(chunks[v])], first[size_t(chunks[v]) + 1]));
    for (int i = 0; i < lanes[v]; ++i) s.lanes.push_back(blocks);
  }
  return s;
}

double BubbleFraction(const Pipeline& pipeline, int micro_batches) {
  const double P = pipeline.stages, V = pipeline.virtual_stages, M = micro_batches;
  return (P - 1) / (V * M + P - 1);
}

}  // namespace meshtrain::api
