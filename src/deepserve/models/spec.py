"""ModelSpec: the architecture facts of a DeepSeek-V3-class model, read from a Hugging Face config.json.

Parameter counts follow the checkpoint's tensor shapes, so they can be checked against the published totals
(about 671B for DeepSeek-V3's main model, about 37B active per token).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deepserve.errors import ModelError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 2}

_REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")

# Parameter components of parameter_breakdown(), in the order tables show them.
COMPONENTS = (
    "embedding",
    "attention_latent",
    "attention_heads",
    "norms",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "router",
    "lm_head",
)


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint's weights are stored (None on ModelSpec means the plain torch_dtype)."""

    method: str  # "fp8", "awq", "gptq", ...
    bits: int
    group_size: int | None = None  # elements sharing one scale; None for block-wise FP8
    block_size: tuple[int, int] | None = None  # FP8 block-wise scales, e.g. (128, 128)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only (MLA + MoE) model, as far as serving and planning need it."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    torch_dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    # MLA (None for ordinary multi-head / grouped-query attention)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    head_dim: int = 0
    # MoE (n_routed_experts 0 means a dense model)
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_mtp_layers: int = 0
    quantization: Quantization | None = None

    # ---- structure -------------------------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return sum(1 for i in range(self.num_layers) if self._layer_is_moe(i))

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def _layer_is_moe(self, index: int) -> bool:
        return index >= self.first_k_dense_replace and index % max(self.moe_layer_freq, 1) == 0

    # ---- parameters per component (counts of weights, not bytes) ---------------------------------------------

    @property
    def attention_params_per_layer(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            kv = 2 * self.num_kv_heads * self.head_dim * h
            return n * self.head_dim * h + kv + n * self.head_dim * h
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        kv_lora = self.kv_lora_rank or 0
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk_head
        else:
            q = h * n * qk_head
        kv_a = h * (kv_lora + self.qk_rope_head_dim) + kv_lora
        kv_b = kv_lora * n * (self.qk_nope_head_dim + self.v_head_dim)
        o = n * self.v_head_dim * h
        return q + kv_a + kv_b + o

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed (or shared) expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.n_routed_experts + self.n_routed_experts  # + correction bias

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the output head (one matrix if tied)."""
        copies = 1 if self.tie_word_embeddings else 2
        return copies * self.vocab_size * self.hidden_size

    def layer_params(self, index: int, active_only: bool = False) -> int:
        norms = 2 * self.hidden_size
        if not self._layer_is_moe(index) or not self.is_moe:
            return norms + self.attention_params_per_layer + self.dense_mlp_params
        experts = self.num_experts_per_tok if active_only else self.n_routed_experts
        ffn = (experts + self.n_shared_experts) * self.expert_params + self.router_params
        return norms + self.attention_params_per_layer + ffn

    def mtp_params(self) -> int:
        """One multi-token-prediction module per layer: a MoE decoder layer, two norms, a projection from
        2*hidden to hidden, and (in DeepSeek's checkpoints) its own embedding and head copies."""
        if self.num_mtp_layers == 0:
            return 0
        per = (
            self.layer_params(self.num_layers)
            + 3 * self.hidden_size
            + 2 * self.hidden_size * self.hidden_size
            + 2 * self.vocab_size * self.hidden_size
        )
        return self.num_mtp_layers * per

    @property
    def total_params(self) -> int:
        """Main model only (the checkpoint's MTP module excluded), as DeepSeek's "671B" counts it."""
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return layers + self.embedding_params + self.hidden_size

    @property
    def active_params(self) -> int:
        """Weights one token touches in the main model: routed top-k and shared experts, attention, embeddings."""
        layers = sum(self.layer_params(i, active_only=True) for i in range(self.num_layers))
        return layers + self.embedding_params + self.hidden_size

    def layer_parameter_breakdown(self, index: int) -> dict[str, int]:
        """Parameters of layer INDEX by component; sums to layer_params(index). The planner shards and quantizes
        the components differently: MLA's latent down-projections (q_a, kv_a) are replicated under tensor
        parallelism while the per-head projections are split, and norms and the router stay unquantized."""
        latent, heads, attention_norms = self._attention_split()
        parts = dict.fromkeys(COMPONENTS, 0)
        parts.update(attention_latent=latent, attention_heads=heads, norms=2 * self.hidden_size + attention_norms)
        if self.is_moe and self._layer_is_moe(index):
            parts["shared_experts"] = self.n_shared_experts * self.expert_params
            parts["routed_experts"] = self.n_routed_experts * self.expert_params
            parts["router"] = self.router_params
        else:
            parts["dense_mlp"] = self.dense_mlp_params
        return parts

    def parameter_breakdown(self) -> dict[str, int]:
        """Main-model parameters by component (MTP excluded); sums to total_params."""
        totals = dict.fromkeys(COMPONENTS, 0)
        for index in range(self.num_layers):
            for key, count in self.layer_parameter_breakdown(index).items():
                totals[key] += count
        totals["norms"] += self.hidden_size  # the final norm
        totals["embedding"] = self.vocab_size * self.hidden_size
        totals["lm_head"] = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return totals

    def _attention_split(self) -> tuple[int, int, int]:
        """(latent down-projections, per-head projections, attention-internal norms) of one layer."""
        h, n = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            return 0, self.attention_params_per_layer, 0
        kv_lora = self.kv_lora_rank or 0
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        latent = h * (kv_lora + self.qk_rope_head_dim)
        norms = kv_lora
        if self.q_lora_rank:
            latent += h * self.q_lora_rank
            norms += self.q_lora_rank
            heads = self.q_lora_rank * n * qk_head
        else:
            heads = h * n * qk_head
        heads += kv_lora * n * (self.qk_nope_head_dim + self.v_head_dim) + n * self.v_head_dim * h
        return latent, heads, norms

    @property
    def routed_expert_params_total(self) -> int:
        return self.num_moe_layers * self.n_routed_experts * self.expert_params

    # ---- KV cache ---------------------------------------------------------------------------------------------

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """MLA caches one latent vector plus the decoupled RoPE key; others cache K and V per KV head."""
        if self.is_mla:
            return (self.kv_lora_rank or 0) + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: str = "bfloat16") -> int:
        return self.num_layers * self.kv_values_per_token_per_layer * dtype_bytes(kv_dtype)

    def summary(self) -> dict[str, Any]:
        """Facts for `deepserve model show` and --json output."""
        facts = asdict(self)
        facts.update(
            total_params=self.total_params,
            active_params=self.active_params,
            mtp_params=self.mtp_params(),
            num_moe_layers=self.num_moe_layers,
            num_dense_layers=self.num_dense_layers,
            kv_bytes_per_token_bf16=self.kv_bytes_per_token("bfloat16"),
            kv_bytes_per_token_fp8=self.kv_bytes_per_token("fp8"),
        )
        return facts

    # ---- loading ----------------------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str) -> ModelSpec:
        missing = [key for key in _REQUIRED if key not in config]
        if missing:
            raise ModelError(
                f"config.json of {name} lacks required field(s) {', '.join(missing)}; "
                "is it a Hugging Face causal-LM config?"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            name=name,
            model_type=str(config.get("model_type", "unknown")),
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            vocab_size=int(config["vocab_size"]),
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            torch_dtype=str(config.get("torch_dtype") or "bfloat16"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            q_lora_rank=_optional_int(config.get("q_lora_rank")),
            kv_lora_rank=_optional_int(config.get("kv_lora_rank")),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
            v_head_dim=int(config.get("v_head_dim") or 0),
            head_dim=int(config.get("head_dim") or hidden // heads),
            n_routed_experts=int(config.get("n_routed_experts") or config.get("num_local_experts") or 0),
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(config.get("moe_layer_freq") or 1),
            num_mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
            quantization=_quantization(config.get("quantization_config")),
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelSpec:
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelError(f"{path} has no config.json; point at a Hugging Face model directory")
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{config_path} is not valid JSON: {exc}") from exc
        return cls.from_hf_config(config, name=str(path))


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ModelError(f"unknown dtype {dtype!r}; valid: {', '.join(sorted(DTYPE_BYTES))}") from None


def _optional_int(value: Any) -> int | None:
    return None if value in (None, 0) else int(value)


def _quantization(config: dict[str, Any] | None) -> Quantization | None:
    if not config:
        return None
    method = str(config.get("quant_method", "unknown")).lower()
    if method == "fp8":
        block = config.get("weight_block_size")
        return Quantization(method="fp8", bits=8, block_size=tuple(block) if block else None)
    bits = int(config.get("bits") or config.get("w_bit") or 4)
    group = config.get("group_size") or config.get("q_group_size")
    return Quantization(method=method, bits=bits, group_size=int(group) if group else None)
