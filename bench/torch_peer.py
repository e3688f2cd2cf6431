"""What the PyTorch peers share: the device set-up, the timed training loop and the line
they print. The GPU check (scripts/gpu-check.sh) reads that line's "N tokens/s"."""
import argparse
import inspect
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# PyTorch 2's fused attention (flash where the GPU has it), and whether it repeats the key
# and value heads itself; PyTorch 1.x (a CPU smoke test) takes the explicit product.
SDPA = getattr(F, "scaled_dot_product_attention", None)
SDPA_GQA = SDPA is not None and "enable_gqa" in inspect.signature(SDPA).parameters


def causal_attention(q, k, v):
    """Causal attention over [batch, heads, seq, head_dim] q and [batch, kv_heads, seq,
    head_dim] k and v, kv_heads dividing heads."""
    if SDPA_GQA:
        return SDPA(q, k, v, is_causal=True, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if SDPA is not None:
        return SDPA(q, k, v, is_causal=True)
    seq = q.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def preset_arguments(doc, presets, default, shape, run_defaults):
    """Parses --preset (of PRESETS, DEFAULT by default), an override of each SHAPE field,
    the run's integer flags at RUN_DEFAULTS ((name, value) pairs) and --device (cuda)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", default=default, choices=sorted(presets))
    for name in shape:
        parser.add_argument("--" + name.replace("_", "-"), type=int, help="overrides the preset's")
    for name, value in run_defaults:
        parser.add_argument("--" + name, type=int, default=value)
    parser.add_argument("--device", default="cuda")
    return parser.parse_args()


def setup(device):
    """Seeds torch and allows TF32 on CUDA; returns whether DEVICE is a CUDA device."""
    torch.manual_seed(0)
    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return cuda


def train_and_time(model, vocab, batch, seq, steps, compile_model, device, warmup=5):
    """Trains MODEL (called as model(inputs, targets) -> loss) on one fixed random batch:
    bf16 autocast and fused AdamW on CUDA, fp32 on the CPU, gradients clipped at 1.0.
    Returns (median step seconds, last loss, peak GiB or None)."""
    cuda = device.startswith("cuda")
    forward = torch.compile(model) if compile_model and hasattr(torch, "compile") else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if cuda else {}))
    inputs = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    wait = torch.cuda.synchronize if cuda else (lambda: None)

    def one_step():
        if cuda:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(inputs, targets)
        else:
            loss = forward(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):  # compilation and the allocator's first blocks
        one_step()
    wait()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        begin = time.perf_counter()
        loss = one_step()
        wait()
        seconds.append(time.perf_counter() - begin)
    median = sorted(seconds)[len(seconds) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return median, loss.item(), peak


def report(label, params, flop_params, layers, width, batch, seq, median, loss, peak):
    """Prints the one result line: tokens/s, and TFLOP/s counted as 6N + 12LTC per token
    (N = FLOP_PARAMS, the weights that multiply activations; C = WIDTH, the attention's)."""
    tokens = batch * seq / median
    flop_per_token = 6 * flop_params + 12 * layers * seq * width
    memory = f", peak mem {peak:.2f} GiB" if peak is not None else ""
    print(f"{label} B={batch} T={seq}: params {params / 1e6:.1f}M, median step {median * 1e3:.1f} ms, "
          f"{tokens:,.0f} tokens/s, {tokens * flop_per_token / 1e12:.1f} TFLOP/s{memory}, loss {loss:.3f}")


class RMSNorm(nn.Module):
    """x / rms(x) in fp32, times a weight, back in x's type (Llama's and Qwen's norm)."""

    def __init__(self, width, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        wide = x.float()
        normed = wide * torch.rsqrt(wide.square().mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rope(x, cos, sin):
    """Rotates each head's (first half, second half) pairs by the position's angles."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def rope_tables(head_dim, theta, seq):
    """The cos and sin of each position's angles, [seq, head_dim], in fp32."""
    frequencies = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), frequencies).repeat(1, 2)
    return angles.cos().float(), angles.sin().float()


class RotaryDecoder(nn.Module):
    """A decoder of LAYERS blocks made by make_block() (each called as block(x, cos, sin)),
    between an embedding and a final RMSNorm of EPS and the head (the embedding's weight
    when TIED); rotary tables of HEAD_DIM at THETA for SEQ positions; weights drawn from
    N(0, 0.02). Called as model(inputs, targets) -> the mean cross-entropy."""

    def __init__(self, vocab, hidden, layers, make_block, head_dim, theta, seq, tied, eps):
        super().__init__()
        self.vocab = vocab
        self.embedding = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(make_block() for _ in range(layers))
        self.final_norm = RMSNorm(hidden, eps)
        self.head = None if tied else nn.Linear(hidden, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        cos, sin = rope_tables(head_dim, theta, seq)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, inputs, targets):
        x = self.embedding(inputs)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        head = self.embedding.weight if self.head is None else self.head.weight
        logits = F.linear(self.final_norm(x), head)
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))
