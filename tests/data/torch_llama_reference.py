#!/usr/bin/python3
"""An independent implementation of the Llama class (Llama, Mistral, Qwen2, Qwen3, and the
mixtures of experts Mixtral and Qwen3-MoE) in PyTorch, float64, for meshtrain's parity test
(tests/integration/torch_parity_test.cc). It follows transformers' modeling code: RMSNorm,
rotate-half RoPE with rope_scaling (linear, llama3), grouped-query attention by repeating k
and v (repeat_kv), SwiGLU, a tied or untied head, Qwen2's biases on q, k and v, Qwen3's
RMSNorm of each head of q and k before RoPE (q_norm, k_norm); and the sparse MLP of
MixtralSparseMoeBlock and Qwen3MoeSparseMoeBlock: router logits, a softmax over all experts,
the top k, their weights renormalised (Mixtral always, Qwen3-MoE where norm_topk_prob), the
weighted sum of the chosen experts' SwiGLU MLPs. Qwen3-MoE's dense blocks as
Qwen3MoeDecoderLayer decides them: block l is sparse iff l is not in mlp_only_layers,
num_experts > 0 and (l + 1) % decoder_sparse_step == 0; otherwise its MLP is Qwen3MoeMLP, a
dense SwiGLU MLP of intermediate_size units (mlp.gate_proj, up_proj, down_proj), and it
gives no router logits. The sparse MLP has two forms, which `train`
holds to each other before it trains: a dense one (every expert on every token, weighted by
the routing weights scattered over all experts, 0 where not chosen) and transformers'
dispatch (each expert on the tokens that chose it, added back with index_add_). Nothing here
comes from meshtrain but the file formats.

  init DIR --family llama|qwen2|qwen3|mixtral|qwen3_moe [--tied 0|1] [--dtype f32|bf16] [--shards N] [--seed S]
       [--aux COEF] [--layers L] [--sparse-step N] [--mlp-only-layers I,J,...]
      writes a small model as a Hugging Face directory: config.json, and model.safetensors
      or N shards with model.safetensors.index.json, random weights. --aux turns a
      mixture's load-balancing loss on (output_router_logits true, router_aux_loss_coef COEF),
      which training then adds as transformers 4.x does. --layers: num_hidden_layers (2).
      Qwen3-MoE only: --sparse-step and --mlp-only-layers write decoder_sparse_step and
      mlp_only_layers (1 and none: every block sparse); a dense block's weights are its
      dense MLP's, intermediate_size wide, with no router and no experts.
  train DIR BATCHES OUT [--exported EXPORT_DIR]
      trains the model in DIR on BATCHES (JSON: the hyperparameters, and per step its
      learning rate and micro-batches of inputs and targets) with AdamW (decay on every
      matrix, the embedding and the head), global-norm clipping and gradient accumulation,
      in float64; writes OUT (JSON): every step's loss and gradient norm, and, given the
      directory meshtrain exported, for each tensor and in all the distance of meshtrain's
      weights from ours over the distance training moved ours. For a mixture of experts,
      also "moe_forms": the largest difference between the dense and the dispatch forms'
      loss and gradients on the first micro-batch (training uses the dispatch form). For a
      Qwen3-MoE with dense blocks, also "sparse_blocks" (those it made sparse) and
      "aux_losses" (each step's load-balancing loss, the mean over its micro-batches
      before its coefficient; null where it is off).
"""
import argparse
import json
import math
import os
import struct

import torch

torch.set_default_dtype(torch.float64)


# ---------------------------------------------------------------- safetensors

