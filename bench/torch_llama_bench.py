"""The PyTorch peer of meshtrain's Llama-class benchmark (scripts/gpu-check.sh runs it).

    python3 torch_llama_bench.py --preset llama3.2-1b --batch 4 --seq 2048 --compile 1
    python3 torch_llama_bench.py --preset tiny --device cpu --compile 0      (a smoke test)

A Llama block: RMSNorm, rotary positions (the rotate-half form), SwiGLU, and grouped-query
attention through scaled_dot_product_attention (flash where the GPU has it; the key and
value heads repeated where this torch has no enable_gqa). Presets are the published
shapes; --layers, --hidden, --heads, --kv-heads, --ffn and --vocab override them. It trains
in bf16 autocast with fused AdamW on CUDA (fp32 on the CPU), optionally through
torch.compile, and prints one line: tokens/s, TFLOP/s by 6N + 12LTC (N leaves out an
untied embedding, whose lookup multiplies nothing) and the peak memory.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_peer

# name: (layers, hidden, heads, kv_heads, ffn, vocab, rope_theta, tied head)
PRESETS = {
    "tiny": (2, 64, 4, 2, 176, 259, 10000.0, False),
    "llama3.2-1b": (16, 2048, 32, 8, 8192, 128256, 500000.0, True),
    "llama3.2-3b": (28, 3072, 24, 8, 8192, 128256, 500000.0, True),
    "llama3.1-8b": (32, 4096, 32, 8, 14336, 128256, 500000.0, False),
    "qwen2.5-0.5b": (24, 896, 14, 2, 4864, 151936, 1000000.0, True),
}
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


class Block(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s["heads"], s["kv_heads"], s["hidden"] // s["heads"]
        width, kv_width, ffn = s["hidden"], s["kv_heads"] * self.head_dim, s["ffn"]
        self.attention_norm, self.mlp_norm = torch_peer.RMSNorm(width, 1e-5), torch_peer.RMSNorm(width, 1e-5)
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, kv_width, bias=False)
        self.wv = nn.Linear(width, kv_width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def attend(self, h, cos, sin):
        batch, seq, width = h.shape
        heads = lambda t, n: t.view(batch, seq, n, self.head_dim).transpose(1, 2)
        q = torch_peer.rope(heads(self.wq(h), self.heads), cos, sin)
        k = torch_peer.rope(heads(self.wk(h), self.kv_heads), cos, sin)
        v = heads(self.wv(h), self.kv_heads)
        out = torch_peer.causal_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, width))

    def forward(self, x, cos, sin):
        x = x + self.attend(self.attention_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))



def main():
    a = torch_peer.preset_arguments(__doc__, PRESETS, "llama3.2-1b", SHAPE,
                                    (("batch", 4), ("seq", 2048), ("steps", 20), ("compile", 1)))
    *preset_shape, theta, tied = PRESETS[a.preset]
    shape = {name: getattr(a, name) or value for name, value in zip(SHAPE, preset_shape)}
    torch_peer.setup(a.device)
    model = torch_peer.RotaryDecoder(shape["vocab"], shape["hidden"], shape["layers"], lambda: Block(shape),
                                     shape["hidden"] // shape["heads"], theta, a.seq, tied, 1e-5).to(a.device)
    params = sum(p.numel() for p in model.parameters())
    flop_params = params - (0 if tied else shape["vocab"] * shape["hidden"])
    median, loss, peak = torch_peer.train_and_time(model, shape["vocab"], a.batch, a.seq, a.steps, a.compile,
                                                   a.device, warmup=5 if a.device.startswith("cuda") else 3)
    torch_peer.report(f"torch {torch.__version__} {a.preset} compile={a.compile} gqa_sdpa={torch_peer.SDPA_GQA}", params,
                      flop_params, shape["layers"], shape["hidden"], a.batch, a.seq, median, loss, peak)


if __name__ == "__main__":
    main()
