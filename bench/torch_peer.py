"""What the PyTorch peers share: the device set-up, the timed training loop and the line
they print. The GPU check (scripts/gpu-check.sh) reads that line's "N tokens/s"."""
import inspect
import math
import time

import torch
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
