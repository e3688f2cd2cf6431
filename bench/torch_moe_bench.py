"""The PyTorch peer of meshtrain's mixture-of-experts benchmark (scripts/gpu-check.sh runs it).

    python3 torch_moe_bench.py --preset qwen3-30b-a3b --layers 4 --batch 2 --seq 2048
    python3 torch_moe_bench.py --preset tiny --device cpu      (a smoke test)

A Qwen3-MoE block in PyTorch eager, as transformers' Qwen3MoeSparseMoeBlock computes it:
RMSNorm; grouped-query attention with per-head RMSNorms of q and k before rotary positions
(the rotate-half form) through scaled_dot_product_attention; then the router's logits, a
softmax in fp32 over all experts, the top k renormalised (norm_topk_prob), and each expert
that received tokens running its SwiGLU MLP on them (a loop over experts, index_add_ back).
Presets are the published shapes (config.json of Qwen/Qwen3-30B-A3B); --layers cuts them
to fit one GPU. It trains in bf16 autocast with fused AdamW on CUDA (fp32 on the CPU),
eager unless --compile 1, and prints one line: tokens/s, TFLOP/s by 6N + 12LTC
where N counts the active parameters (attention, the router and k experts a token, the
head; not the embedding, whose lookup multiplies nothing), and the peak memory.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_peer

# name: (layers, hidden, heads, kv_heads, head_dim, experts, top_k, expert_ffn, vocab, rope_theta)
PRESETS = {
    "tiny": (2, 64, 4, 2, 16, 4, 2, 32, 256, 10000.0),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 128, 8, 768, 151936, 1000000.0),
    "qwen3-235b-a22b": (94, 4096, 64, 4, 128, 128, 8, 1536, 151936, 1000000.0),
}
SHAPE = ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "expert_ffn", "vocab")


class Expert(nn.Module):
    def __init__(self, width, ffn):
        super().__init__()
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SparseMoe(nn.Module):
    """Dropless top-k routing, as transformers' eager Qwen3-MoE block."""

    def __init__(self, s):
        super().__init__()
        self.top_k = s["top_k"]
        self.router = nn.Linear(s["hidden"], s["experts"], bias=False)
        self.experts = nn.ModuleList(Expert(s["hidden"], s["expert_ffn"]) for _ in range(s["experts"]))

    def forward(self, h):
        batch, seq, width = h.shape
        rows = h.reshape(-1, width)
        probabilities = F.softmax(self.router(rows), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(rows.dtype)  # norm_topk_prob
        out = torch.zeros_like(rows)
        # [experts, top_k, rows]: which of each row's k choices is each expert.
        mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten().tolist():
            slot, row = torch.where(mask[e])
            routed = self.experts[e](rows[row]) * weights[row, slot, None]
            out.index_add_(0, row, routed.to(out.dtype))
        return out.view(batch, seq, width)


class Block(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s["heads"], s["kv_heads"], s["head_dim"]
        width = s["hidden"]
        self.attention_norm, self.mlp_norm = torch_peer.RMSNorm(width, 1e-6), torch_peer.RMSNorm(width, 1e-6)
        self.wq = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, width, bias=False)
        self.q_norm = torch_peer.RMSNorm(self.head_dim, 1e-6)
        self.k_norm = torch_peer.RMSNorm(self.head_dim, 1e-6)
        self.moe = SparseMoe(s)

    def attend(self, h, cos, sin):
        batch, seq, _ = h.shape
        heads = lambda t, n: t.view(batch, seq, n, self.head_dim).transpose(1, 2)
        q = torch_peer.rope(self.q_norm(heads(self.wq(h), self.heads)), cos, sin)
        k = torch_peer.rope(self.k_norm(heads(self.wk(h), self.kv_heads)), cos, sin)
        v = heads(self.wv(h), self.kv_heads)
        out = torch_peer.causal_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))

    def forward(self, x, cos, sin):
        x = x + self.attend(self.attention_norm(x), cos, sin)
        return x + self.moe(self.mlp_norm(x))



def active_parameters(model, s):
    """The weights one token multiplies: all but the embedding and the experts it skips."""
    one_expert = sum(p.numel() for p in model.blocks[0].moe.experts[0].parameters()) if s["layers"] else 0
    total = sum(p.numel() for p in model.parameters())
    return total - model.embedding.weight.numel() - s["layers"] * (s["experts"] - s["top_k"]) * one_expert


def main():
    # Eager (--compile 0) is the peer gpu-check.sh compares with.
    a = torch_peer.preset_arguments(__doc__, PRESETS, "qwen3-30b-a3b", SHAPE,
                                    (("batch", 2), ("seq", 2048), ("steps", 10), ("compile", 0)))
    *preset_shape, theta = PRESETS[a.preset]
    shape = {name: getattr(a, name) or value for name, value in zip(SHAPE, preset_shape)}
    torch_peer.setup(a.device)
    model = torch_peer.RotaryDecoder(shape["vocab"], shape["hidden"], shape["layers"], lambda: Block(shape),
                                     shape["head_dim"], theta, a.seq, False, 1e-6).to(a.device)
    params = sum(p.numel() for p in model.parameters())
    median, loss, peak = torch_peer.train_and_time(model, shape["vocab"], a.batch, a.seq, a.steps, a.compile, a.device,
                                                   warmup=3 if a.device.startswith("cuda") else 2)
    torch_peer.report(f"torch {torch.__version__} {a.preset} layers={shape['layers']} compile={a.compile}", params,
                      active_parameters(model, shape), shape["layers"], shape["heads"] * shape["head_dim"], a.batch,
                      a.seq, median, loss, peak)


if __name__ == "__main__":
    main()
