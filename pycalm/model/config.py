"""The model's hyperparameters: one frozen dataclass, stored as JSON in the model file's metadata.

Every value the runtime needs is here, settled at conversion time; nothing is inferred from a
file or folder name at run time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pycalm.errors import PycalmError
from pycalm.model.formats import Q4_GROUPS

ARCHS = ("llama", "mistral", "qwen2", "mixtral")
WEIGHT_DTYPES = ("fp16", "fp8", "gf4", "q8", "q4")
METADATA_KEY = "pycalm.config"
KV_DTYPES = ("fp16", "fp8")  # KV cache formats: float16, or fp8 e5m2 bytes
KV_FP8_ABOVE = 4096  # contexts longer than this get an fp8 KV cache unless asked otherwise


def kv_dtype_for(kv: str, seq_len: int) -> str:
    """The KV cache format for `--kv` (auto, fp16 or fp8) and a context of seq_len positions:
    the one place that decides it, for every engine."""
    if kv == "auto":
        return "fp8" if seq_len > KV_FP8_ABOVE else "fp16"
    if kv not in KV_DTYPES:
        raise PycalmError(f"unsupported KV cache dtype {kv!r} (one of auto, {', '.join(KV_DTYPES)})")
    return kv


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of ARCHS; informational: the quirks are settled by the converter
    dim: int  # width of the residual stream
    hidden_dim: int  # FFN inner width (per expert for MoE)
    head_dim: int  # width of one attention head
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention: n_heads % n_kv_heads == 0)
    vocab_size: int
    max_seq_len: int  # context length the model was trained for
    rope_theta: float  # RoPE base; the per-pair frequencies are stored as the rope_freqs tensor
    rotary_dim: int  # leading dims of each head that are rotated (== head_dim for Llama family)
    norm_eps: float  # RMSNorm epsilon
    bos_id: int  # -1: the tokenizer adds no BOS
    eos_ids: tuple[int, ...]  # generation stops at any of these
    qkv_bias: bool = False  # Qwen2: q/k/v projections have a bias
    tied_embeddings: bool = False  # the classifier reuses tok_embeddings (no output tensor)
    n_experts: int = 0  # 0: dense FFN; Mixtral: 8
    n_experts_active: int = 0  # experts chosen per token (Mixtral: 2)
    sliding_window: int = 0  # 0: full attention; Mistral: attend to the last W positions
    weight_dtype: str = "fp16"  # one of WEIGHT_DTYPES: how matrices are stored
    # mixed precision: (matrix name, dtype) for the matrices not in weight_dtype; names are the
    # file's: tok_embeddings, output, layers.{l}.wqkv|wo|w1|w3|w2
    tensor_dtypes: tuple[tuple[str, str], ...] = ()
    # q4 group size (32 or 64 columns) of each q4 matrix not in q4_groups
    q4_group: int = 32
    q4_groups: tuple[tuple[str, int], ...] = ()  # (matrix name, group) overrides

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise PycalmError(f"unsupported architecture {self.arch!r} (pycalm supports {', '.join(ARCHS)})")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise PycalmError(f"unsupported weight dtype {self.weight_dtype!r} (one of {WEIGHT_DTYPES})")
        if self.n_heads % self.n_kv_heads:
            raise PycalmError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise PycalmError(f"rotary_dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")
        if self.n_experts and not 0 < self.n_experts_active <= self.n_experts:
            raise PycalmError(f"n_experts_active {self.n_experts_active} must be in 1..{self.n_experts}")
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        pairs = tuple((str(n), str(d)) for n, d in self.tensor_dtypes)
        object.__setattr__(self, "tensor_dtypes", pairs)
        object.__setattr__(self, "q4_groups", tuple((str(n), int(g)) for n, g in self.q4_groups))
        for name, dtype in pairs:
            if dtype not in WEIGHT_DTYPES:
                raise PycalmError(f"unsupported weight dtype {dtype!r} for {name} (one of {WEIGHT_DTYPES})")
        for group in (self.q4_group, *(g for _, g in self.q4_groups)):
            if group not in Q4_GROUPS:
                raise PycalmError(f"unsupported q4 group size {group} (one of {Q4_GROUPS})")

    def dtype_of(self, name: str) -> str:
        """The weight dtype of matrix `name` (its tensor_dtypes entry, else weight_dtype)."""
        return dict(self.tensor_dtypes).get(name, self.weight_dtype)

    def group_of(self, name: str) -> int:
        """The q4 group size of matrix `name` (its q4_groups entry, else q4_group)."""
        return dict(self.q4_groups).get(name, self.q4_group)

    # derived sizes
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PycalmError(f"model file config has unknown fields {unknown}: written by a newer pycalm?")
        data["eos_ids"] = tuple(data.get("eos_ids", ()))
        data["tensor_dtypes"] = tuple(tuple(p) for p in data.get("tensor_dtypes", ()))
        data["q4_groups"] = tuple(tuple(p) for p in data.get("q4_groups", ()))
        return cls(**data)
