"""Tiny source models for tests: a Hugging Face folder and a GGUF file, random weights.

    tiny = make_hf_llama(tmp_path, arch="qwen2", dtype="bfloat16")   # tiny.path is the folder
    tiny = make_gguf(tmp_path, arch="llama")                          # tiny.path is the .gguf file
    out = pycalm.convert.main.convert(tiny.path, tmp_path / "m.safetensors", "fp16", progress=False)

`tiny.weights` maps each source tensor name to the float32 values the converter will read
(after bf16 rounding or GGUF quantization), so a test can compute what the converted tensors
must hold. The models are small enough (dim 32, 2 layers, vocab 64) for the CUDA simulator.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HF_ARCH_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


@dataclass
class TinyModel:
    path: Path  # HF folder or .gguf file
    weights: dict[str, np.ndarray]  # source name -> float32 values as the converter reads them
    config: dict[str, Any] = field(default_factory=dict)  # the HF config.json, or the GGUF hyperparameters


# ---------------------------------------------------------------------------------------------
# Hugging Face folder


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(
    path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None
):
    """A minimal safetensors writer that also does BF16 (given as uint16 bits), which
    safetensors.numpy cannot. tensors: name -> (safetensors dtype, array)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    blobs = []
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def hf_tokenizer_json(vocab_size: int, add_bos: bool) -> str:
    """A word-level tokenizers JSON with `vocab_size` entries; <s> is id 1 and prepended if add_bos."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    if add_bos:
        tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok.to_str()


def make_hf_llama(
    tmpdir: str | Path,
    arch: str = "llama",
    dtype: str = "float32",
    dim: int = 32,
    hidden_dim: int = 48,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 64,
    tie: bool = False,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    partial_rotary_factor: float | None = None,
    n_experts: int = 4,
    seed: int = 0,
    shards: int = 1,
    name: str | None = None,
    max_positions: int = 256,
) -> TinyModel:
    """An HF model folder of architecture `arch` with random weights (float32 or bfloat16)."""
    rng = np.random.default_rng(seed)
    folder = Path(tmpdir) / (name or f"hf_{arch}_{dtype}")
    folder.mkdir(parents=True, exist_ok=True)
    hd = head_dim or dim // n_heads
    cfg: dict[str, Any] = {
        "architectures": [HF_ARCH_NAMES[arch]],
        "model_type": arch,
        "hidden_size": dim,
        "intermediate_size": hidden_dim,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions,
        "rope_theta": rope_theta or (10000.0 if arch != "qwen2" else 1000000.0),
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2 if arch != "llama" else [2, 3],
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
    }
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if partial_rotary_factor is not None:
        cfg["partial_rotary_factor"] = partial_rotary_factor
    if arch == "mistral":
        cfg["sliding_window"] = 16
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = 32
    if arch == "mixtral":
        cfg["num_local_experts"] = n_experts
        cfg["num_experts_per_tok"] = 2
        cfg["sliding_window"] = None

    def w(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": w(vocab_size, dim),
        "model.norm.weight": 1 + w(dim),
    }
    if not tie:
        t["lm_head.weight"] = w(vocab_size, dim)
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = 1 + w(dim, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(dim, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = w(n_heads * hd, dim)
        t[p + "self_attn.k_proj.weight"] = w(n_kv_heads * hd, dim)
        t[p + "self_attn.v_proj.weight"] = w(n_kv_heads * hd, dim)
        t[p + "self_attn.o_proj.weight"] = w(dim, n_heads * hd)
        if arch == "qwen2":
            t[p + "self_attn.q_proj.bias"] = w(n_heads * hd)
            t[p + "self_attn.k_proj.bias"] = w(n_kv_heads * hd)
            t[p + "self_attn.v_proj.bias"] = w(n_kv_heads * hd)
        if arch == "mixtral":
            m = p + "block_sparse_moe."
            t[m + "gate.weight"] = w(n_experts, dim)
            for e in range(n_experts):
                t[f"{m}experts.{e}.w1.weight"] = w(hidden_dim, dim)
                t[f"{m}experts.{e}.w2.weight"] = w(dim, hidden_dim)
                t[f"{m}experts.{e}.w3.weight"] = w(hidden_dim, dim)
        else:
            t[p + "mlp.gate_proj.weight"] = w(hidden_dim, dim)
            t[p + "mlp.up_proj.weight"] = w(hidden_dim, dim)
            t[p + "mlp.down_proj.weight"] = w(dim, hidden_dim)

    weights: dict[str, np.ndarray] = {}
    stored: dict[str, tuple[str, np.ndarray]] = {}
    for name_, x in t.items():
        if dtype == "bfloat16":
            bits = bf16_round(x)
            stored[name_] = ("BF16", bits)
            weights[name_] = bf16_to_f32(bits)
        elif dtype == "float16":
            stored[name_] = ("F16", x.astype(np.float16))
            weights[name_] = x.astype(np.float16).astype(np.float32)
        else:
            stored[name_] = ("F32", x)
            weights[name_] = x
    names = list(stored)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", stored)
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            write_safetensors(folder / fname, {n: stored[n] for n in part})
            weight_map.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "tokenizer.json").write_text(hf_tokenizer_json(vocab_size, add_bos=arch != "qwen2"))
    tok_cfg: dict[str, Any] = {"chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}
    if arch == "qwen2":
        tok_cfg["bos_token"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return TinyModel(folder, weights, cfg)


# ---------------------------------------------------------------------------------------------
# GGUF file


def gguf_vocab() -> tuple[list[str], list[str], list[int]]:
    """64 byte-level BPE tokens (3 control tokens, letters, a few merges), merges, token types."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        chr(c) for c in range(ord("A"), ord("Z") + 1)
    ]
    tokens += ["\u0120", "0", "1", "2", "3", "4", "\u0120t", "th", "he"]
    merges = ["\u0120 t", "t h", "h e"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


def make_gguf(
    tmpdir: str | Path,
    arch: str = "llama",
    qtype: str = "Q8_0",
    dim: int = 64,
    hidden_dim: int = 96,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    vocab_size: int = 64,
    tie: bool = True,
    rope_freqs: bool = False,
    add_bos: bool = True,
    raw_types: dict[str, str] | None = None,
    seed: int = 0,
    name: str | None = None,
) -> TinyModel:
    """A GGUF file (llama or qwen2 layout; any arch name for error tests) with random weights.

    Matrices are quantized to `qtype` (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0: types gguf can write),
    the token embedding is F16, norms and biases F32. raw_types forces a tensor to another type
    with random block bytes (for unsupported-type tests). dim and hidden_dim must be multiples
    of 32 (the quant block). The vocabulary is gguf_vocab(), so vocab_size must be 64.
    """
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    path = Path(tmpdir) / (name or f"tiny_{arch}_{qtype}.gguf")
    path.parent.mkdir(parents=True, exist_ok=True)
    hd = dim // n_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(hidden_dim)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(10000.0 if arch != "qwen2" else 1000000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hd)
    tokens, merges, types = gguf_vocab()
    assert vocab_size == len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    weights: dict[str, np.ndarray] = {}
    raw_types = raw_types or {}

    def add(name_: str, x: np.ndarray, ttype: str) -> None:
        if name_ in raw_types:  # random bytes of another block type, for error tests
            qt = T[raw_types[name_]]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, (x.shape[0], x.shape[-1] // block * size), dtype=np.uint8)
            writer.add_tensor(name_, raw, raw_dtype=qt)
            return
        qt = T[ttype]
        if qt == T.F32:
            data = x.astype(np.float32)
            writer.add_tensor(name_, data)
        elif qt == T.F16:
            data = x.astype(np.float16)
            writer.add_tensor(name_, data)
        else:
            data = gguf.quants.quantize(x, qt)
            writer.add_tensor(name_, data, raw_dtype=qt)
        weights[name_] = np.asarray(gguf.quants.dequantize(data, qt), dtype=np.float32).reshape(x.shape)

    def w(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    add("token_embd.weight", w(vocab_size, dim), "F16")
    if rope_freqs:
        add("rope_freqs.weight", 1 + np.arange(hd // 2, dtype=np.float32) / 4, "F32")
    for layer in range(n_layers):
        b = f"blk.{layer}."
        add(b + "attn_norm.weight", 1 + w(dim, scale=0.1), "F32")
        add(b + "attn_q.weight", w(n_heads * hd, dim), qtype)
        add(b + "attn_k.weight", w(n_kv_heads * hd, dim), qtype)
        add(b + "attn_v.weight", w(n_kv_heads * hd, dim), qtype)
        if arch == "qwen2":
            add(b + "attn_q.bias", w(n_heads * hd), "F32")
            add(b + "attn_k.bias", w(n_kv_heads * hd), "F32")
            add(b + "attn_v.bias", w(n_kv_heads * hd), "F32")
        add(b + "attn_output.weight", w(dim, n_heads * hd), qtype)
        add(b + "ffn_norm.weight", 1 + w(dim, scale=0.1), "F32")
        add(b + "ffn_gate.weight", w(hidden_dim, dim), qtype)
        add(b + "ffn_up.weight", w(hidden_dim, dim), qtype)
        add(b + "ffn_down.weight", w(dim, hidden_dim), qtype)
    add("output_norm.weight", 1 + w(dim, scale=0.1), "F32")
    if not tie:
        add("output.weight", w(vocab_size, dim), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hp = {
        "dim": dim,
        "hidden_dim": hidden_dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
    }
    return TinyModel(path, weights, hp)


def attention_config(n_heads: int, n_kv_heads: int, head_dim: int, window: int = 0) -> Any:
    """A ModelConfig with these attention sizes and nothing else of note (the attention kernels'
    tests: they read no other field)."""
    from pycalm.model.config import ModelConfig

    return ModelConfig(
        arch="llama", dim=n_heads * head_dim, hidden_dim=8, head_dim=head_dim, n_layers=1, n_heads=n_heads,
        n_kv_heads=n_kv_heads, vocab_size=8, max_seq_len=4096, rope_theta=1e4, rotary_dim=head_dim,
        norm_eps=1e-5, bos_id=1, eos_ids=(), sliding_window=window,
    )  # fmt: skip
