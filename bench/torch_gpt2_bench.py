"""The PyTorch peer of meshtrain's GPT-2 benchmark (scripts/gpu-check.sh runs it).

    python3 torch_gpt2_bench.py --batch 16 --seq 1024 --compile 1

GPT-2 as OpenAI shaped it: pre-LayerNorm blocks, a tanh-GELU MLP four times the width,
learned positions and the head tied to the token embedding, with GPT-2's initialisation
(weights N(0, 0.02), biases zero). Attention goes through scaled_dot_product_attention
(flash on a GPU that has it). It trains in bf16 autocast with fused AdamW, optionally
through torch.compile, and prints one line: the median step, tokens/s, TFLOP/s by
6N + 12LTC and the peak memory. --device cpu runs a smoke test in fp32.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_peer


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 12), ("heads", 12), ("hidden", 768), ("vocab", 50257), ("batch", 16),
                          ("seq", 1024), ("steps", 30), ("compile", 1)):
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--device", default="cuda")
    return parser.parse_args()


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attention_out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp_in = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        split = [t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)
                 for t in self.qkv(self.attention_norm(x)).chunk(3, dim=-1)]
        attended = torch_peer.causal_attention(*split)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, layers, heads, width, vocab, seq):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, inputs, targets):
        seq = inputs.shape[1]
        x = self.tokens(inputs) + self.positions(torch.arange(seq, device=inputs.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.final_norm(x), self.tokens.weight)  # the tied head
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def main():
    a = arguments()
    torch_peer.setup(a.device)
    model = GPT2(a.layers, a.heads, a.hidden, a.vocab, a.seq).to(a.device)
    params = sum(p.numel() for p in model.parameters())  # the tied embedding counted once
    median, loss, peak = torch_peer.train_and_time(model, a.vocab, a.batch, a.seq, a.steps, a.compile, a.device)
    torch_peer.report(f"torch compile={a.compile} vocab={a.vocab}", params, params, a.layers, a.hidden, a.batch,
                      a.seq, median, loss, peak)


if __name__ == "__main__":
    main()
