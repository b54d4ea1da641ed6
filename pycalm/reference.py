"""The reference engine: one token's forward pass in NumPy float32, built from the kernels'
`_ref` functions. It is the CPU device of `pycalm.generate` and the yardstick of every GPU test.

Weights are decoded from the model file through pycalm.formats once, on first use, and kept as
float32 (dtype "fp32" for the _ref functions), so a token costs only the arithmetic.
The KV cache is rounded through the runtime's KV dtype (fp16 or fp8 e5m2) so that the CPU and
GPU engines see the same cached values.
"""

from __future__ import annotations

import numpy as np

from pycalm import formats
from pycalm.config import ModelConfig
from pycalm.errors import PycalmError
from pycalm.kernels.attention import attention_ref
from pycalm.kernels.embed import embed_ref
from pycalm.kernels.matvec import ffn_gate_ref, matvec_ref
from pycalm.kernels.moe import moe_route_ref
from pycalm.kernels.norm import rmsnorm_ref
from pycalm.kernels.qkv import qkv_ref

KV_DTYPES = ("fp16", "fp8", "fp32")


def kv_round(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """Round a float32 vector the way the KV cache stores it."""
    if kv_dtype == "fp32":
        return x.astype(np.float32)
    return formats.decode(formats.encode(x, kv_dtype), kv_dtype)


class ReferenceEngine:
    """forward(token, pos) -> logits, with a float32 KV cache of up to `seq_len` positions."""

    def __init__(self, model: object, seq_len: int | None = None, kv_dtype: str = "fp16") -> None:
        # model: a pycalm.loader.ModelFile (anything with .config and .tensor(name))
        cfg: ModelConfig = model.config
        self.config = cfg
        self.model = model
        self.seq_len = min(seq_len or cfg.max_seq_len, cfg.max_seq_len)
        if kv_dtype not in KV_DTYPES:
            raise PycalmError(f"unsupported KV cache dtype {kv_dtype!r} (one of {', '.join(KV_DTYPES)})")
        self.kv_dtype = kv_dtype
        self.rope_freqs = model.tensor("rope_freqs").astype(np.float32)  # (rotary_dim // 2,)
        self.tok_embeddings = model.tensor("tok_embeddings")  # stored (vocab_size, dim), rows decoded per use
        self.norm = model.tensor("norm").astype(np.float32)  # (dim,)
        out = model.tensor("tok_embeddings" if cfg.tied_embeddings else "output")
        self.output = formats.decode(out, cfg.weight_dtype)  # (vocab_size, dim) float32
        self._decoded: dict[str, np.ndarray] = {}
        # KV cache: (n_layers, seq_len, kv_dim) float32, values rounded through kv_dtype
        self.key_cache = np.zeros((cfg.n_layers, self.seq_len, cfg.kv_dim), np.float32)
        self.value_cache = np.zeros((cfg.n_layers, self.seq_len, cfg.kv_dim), np.float32)

    def _w(self, name: str) -> np.ndarray:
        """A weight decoded to float32 (norms, biases and router are float32 already)."""
        w = self._decoded.get(name)
        if w is None:
            w = self.model.tensor(name)
            if w.dtype != np.float32:
                w = formats.decode(w, self.config.weight_dtype)
            self._decoded[name] = w
        return w

    def reset(self) -> None:
        self.key_cache[:] = 0
        self.value_cache[:] = 0

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Logits (vocab_size,) float32 for `token` at position `pos` (0-based)."""
        cfg, dt = self.config, "fp32"  # weights come decoded from _w
        if not 0 <= token < cfg.vocab_size:
            raise PycalmError(f"token id {token} outside the vocabulary (0..{cfg.vocab_size - 1})")
        if not 0 <= pos < self.seq_len:
            raise PycalmError(f"position {pos} is past the context length {self.seq_len}")

        x = embed_ref(self.tok_embeddings, token, cfg.weight_dtype)  # (dim,) residual stream
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            # attention block
            xb = rmsnorm_ref(x, self._w(p + "attn_norm"), cfg.norm_eps)
            bqkv = self._w(p + "bqkv") if cfg.qkv_bias else None
            wqkv = self._w(p + "wqkv")
            q, k, v = qkv_ref(
                wqkv, bqkv, xb, dt, pos, self.rope_freqs, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
            )
            self.key_cache[layer, pos] = kv_round(k, self.kv_dtype)
            self.value_cache[layer, pos] = kv_round(v, self.kv_dtype)
            att = attention_ref(
                q,
                self.key_cache[layer],
                self.value_cache[layer],
                pos + 1,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.sliding_window,
            )
            x = x + matvec_ref(self._w(p + "wo"), att, dt)
            # feed-forward block
            xb = rmsnorm_ref(x, self._w(p + "ffn_norm"), cfg.norm_eps)
            if cfg.n_experts:
                experts, weights = moe_route_ref(self._w(p + "moe_gate"), xb, cfg.n_experts_active)
                w1, w3, w2 = self._w(p + "w1"), self._w(p + "w3"), self._w(p + "w2")
                for e, g in zip(experts, weights, strict=True):
                    h = ffn_gate_ref(w1[e], w3[e], xb, dt)
                    x = x + g * matvec_ref(w2[e], h, dt)
            else:
                h = ffn_gate_ref(self._w(p + "w1"), self._w(p + "w3"), xb, dt)
                x = x + matvec_ref(self._w(p + "w2"), h, dt)
        x = rmsnorm_ref(x, self.norm, cfg.norm_eps)
        return matvec_ref(self.output, x, dt)
