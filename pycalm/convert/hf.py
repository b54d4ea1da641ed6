"""Hugging Face model folders -> a pycalm conversion plan.

A folder holds config.json (the hyperparameters), the weights in *.safetensors shards (F32, F16
or BF16, memory-mapped; model.safetensors.index.json names the shards), the tokenizer
(tokenizer.json or a sentencepiece tokenizer.model) and tokenizer_config.json (the chat
template), sometimes generation_config.json (the end-of-turn tokens of instruct models).
`from_hf` (called by pycalm.convert.main.convert) reads the hyperparameters into the model config,
the RoPE scaling into the frequencies (YaRN's attention factor into the q and k rows), and plans
each pycalm tensor from the checkpoint's tensors (HF_NAMES; q and k rows permuted from
rotate-half order, Mixtral's experts stacked).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pycalm.convert.common import Concat, Converted, Source, make_config, make_plan, rope_inv_freq
from pycalm.errors import PycalmError
from pycalm.model.loader import read_safetensors_header

HF_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}
# the HF tensor of each role of make_plan; {} stands for "model.layers.<layer>."
HF_NAMES = {
    "tok_embeddings": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "output": "lm_head.weight",
    "attn_norm": "{}input_layernorm.weight",
    "ffn_norm": "{}post_attention_layernorm.weight",
    "q": "{}self_attn.q_proj.weight",
    "k": "{}self_attn.k_proj.weight",
    "v": "{}self_attn.v_proj.weight",
    "q_bias": "{}self_attn.q_proj.bias",
    "k_bias": "{}self_attn.k_proj.bias",
    "v_bias": "{}self_attn.v_proj.bias",
    "wo": "{}self_attn.o_proj.weight",
    "moe_gate": "{}block_sparse_moe.gate.weight",
    "w1": "{}mlp.gate_proj.weight",
    "w2": "{}mlp.down_proj.weight",
    "w3": "{}mlp.up_proj.weight",
}


class ArraySource(Source):
    """A memory-mapped HF safetensors tensor in F32, F16 or BF16 (raw uint16 bits)."""

    def __init__(self, label: str, array: np.ndarray, kind: str) -> None:
        super().__init__(label, array.shape[0], int(np.prod(array.shape[1:], dtype=np.int64)))
        self.array = array.reshape(array.shape[0], -1)
        self.kind = kind

    def take(self, idx: np.ndarray) -> np.ndarray:
        rows = self.array[idx]
        if self.kind == "BF16":  # bf16 is the top half of a float32; numpy has no bf16 type
            return (rows.astype(np.uint32) << 16).view(np.float32)
        return rows.astype(np.float32)


def llama3_inv_freq(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Llama-3.1 RoPE scaling, as HF transformers' _compute_llama3_parameters computes it.

    Long wavelengths (beyond old_context / low_freq_factor) are slowed by `factor`, short ones
    (below old_context / high_freq_factor) kept, and those between blended smoothly.
    """
    try:
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        raise PycalmError(
            f"llama3 rope scaling needs factor and original_max_position_embeddings: {scaling}"
        ) from None
    inv = inv_freq.astype(np.float32)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_rope(
    theta: float, rotary_dim: int, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071) as HF transformers' _compute_yarn_parameters (modeling_rope_utils)
    computes it: (inverse frequencies (rotary_dim // 2,) float32, attention factor).

    Pair i of d = rotary_dim turns by theta^(-2i/d) a position, so r turns over the original
    context L (original_max_position_embeddings, else max_position_embeddings) at the pair
    c(r) = d ln(L / (2 pi r)) / (2 ln theta). Pairs up to lo = floor c(beta_fast) turn often
    over L and keep their frequency (extrapolated); pairs from hi = ceil c(beta_slow) on turn
    less than beta_slow times and are slowed by `factor` (interpolated, as linear scaling does);
    between them the weight of the interpolated frequency rises linearly,
    ramp(i) = clip((i - lo) / (hi - lo), 0, 1), with lo >= 0, hi <= d - 1, and lo, hi left
    unrounded when `truncate` is false. beta_fast and beta_slow default to 32 and 1.

    The attention factor multiplies RoPE's cos and sin, so both q and k (make_plan folds it into
    their rows): `attention_factor` if given; else m(mscale) / m(mscale_all_dim) when both are
    given (DeepSeek's form); else m(1), where m(k) = 0.1 k ln(factor) + 1 (1 when factor <= 1).
    The frequencies are float32, rounded at the steps where transformers rounds them.
    """

    def number(key: str, default: float | None) -> float | None:
        value = scaling.get(key)
        if value is None or (value == 0 and default is not None):  # transformers' `x or default`
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise PycalmError(f"yarn rope scaling: {key} must be a number, got {value!r}: {scaling}")
        return float(value)

    factor = number("factor", None)
    if factor is None or factor <= 0:
        raise PycalmError(f"yarn rope scaling needs a factor > 0: {scaling}")
    old_ctx = number("original_max_position_embeddings", float(max_position_embeddings))
    beta_fast = number("beta_fast", 32.0)
    beta_slow = number("beta_slow", 1.0)
    truncate = scaling.get("truncate", True)

    def m(k: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0

    attention_factor = number("attention_factor", None)
    if attention_factor is None:
        mscale, mscale_all_dim = number("mscale", None), number("mscale_all_dim", None)
        if mscale and mscale_all_dim:
            attention_factor = m(mscale) / m(mscale_all_dim)
        else:
            attention_factor = m(1.0)
    if attention_factor <= 0:
        raise PycalmError(f"yarn rope scaling: the attention factor must be > 0: {scaling}")

    def pair_of(turns: float) -> float:  # c(r): the (fractional) pair that turns r times over L
        return rotary_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_of(beta_fast), pair_of(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    if lo == hi:
        hi += 0.001  # a step instead of a ramp, without dividing by zero

    exps = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    periods = np.float32(theta) ** exps  # (d/2,) theta^(2i/d)
    extrapolated = np.float32(1.0) / periods
    interpolated = np.float32(1.0) / (np.float32(factor) * periods)
    pairs = np.arange(rotary_dim // 2, dtype=np.float32)
    ramp = np.clip((pairs - np.float32(lo)) / np.float32(hi - lo), 0, 1).astype(np.float32)
    keep = np.float32(1.0) - ramp  # the weight of the extrapolated frequency
    inv = interpolated * (np.float32(1.0) - keep) + extrapolated * keep
    return inv.astype(np.float32), float(attention_factor)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PycalmError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise PycalmError(f"{path}: expected a JSON object")
    return data


class HFCheckpoint:
    """The safetensors shards of an HF folder, indexed by tensor name (headers only)."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map", {})
            files = sorted({folder / f for f in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise PycalmError(
                f"{folder}: no *.safetensors weights (pycalm does not read .bin/.pth checkpoints)"
            )
        self.entries: dict[str, tuple[Path, Any]] = {}
        for f in files:
            if not f.is_file():
                raise PycalmError(f"{f}: listed in model.safetensors.index.json but missing")
            tensors, _ = read_safetensors_header(f)
            for name, entry in tensors.items():
                self.entries[name] = (f, entry)

    def has(self, name: str) -> bool:
        return name in self.entries

    def source(self, name: str) -> ArraySource:
        if name not in self.entries:
            raise PycalmError(f"checkpoint has no tensor {name!r}")
        path, e = self.entries[name]
        np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(e.dtype)
        if np_dtype is None:
            raise PycalmError(
                f"{path}: tensor {name!r} is {e.dtype}; pycalm converts F32, F16 and BF16 checkpoints"
            )
        shape = e.shape if len(e.shape) > 1 else (*e.shape, 1)
        array = np.memmap(path, dtype=np_dtype, mode="r", offset=e.begin, shape=shape)
        return ArraySource(name, array, e.dtype)


class HFRope(NamedTuple):
    """A config's RoPE, its scaling applied."""

    theta: float
    inv_freq: np.ndarray  # (rotary_dim // 2,) float32
    attention_factor: float  # multiplies cos and sin (YaRN), folded into the q and k rows
    max_seq_len: int  # the context the scaling reaches (YaRN: factor x the original context)


ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")


def _hf_rope(cfg: dict[str, Any], rotary_dim: int) -> HFRope:
    """The RoPE of an HF config, with its rope scaling applied."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    inv = rope_inv_freq(theta, rotary_dim)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return HFRope(theta, inv, 1.0, max_pos)
    if kind == "linear":
        return HFRope(theta, (inv / np.float32(params["factor"])).astype(np.float32), 1.0, max_pos)
    if kind == "llama3":
        return HFRope(theta, llama3_inv_freq(inv, params), 1.0, max_pos)
    if kind == "yarn":
        inv, attention_factor = yarn_rope(theta, rotary_dim, params, max_pos)
        # Qwen2.5 keeps max_position_embeddings at its original 32k and asks for factor 4 over
        # it: the context reaches factor x original (as vLLM derives it), not max_pos
        old_ctx = params.get("original_max_position_embeddings") or max_pos
        reach = int(float(params["factor"]) * float(old_ctx))
        return HFRope(theta, inv, attention_factor, max(max_pos, reach))
    raise PycalmError(f"unsupported rope scaling {kind!r} (pycalm supports {', '.join(ROPE_SCALINGS)})")


def _hf_tokenizer(folder: Path) -> tuple[str, bytes, int | None]:
    """(kind, blob, bos id the tokenizer itself prepends or None if it says nothing)."""
    tj = folder / "tokenizer.json"
    if tj.is_file():
        blob = tj.read_bytes()
        try:
            post = json.loads(blob).get("post_processor") or {}
        except ValueError:
            raise PycalmError(f"{tj}: not valid JSON") from None
        return "tokenizers-json", blob, _template_bos(post)
    sp = folder / "tokenizer.model"
    if sp.is_file():
        return "sentencepiece", sp.read_bytes(), None
    raise PycalmError(f"{folder}: no tokenizer.json or tokenizer.model")


def _template_bos(post: dict[str, Any]) -> int:
    """The BOS id a tokenizers post-processor prepends to a single sequence, or -1.

    Llama-3's TemplateProcessing starts with <|begin_of_text|>; Qwen2's and SmolLM2's
    ByteLevel post-processors add nothing. This is what HF's own tokenizer does, so it decides.
    """
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            if single and "SpecialToken" in single[0]:
                tok = single[0]["SpecialToken"]["id"]
                ids = (p.get("special_tokens", {}).get(tok) or {}).get("ids") or []
                if ids:
                    return int(ids[0])
        if p.get("type") == "BertProcessing" or p.get("type") == "RobertaProcessing":
            return int(p["cls"][1])
    return -1


def _hf_chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str) and template:
        return template
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return ""


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value)]


def from_hf(folder: Path, dtype: str) -> Converted:
    """Plan the conversion of an HF folder (config.json, *.safetensors, tokenizer files)."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise PycalmError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    cfg = _read_json(cfg_path)
    archs = cfg.get("architectures") or []
    arch_name = archs[0] if archs else cfg.get("model_type", "?")
    if arch_name not in HF_ARCHS:
        raise PycalmError(f"unsupported architecture {arch_name} (pycalm converts {', '.join(HF_ARCHS)})")
    arch = HF_ARCHS[arch_name]
    try:
        dim = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or dim // n_heads)
        n_layers = int(cfg["num_hidden_layers"])
        hidden_dim = int(cfg["intermediate_size"])
        vocab_size = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise PycalmError(f"{cfg_path}: missing or bad field {e}") from None
    rope_params = cfg.get("rope_parameters") or {}
    partial = float(cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    rope = _hf_rope(cfg, rotary_dim)
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        # transformers windows only layers >= max_window_layers; pycalm has one window for all
        raise PycalmError(f"{folder}: Qwen2 with use_sliding_window (per-layer windows) is not supported")

    kind, blob, template_bos = _hf_tokenizer(folder)
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    bos = cfg.get("bos_token_id")
    bos_id = -1 if bos is None else int(bos)
    if template_bos is not None:  # tokenizer.json: its post-processor says what it prepends
        bos_id = template_bos
    if tok_cfg.get("add_bos_token") is False or ("bos_token" in tok_cfg and tok_cfg["bos_token"] is None):
        bos_id = -1
    eos = _eos_list(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():  # instruct models list their end-of-turn tokens here (Llama-3: eot_id)
        eos += [e for e in _eos_list(_read_json(gen_path).get("eos_token_id")) if e not in eos]

    ckpt = HFCheckpoint(folder)
    config = make_config(
        cfg_path,
        arch=arch,
        dim=dim,
        hidden_dim=hidden_dim,
        head_dim=head_dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        max_seq_len=rope.max_seq_len,
        rope_theta=rope.theta,
        rotary_dim=rotary_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        bos_id=bos_id,
        eos_ids=tuple(eos),
        qkv_bias=arch == "qwen2",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)) or not ckpt.has("lm_head.weight"),
        n_experts=int(cfg.get("num_local_experts") or 0) if arch == "mixtral" else 0,
        n_experts_active=int(cfg.get("num_experts_per_tok") or 0),
        sliding_window=int(cfg.get("sliding_window") or 0) if arch in ("mistral", "mixtral") else 0,
        weight_dtype=dtype,
    )

    def tensor(role: str, layer: int) -> Source:
        """The checkpoint tensor of a role (make_plan), by its HF name; experts stacked."""
        hf = f"model.layers.{layer}."
        if role in ("w1", "w2", "w3") and config.n_experts:
            experts = range(config.n_experts)
            return Concat([ckpt.source(f"{hf}block_sparse_moe.experts.{e}.{role}.weight") for e in experts])
        return ckpt.source(HF_NAMES[role].format(hf))

    plan = make_plan(config, rope.inv_freq, tensor, permute_qk=True, rope_scale=rope.attention_factor)
    return Converted(config, plan, kind, blob, _hf_chat_template(folder, tok_cfg))