DTYPES = {"F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2)}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, size = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        raw = bytearray(data[8 + n + begin:8 + n + end])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        out[name] = t.reshape(entry["shape"]).to(torch.float64)
    return out


def write_safetensors(path, tensors, dtype):
    torch_dtype, size = DTYPES[dtype]
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        blob = t.to(torch_dtype).contiguous().view(torch.int16 if size == 2 else torch.int32).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_directory(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(read_safetensors(os.path.join(directory, name)))
    return json.load(open(os.path.join(directory, "config.json"))), weights


# ---------------------------------------------------------------- the model

class Config:
    def __init__(self, c):
        self.layers = c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.hidden = c["hidden_size"]
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.vocab = c["vocab_size"]
        self.eps = c["rms_norm_eps"]
        self.theta = c.get("rope_theta", 10000.0)
        self.scaling = c.get("rope_scaling")
        self.tied = c.get("tie_word_embeddings", False)
        architecture = c["architectures"][0]
        self.bias = architecture == "Qwen2ForCausalLM"
        self.head_norms = architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        self.moe = architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
        self.moe_form = "dispatch"
        self.sparse_layers = set()  # the blocks with a sparse MLP; the others' MLP is dense (LlamaMLP)
        if architecture == "MixtralForCausalLM":
            self.experts, self.renormalize = c["num_local_experts"], True
            self.sparse, self.expert_names = "block_sparse_moe.", ("w1", "w3", "w2")
            self.sparse_layers = set(range(self.layers))
        elif architecture == "Qwen3MoeForCausalLM":
            self.experts, self.renormalize = c["num_experts"], c.get("norm_topk_prob", False)
            self.sparse, self.expert_names = "mlp.", ("gate_proj", "up_proj", "down_proj")
            # Qwen3MoeDecoderLayer.__init__: the others are Qwen3MoeMLP, intermediate_size wide
            step, dense = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
            assert isinstance(dense, list), ("mlp_only_layers", dense)
            self.sparse_layers = {l for l in range(self.layers)
                                  if l not in dense and self.experts > 0 and (l + 1) % step == 0}
        if self.moe:
            self.top_k = c["num_experts_per_tok"]
        # transformers adds router_aux_loss_coef x load_balancing_loss_func where output_router_logits
        self.aux_coef = c.get("router_aux_loss_coef", 0.001) if self.moe and c.get("output_router_logits") else None


def inverse_frequencies(cfg):
    """transformers' _compute_default_rope_parameters, then linear or llama3 scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = cfg.scaling
    if not s:
        return inv
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / s["factor"]
    assert kind == "llama3", kind
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def sparse_mlp(cfg, p, a, h):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock on h (B, T, C), in cfg.moe_form; and its router logits."""
    B, T, C = h.shape
    x = h.reshape(-1, C)
    m = a + cfg.sparse
    logits = x @ p[m + "gate.weight"].T
    probs = torch.softmax(logits, dim=1, dtype=torch.float64)
    weights, chosen = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    gate, up, down = cfg.expert_names

    def expert(e, rows):
        w = m + f"experts.{e}."
        return (torch.nn.functional.silu(rows @ p[w + gate + ".weight"].T) * (rows @ p[w + up + ".weight"].T)) @ \
            p[w + down + ".weight"].T

    if cfg.moe_form == "dense":
        dense = torch.zeros(x.shape[0], cfg.experts).scatter(1, chosen, weights)
        out = sum(dense[:, e:e + 1] * expert(e, x) for e in range(cfg.experts))
    else:
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(chosen, num_classes=cfg.experts).permute(2, 1, 0)  # (E, k, N)
        for e in range(cfg.experts):
            slot, token = torch.where(mask[e])
            if token.numel():
                out = out.index_add(0, token, expert(e, x[token]) * weights[token, slot, None])
    return out.reshape(B, T, C), logits


def load_balancing_loss(cfg, router_logits):
    """transformers 4.x's load_balancing_loss_func without an attention mask: one softmax of every
    layer's logits concatenated, the top k, and num_experts x sum(tokens_per_expert x router_prob_per_expert).
    Only the sparse blocks give logits (Qwen3MoeModel keeps a layer's router logits where it has some)."""
    routing = torch.softmax(torch.cat(router_logits, dim=0), dim=-1)
    _, selected = torch.topk(routing, cfg.top_k, dim=-1)
    mask = torch.nn.functional.one_hot(selected, cfg.experts).to(routing.dtype)  # (N, k, E)
    tokens_per_expert = mask.mean(dim=0)  # (k, E)
    router_prob_per_expert = routing.mean(dim=0)  # (E,)
    return (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() * cfg.experts


def forward(cfg, p, idx, tgt, aux_out=None):
    """The loss; and where aux_out is a list, the load-balancing loss (before its coefficient) appended to it."""
    B, T = idx.shape
    x = p["model.embed_tokens.weight"][idx]
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inverse_frequencies(cfg)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rep = cfg.heads // cfg.kv_heads
    router_logits = []
    for l in range(cfg.layers):
        a = f"model.layers.{l}."
        h = rms_norm(x, p[a + "input_layernorm.weight"], cfg.eps)
        def project(name):
            y = h @ p[a + f"self_attn.{name}_proj.weight"].T
            return y + p[a + f"self_attn.{name}_proj.bias"] if cfg.bias else y
        q = project("q").view(B, T, cfg.heads, cfg.head_dim)
        k = project("k").view(B, T, cfg.kv_heads, cfg.head_dim)
        if cfg.head_norms:  # Qwen3Attention: q_norm and k_norm over each head, before RoPE
            q = rms_norm(q, p[a + "self_attn.q_norm.weight"], cfg.eps)
            k = rms_norm(k, p[a + "self_attn.k_norm.weight"], cfg.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = project("v").view(B, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # repeat_kv
        att = (q @ k.transpose(-2, -1)) / math.sqrt(cfg.head_dim)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, cfg.heads * cfg.head_dim)
        x = x + y @ p[a + "self_attn.o_proj.weight"].T
        h = rms_norm(x, p[a + "post_attention_layernorm.weight"], cfg.eps)
        if cfg.moe and l in cfg.sparse_layers:
            out, logits = sparse_mlp(cfg, p, a, h)
            x = x + out
            router_logits.append(logits)
            continue
        gate = h @ p[a + "mlp.gate_proj.weight"].T  # LlamaMLP, Qwen3MoeMLP of a dense block
        up = h @ p[a + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ p[a + "mlp.down_proj.weight"].T
    x = rms_norm(x, p["model.norm.weight"], cfg.eps)
    head = p["model.embed_tokens.weight"] if cfg.tied else p["lm_head.weight"]
    logits = x @ head.T
    loss = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab), tgt.view(-1))
    if cfg.aux_coef is not None:
        aux = load_balancing_loss(cfg, router_logits)
        if aux_out is not None:
            aux_out.append(aux.item())
        loss = loss + cfg.aux_coef * aux
    return loss


# ---------------------------------------------------------------- commands

def init(args):
    g = torch.Generator().manual_seed(args.seed)
    moe = args.family in ("mixtral", "qwen3_moe")
    qwen = args.family in ("qwen2", "qwen3", "qwen3_moe")
    qwen3 = args.family in ("qwen3", "qwen3_moe")
    L, NH, KVH, HD, C, I, V = args.layers, 4, 2, 12, 40, 76, 256
    E, K, MI = 4, 2, 28  # a mixture's experts, experts a token, and their width
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    config = {
        "architectures": [architecture[args.family]],
        "model_type": args.family, "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": KVH,
        "head_dim": HD, "hidden_size": C, "intermediate_size": I, "vocab_size": V, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6 if qwen else 1e-5, "rope_theta": 500.0, "hidden_act": "silu",
        "tie_word_embeddings": bool(args.tied), "torch_dtype": "float32",
        "rope_scaling": {"type": "linear", "factor": 2.0} if qwen else
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        "bos_token_id": 1, "eos_token_id": 2, "use_cache": True, "attention_dropout": 0.0,
    }
    if qwen:
        config.update({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": L})
    if qwen3:  # Qwen3-0.6B's keys: no biases, no scaling, every layer full attention
        config.update({"attention_bias": False, "rope_scaling": None, "layer_types": ["full_attention"] * L})
    else:
        config.update({"attention_bias": False, "mlp_bias": False})
    if args.family == "mixtral":  # Mixtral-8x7B's keys, at their values that change nothing
        for key in ("attention_bias", "mlp_bias", "rope_scaling"):
            del config[key]
        config.update({"num_local_experts": E, "num_experts_per_tok": K, "intermediate_size": MI,
                       "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False,
                       "router_aux_loss_coef": 0.02})
    if args.family != "qwen3_moe" and (args.sparse_step != 1 or args.mlp_only_layers):
        raise SystemExit("--sparse-step and --mlp-only-layers are Qwen3-MoE's")
    sparse = set(range(L)) if moe else set()  # the blocks with a sparse MLP, as Qwen3MoeDecoderLayer decides
    if args.family == "qwen3_moe":  # Qwen3-30B-A3B's keys; intermediate_size the dense blocks' width, if any
        del config["layer_types"]
        config.update({"num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": MI,
                       "norm_topk_prob": False, "decoder_sparse_step": args.sparse_step,
                       "mlp_only_layers": args.mlp_only_layers,
                       "sliding_window": None, "output_router_logits": False, "router_aux_loss_coef": 0.001})
        sparse = {l for l in range(L) if l not in args.mlp_only_layers and (l + 1) % args.sparse_step == 0}
    if moe and args.aux is not None:  # the load-balancing loss on, over either family's defaults above
        config.update({"output_router_logits": True, "router_aux_loss_coef": args.aux})

    def normal(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": normal(V, C, scale=0.5)}
    for l in range(L):
        a = f"model.layers.{l}."
        w[a + "input_layernorm.weight"] = 1 + normal(C, scale=0.1)
        for name, rows in (("q", NH * HD), ("k", KVH * HD), ("v", KVH * HD)):
            w[a + f"self_attn.{name}_proj.weight"] = normal(rows, C, scale=0.2)
            if qwen and not qwen3:
                w[a + f"self_attn.{name}_proj.bias"] = normal(rows, scale=0.1)
        if qwen3:
            w[a + "self_attn.q_norm.weight"] = 1 + normal(HD, scale=0.2)
            w[a + "self_attn.k_norm.weight"] = 1 + normal(HD, scale=0.2)
        w[a + "self_attn.o_proj.weight"] = normal(C, NH * HD, scale=0.15)
        w[a + "post_attention_layernorm.weight"] = 1 + normal(C, scale=0.1)
        if l in sparse:  # the router, then each expert's three matrices, as published checkpoints name them
            m = a + ("block_sparse_moe." if args.family == "mixtral" else "mlp.")
            gate, up, down = ("w1", "w3", "w2") if args.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            w[m + "gate.weight"] = normal(E, C, scale=0.5)
            for e in range(E):
                w[m + f"experts.{e}.{gate}.weight"] = normal(MI, C, scale=0.2)
                w[m + f"experts.{e}.{up}.weight"] = normal(MI, C, scale=0.2)
                w[m + f"experts.{e}.{down}.weight"] = normal(C, MI, scale=0.15)
            continue
        w[a + "mlp.gate_proj.weight"] = normal(I, C, scale=0.2)  # a dense MLP (a mixture's dense block too)
        w[a + "mlp.up_proj.weight"] = normal(I, C, scale=0.2)
        w[a + "mlp.down_proj.weight"] = normal(C, I, scale=0.15)
    w["model.norm.weight"] = 1 + normal(C, scale=0.1)
    if not args.tied:
        w["lm_head.weight"] = normal(V, C, scale=0.3)
    dtype = {"f32": "F32", "bf16": "BF16"}[args.dtype]
    config["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16"}[dtype]
    os.makedirs(args.dir, exist_ok=True)
    json.dump(config, open(os.path.join(args.dir, "config.json"), "w"), indent=2)
    names = list(w)
    if args.shards == 1:
        write_safetensors(os.path.join(args.dir, "model.safetensors"), w, dtype)
        return
    weight_map = {}
    per = math.ceil(len(names) / args.shards)
    for k in range(args.shards):
        part = names[k * per:(k + 1) * per]
        file = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
        write_safetensors(os.path.join(args.dir, file), {n: w[n] for n in part}, dtype)
        weight_map.update({n: file for n in part})
    json.dump({"metadata": {}, "weight_map": weight_map},
              open(os.path.join(args.dir, "model.safetensors.index.json"), "w"), indent=2)


def train(args):
    config, weights = read_directory(args.dir)
    cfg = Config(config)
    p = {n: t.clone().requires_grad_(True) for n, t in weights.items() if not (cfg.tied and n == "lm_head.weight")}
    initial = {n: t.detach().clone() for n, t in p.items()}
    spec = json.load(open(args.batches))
    decay = [t for n, t in p.items() if t.dim() == 2]
    no_decay = [t for n, t in p.items() if t.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1.0, betas=(spec["beta1"], spec["beta2"]), eps=spec["epsilon"])
    result = {}
    if cfg.moe:  # the dense and the dispatch forms agree, loss and gradients
        first = spec["steps"][0]["micro_batches"][0]
        grads = {}
        for form in ("dense", "dispatch"):
            cfg.moe_form = form
            loss = forward(cfg, p, torch.tensor(first["inputs"]), torch.tensor(first["targets"]))
            g = torch.autograd.grad(loss, list(p.values()))
            grads[form] = (loss.item(), g)
        difference = abs(grads["dense"][0] - grads["dispatch"][0])
        for a, b in zip(grads["dense"][1], grads["dispatch"][1]):
            difference = max(difference, (a - b).abs().max().item())
        result["moe_forms"] = difference
        cfg.moe_form = "dispatch"
    losses, norms, aux_losses = [], [], []
    for step in spec["steps"]:
        for group in opt.param_groups:
            group["lr"] = step["lr"]
        opt.zero_grad()
        micros = step["micro_batches"]
        total, auxes = 0.0, []
        for m in micros:
            loss = forward(cfg, p, torch.tensor(m["inputs"]), torch.tensor(m["targets"]), auxes) / len(micros)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(list(p.values()), spec["grad_clip"])
        opt.step()
        losses.append(total)
        norms.append(float(norm))
        aux_losses.append(sum(auxes) / len(auxes) if auxes else None)
    result.update({"losses": losses, "norms": norms})
    if cfg.moe and len(cfg.sparse_layers) < cfg.layers:  # dense blocks: which are sparse, and each step's
        result["sparse_blocks"] = sorted(cfg.sparse_layers)  # load-balancing loss over theirs (null if off)
        result["aux_losses"] = aux_losses
    if args.exported:
        exported_config, exported = read_directory(args.exported)
        for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                    "intermediate_size", "vocab_size", "tie_word_embeddings", "architectures"):
            assert exported_config.get(key) == config.get(key), (key, exported_config.get(key), config.get(key))
        if cfg.moe:  # which blocks are sparse, by the exported config.json as transformers reads it
            assert Config(exported_config).sparse_layers == cfg.sparse_layers, \
                (sorted(Config(exported_config).sparse_layers), sorted(cfg.sparse_layers))
        assert set(exported) == set(p), (sorted(set(exported) ^ set(p)))
        moved = off = 0.0
        per_tensor = {}
        for n, t in p.items():
            assert exported[n].shape == t.shape, (n, exported[n].shape, t.shape)
            d_moved = (t.detach() - initial[n]).pow(2).sum().item()
            d_off = (exported[n] - t.detach()).pow(2).sum().item()
            per_tensor[n] = math.sqrt(d_off / d_moved) if d_moved > 0 else 0.0
            moved += d_moved
            off += d_off
        result["distance_ratio"] = math.sqrt(off / moved)
        result["per_tensor"] = per_tensor
    json.dump(result, open(args.out, "w"), indent=1)


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init")
    i.add_argument("dir")
    i.add_argument("--family", choices=["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"], default="llama")
    i.add_argument("--tied", type=int, default=None)
    i.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    i.add_argument("--shards", type=int, default=1)
    i.add_argument("--seed", type=int, default=1)
    i.add_argument("--aux", type=float, default=None, help="output_router_logits true, with this router_aux_loss_coef")
    i.add_argument("--layers", type=int, default=2, help="num_hidden_layers")
    i.add_argument("--sparse-step", type=int, default=1, help="Qwen3-MoE's decoder_sparse_step")
    i.add_argument("--mlp-only-layers", type=lambda text: [int(l) for l in text.split(",") if l], default=[],
                   help="Qwen3-MoE's mlp_only_layers, as I,J,... (the blocks with a dense MLP)")
    t = sub.add_parser("train")
    t.add_argument("dir")
    t.add_argument("batches")
    t.add_argument("out")
    t.add_argument("--exported")
    args = parser.parse_args()
    if args.command == "init":
        if args.tied is None:
            args.tied = int(args.family == "qwen2")
        init(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
