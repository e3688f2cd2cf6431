#!/usr/bin/env python3
"""Writes a tiny GPT-2 in Hugging Face's safetensors layout from known values, and the
logits it gives for a few tokens, computed here in plain float64 Python (an independent
reference: no numpy, no torch).

Usage: hf_gpt2_reference.py OUT_DIR  ->  OUT_DIR/tiny-gpt2.safetensors, OUT_DIR/logits.json
The model: 2 layers, 2 heads, hidden 8, vocabulary 11, 6 positions, saved as
GPT2LMHeadModel saves it ("transformer." names, lm_head.weight tied to wte, the old
attention-mask buffers); Conv1D weights are (in, out).
"""
import json
import math
import struct
import sys

L, NH, C, V, T = 2, 2, 8, 11, 6
TOKENS = [3, 1, 4, 1, 5]


class Values:
    """A fixed sequence of floats in [-1, 1): a 64-bit LCG."""

    def __init__(self, seed):
        self.state = seed

    def next(self):
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return ((self.state >> 40) / float(1 << 24)) * 2.0 - 1.0


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def matrix(values, rows, cols, scale):
    return [[f32(scale * values.next()) for _ in range(cols)] for _ in range(rows)]


def vector(values, n, scale, offset=0.0):
    return [f32(offset + scale * values.next()) for _ in range(n)]


def build():
    v = Values(20261123)
    w = {"wte": matrix(v, V, C, 0.5), "wpe": matrix(v, T, C, 0.3)}
    for l in range(L):
        h = f"h.{l}."
        w[h + "ln_1.weight"] = vector(v, C, 0.2, 1.0)
        w[h + "ln_1.bias"] = vector(v, C, 0.1)
        w[h + "attn.c_attn.weight"] = matrix(v, C, 3 * C, 0.4)  # Conv1D: (in, out)
        w[h + "attn.c_attn.bias"] = vector(v, 3 * C, 0.1)
        w[h + "attn.c_proj.weight"] = matrix(v, C, C, 0.4)
        w[h + "attn.c_proj.bias"] = vector(v, C, 0.1)
        w[h + "ln_2.weight"] = vector(v, C, 0.2, 1.0)
        w[h + "ln_2.bias"] = vector(v, C, 0.1)
        w[h + "mlp.c_fc.weight"] = matrix(v, C, 4 * C, 0.4)
        w[h + "mlp.c_fc.bias"] = vector(v, 4 * C, 0.1)
        w[h + "mlp.c_proj.weight"] = matrix(v, 4 * C, C, 0.3)
        w[h + "mlp.c_proj.bias"] = vector(v, C, 0.1)
    w["ln_f.weight"] = vector(v, C, 0.2, 1.0)
    w["ln_f.bias"] = vector(v, C, 0.1)
    return w


def layer_norm(x, weight, bias):
    mean = sum(x) / len(x)
    var = sum((a - mean) ** 2 for a in x) / len(x)
    rstd = 1.0 / math.sqrt(var + 1e-5)
    return [(a - mean) * rstd * g + b for a, g, b in zip(x, weight, bias)]


def linear(x, weight, bias):  # x (in) @ weight (in, out) + bias
    out = [0.0] * len(weight[0])
    for i, a in enumerate(x):
        row = weight[i]
        for j in range(len(out)):
            out[j] += a * row[j]
    return [o + b for o, b in zip(out, bias)] if bias is not None else out


def gelu(x):
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def forward(w, tokens):
    xs = [[a + b for a, b in zip(w["wte"][tok], w["wpe"][t])] for t, tok in enumerate(tokens)]
    hd = C // NH
    for l in range(L):
        h = f"h.{l}."
        qkv = [linear(layer_norm(x, w[h + "ln_1.weight"], w[h + "ln_1.bias"]), w[h + "attn.c_attn.weight"],
                      w[h + "attn.c_attn.bias"]) for x in xs]
        ys = []
        for t in range(len(xs)):
            y = [0.0] * C
            for head in range(NH):
                q = qkv[t][head * hd:(head + 1) * hd]
                scores = []
                for s in range(t + 1):
                    k = qkv[s][C + head * hd:C + (head + 1) * hd]
                    scores.append(sum(a * b for a, b in zip(q, k)) / math.sqrt(hd))
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for s, p in enumerate(weights):
                    val = qkv[s][2 * C + head * hd:2 * C + (head + 1) * hd]
                    for d in range(hd):
                        y[head * hd + d] += p / total * val[d]
            ys.append(y)
        xs = [[a + b for a, b in zip(x, linear(y, w[h + "attn.c_proj.weight"], w[h + "attn.c_proj.bias"]))]
              for x, y in zip(xs, ys)]
        out = []
        for x in xs:
            m = [gelu(a) for a in linear(layer_norm(x, w[h + "ln_2.weight"], w[h + "ln_2.bias"]), w[h + "mlp.c_fc.weight"],
                                         w[h + "mlp.c_fc.bias"])]
            out.append([a + b for a, b in zip(x, linear(m, w[h + "mlp.c_proj.weight"], w[h + "mlp.c_proj.bias"]))])
        xs = out
    logits = []
    for x in xs:
        n = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
        logits.append([sum(a * b for a, b in zip(n, w["wte"][token])) for token in range(V)])
    return logits


def flatten(value):
    return [a for row in value for a in row] if isinstance(value[0], list) else list(value)


def shape(value):
    return [len(value), len(value[0])] if isinstance(value[0], list) else [len(value)]


def write_safetensors(path, tensors):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, value in tensors.items():
        raw = struct.pack("<%df" % len(flatten(value)), *flatten(value))
        header[name] = {"dtype": "F32", "shape": shape(value), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def main():
    out = sys.argv[1]
    w = build()
    hf_name = {"wte": "wte.weight", "wpe": "wpe.weight"}
    tensors = {"transformer." + hf_name.get(name, name): value for name, value in w.items()}
    tensors["lm_head.weight"] = w["wte"]
    for l in range(L):  # the causal-mask buffer old transformers versions saved
        tensors[f"transformer.h.{l}.attn.bias"] = [[1.0 if j <= i else 0.0 for j in range(T)] for i in range(T)]
    write_safetensors(out + "/tiny-gpt2.safetensors", tensors)
    with open(out + "/logits.json", "w") as f:
        json.dump({"tokens": TOKENS, "logits": forward(w, TOKENS)}, f)


if __name__ == "__main__":
    main()
