"""ModelSpec: the architecture facts of a DeepSeek model, read from a Hugging Face config.json.

Four attention kinds share one spec (`attention_kind`):

- `mla`: Multi-head Latent Attention (V2, V3, R1, V3.1): one 576-value latent per token per layer, every position read.
- `mla_sparse`: V3.2's DeepSeek Sparse Attention: MLA whose queries attend to the `index_topk` positions a lightning
  indexer picks; the indexer keeps its own per-token key cache (`index_head_dim` values per layer).
- `compressed_sparse`: V4's hybrid attention: per layer a compression ratio (`compress_ratios`): 0 keeps only a
  sliding window of `sliding_window` tokens; 4 (CSA) compresses every 4 tokens into one 512-value entry and attends
  to the indexer's top-k of them plus the window; 128 (HCA) compresses every 128 tokens and attends to all of them
  plus the window.
- `gqa`: ordinary multi-head or grouped-query attention.

Parameter counts follow the checkpoint's tensor shapes (as vLLM 0.32 builds the layers), so they can be checked
against the published totals: about 671B / 37B active for V3, 284B / 13B for V4-Flash, 1.6T / 49B for V4-Pro.
The KV cache each kind allocates is in models/kv_cache.py, the attention work per token in models/attention.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deepserve.errors import ModelError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "auto": 2}

_REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")

# Parameter components of parameter_breakdown(), in the order tables show them. The planner shards and quantizes
# each differently (plan/memory.py, plan/formats.py).
COMPONENTS = (
    "embedding",
    "attention_latent",  # down-projections replicated under TP: MLA's q_a and kv_a, V4's wq_a and wkv
    "attention_heads",  # per-head projections split under TP: q_b, kv_b, o (V4: wq_b, the grouped wo_a, wo_b)
    "indexer",  # the lightning indexer's query projection (V3.2, V4's CSA layers): quantized, replicated
    "compressor",  # 16-bit replicated projections: V4's KV compressors, the indexers' key and weight projections
    "hyper_connections",  # V4's manifold-constrained hyper-connection mixers: FP32, replicated
    "norms",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "router",
    "lm_head",
)

ATTENTION_KINDS = ("mla", "mla_sparse", "compressed_sparse", "gqa")


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint's weights are stored (None on ModelSpec means the plain torch_dtype)."""

    method: str  # "fp8", "awq", "gptq", ...
    bits: int
    group_size: int | None = None  # elements sharing one scale; None for block-wise FP8
    block_size: tuple[int, int] | None = None  # FP8 block-wise scales, e.g. (128, 128)
    scale_fmt: str | None = None  # "ue8m0": power-of-two block scales (V3.1 and later)
    moe_quant_algo: str | None = None  # "NVFP4": NVIDIA's re-quantized routed experts (vLLM reads this key)


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
    architecture: str = ""
    # MLA (None for ordinary multi-head / grouped-query attention and for V4)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    head_dim: int = 0
    # The lightning indexer of V3.2's sparse attention and V4's CSA layers (0: none)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # DeepSeek-V4: compressed attention per layer, grouped low-rank output projection, hyper-connections
    compress_ratios: tuple[int, ...] = ()  # one per main-model layer: 0 = sliding window only, 4 = CSA, 128 = HCA
    sliding_window: int = 0
    o_lora_rank: int = 0
    o_groups: int = 0
    hc_mult: int = 0
    num_hash_layers: int = 0  # the first MoE layers route by a token-id hash table instead of a learned gate
    expert_dtype: str | None = None  # V4: "fp4" (MXFP4 routed experts) or "fp8" (the Base checkpoints)
    # MoE (n_routed_experts 0 means a dense model)
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # Speculative-decoding modules shipped with the checkpoint: MTP layers, or DSpark's draft blocks
    num_mtp_layers: int = 0
    draft_method: str | None = None  # "mtp" or "dspark"; None when the checkpoint ships no draft module
    dspark_block_size: int = 0
    quantization: Quantization | None = None

    # ---- structure -------------------------------------------------------------------------------------------

    @property
    def attention_kind(self) -> str:
        """One of ATTENTION_KINDS (see the module docstring)."""
        if self.compress_ratios:
            return "compressed_sparse"
        if self.kv_lora_rank is not None:
            return "mla_sparse" if self.index_topk else "mla"
        return "gqa"

    @property
    def is_mla(self) -> bool:
        """MLA's latent cache (dense or sparse); V4's compressed cache is not an MLA latent."""
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

    def compress_ratio(self, index: int) -> int:
        """V4: layer INDEX's compression (0: window only; layers past the main model, MTP and DSpark, are 0)."""
        return self.compress_ratios[index] if index < len(self.compress_ratios) else 0

    def layers_with_ratio(self, ratio: int) -> int:
        return sum(1 for r in self.compress_ratios if r == ratio)

    def _layer_is_moe(self, index: int) -> bool:
        return index >= self.first_k_dense_replace and index % max(self.moe_layer_freq, 1) == 0

    # ---- parameters per component (counts of weights, not bytes) ---------------------------------------------

    @property
    def attention_params_per_layer(self) -> int:
        """Attention of a plain (non-compressed) layer: projections and their norms, indexer included."""
        latent, heads, norms = self._attention_split()
        indexer, compressor = self._indexer_params()
        return latent + heads + norms + indexer + compressor

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

    def _router_params(self, index: int) -> int:
        """V4's hash-routed layers keep the gate matrix but replace the correction bias by a token-id table
        (vocab x top-k expert ids) that picks the experts."""
        if index < self.num_hash_layers:
            return self.hidden_size * self.n_routed_experts + self.vocab_size * self.num_experts_per_tok
        return self.router_params

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the output head (one matrix if tied)."""
        copies = 1 if self.tie_word_embeddings else 2
        return copies * self.vocab_size * self.hidden_size

    def layer_params(self, index: int, active_only: bool = False) -> int:
        """Parameters of layer INDEX; ACTIVE_ONLY counts the top-k routed experts a token uses, not all."""
        parts = self.layer_parameter_breakdown(index)
        total = sum(parts.values())
        if active_only and parts["routed_experts"]:
            total -= parts["routed_experts"] - self.num_experts_per_tok * self.expert_params
        return total

    def _model_level_params(self) -> int:
        """Outside the layers: embedding, head, final norm and (V4) the hyper-connection head."""
        return self.embedding_params + self.hidden_size + self._hc_head_params()

    def _hc_head_params(self) -> int:
        """V4 collapses its hc_mult residual streams into one before the final norm: fn, base and scale."""
        if not self.hc_mult:
            return 0
        return self.hc_mult * self.hc_mult * self.hidden_size + self.hc_mult + 1

    def draft_layer_params(self) -> int:
        """One draft decoder layer as the engine loads it for speculative decoding: a MoE decoder layer (V4: a
        sliding-window one) plus MTP's input projections and norms (V3: eh_proj from 2*hidden; V4: e_proj and
        h_proj). The engine shares the main model's embedding and output head."""
        layer = sum(self.layer_parameter_breakdown(self.num_layers).values())
        return layer + 2 * self.hidden_size * self.hidden_size + 3 * self.hidden_size + self._hc_head_params()

    def draft_params_loaded(self) -> int:
        """The speculative-decoding modules' weights an engine loads with --speculative-config: every MTP layer
        (V3, V3.2, V4), or DSpark's draft layers (V4's 0731/0813 releases: vLLM builds 3 by default)."""
        if self.draft_method is None:
            return 0
        return self.num_mtp_layers * self.draft_layer_params()

    def mtp_params(self) -> int:
        """The checkpoint's speculative-decoding modules, as stored: per module a MoE decoder layer, two norms, a
        projection from 2*hidden to hidden, and (in DeepSeek's checkpoints) its own embedding and head copies."""
        if self.num_mtp_layers == 0:
            return 0
        per = self.draft_layer_params() + 2 * self.vocab_size * self.hidden_size
        return self.num_mtp_layers * per

    @property
    def total_params(self) -> int:
        """Main model only (the checkpoint's MTP module excluded), as DeepSeek's "671B" counts it."""
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return layers + self._model_level_params()

    @property
    def active_params(self) -> int:
        """Weights one token touches in the main model: routed top-k and shared experts, attention, embeddings."""
        layers = sum(self.layer_params(i, active_only=True) for i in range(self.num_layers))
        return layers + self._model_level_params()

    def layer_parameter_breakdown(self, index: int) -> dict[str, int]:
        """Parameters of layer INDEX by component; sums to layer_params(index). The planner shards and quantizes
        the components differently: MLA's latent down-projections (q_a, kv_a) are replicated under tensor
        parallelism while the per-head projections are split, and norms and the router stay unquantized.
        INDEX past the main model's layers is a draft (MTP / DSpark) layer: a MoE layer with window attention."""
        if self.compress_ratios:
            latent, heads, attention_norms, indexer, compressor = self._v4_attention_split(index)
        else:
            latent, heads, attention_norms = self._attention_split()
            indexer, compressor = self._indexer_params()
        parts = dict.fromkeys(COMPONENTS, 0)
        parts.update(
            attention_latent=latent,
            attention_heads=heads,
            indexer=indexer,
            compressor=compressor,
            hyper_connections=self._hc_layer_params(),
            norms=2 * self.hidden_size + attention_norms,
        )
        if self.is_moe and self._layer_is_moe(index):
            parts["shared_experts"] = self.n_shared_experts * self.expert_params
            parts["routed_experts"] = self.n_routed_experts * self.expert_params
            parts["router"] = self._router_params(index)
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
        totals["hyper_connections"] += self._hc_head_params()
        totals["embedding"] = self.vocab_size * self.hidden_size
        totals["lm_head"] = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return totals

    def _attention_split(self) -> tuple[int, int, int]:
        """(latent down-projections, per-head projections, attention-internal norms) of one MLA or GQA layer."""
        h, n = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            kv = 2 * self.num_kv_heads * self.head_dim * h
            return 0, n * self.head_dim * h + kv + n * self.head_dim * h, 0
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

    def _indexer_params(self) -> tuple[int, int]:
        """V3.2's lightning indexer, (quantized, 16-bit): its query projection wq_b from the q latent (FP8 in the
        checkpoint), and its key and weight projection wk_weights_proj plus the key LayerNorm (16-bit)."""
        if not self.index_topk or self.compress_ratios:
            return 0, 0
        q_lora = self.q_lora_rank or self.hidden_size
        query = q_lora * self.index_n_heads * self.index_head_dim
        keys = self.hidden_size * (self.index_head_dim + self.index_n_heads) + 2 * self.index_head_dim
        return query, keys

    def _v4_attention_split(self, index: int) -> tuple[int, int, int, int, int]:
        """V4 attention of layer INDEX as vLLM 0.32 builds it (vllm/models/deepseek_v4/attention.py):
        (latent, heads, norms, indexer, compressor).

        Replicated latent: the fused wq_a (hidden -> q_lora) and wkv (hidden -> head_dim, one shared K=V row).
        Split per head: wq_b (q_lora -> heads x head_dim), the grouped wo_a (heads x head_dim -> o_groups x o_lora,
        block-diagonal per group) and wo_b (o_groups x o_lora -> hidden). A compressed layer adds its compressor
        (16-bit: hidden -> 2 x coff x head_dim for KV and gate, coff = 2 on CSA layers whose windows overlap; plus
        a positional bias and a norm); a CSA layer adds the indexer (wq_b quantized; its weight projection and its
        own compressor 16-bit)."""
        h, n, d, q_lora = self.hidden_size, self.num_attention_heads, self.head_dim, self.q_lora_rank or 0
        latent = h * q_lora + h * d
        heads = q_lora * n * d + n * d * self.o_lora_rank + self.o_groups * self.o_lora_rank * h
        norms = q_lora + d + n  # q_norm, kv_norm, the per-head attention sink
        indexer = compressor = 0
        ratio = self.compress_ratio(index)
        if ratio > 1:
            coff = 2 if ratio == 4 else 1
            compressor += h * 2 * coff * d + ratio * coff * d + d
        if ratio == 4:
            ih, idim = self.index_n_heads, self.index_head_dim
            indexer += q_lora * ih * idim
            compressor += h * ih + h * 2 * 2 * idim + 4 * 2 * idim + idim
        return latent, heads, norms, indexer, compressor

    def _hc_layer_params(self) -> int:
        """V4's hyper-connections per layer: for attention and for the FFN, a mixer from hc_mult x hidden to
        (2 + hc_mult) x hc_mult coefficients, its bias and three scales (FP32)."""
        if not self.hc_mult:
            return 0
        mix = (2 + self.hc_mult) * self.hc_mult
        return 2 * (mix * self.hc_mult * self.hidden_size + mix + 3)

    @property
    def routed_expert_params_total(self) -> int:
        return self.num_moe_layers * self.n_routed_experts * self.expert_params

    # ---- KV cache ---------------------------------------------------------------------------------------------

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """MLA caches one latent vector plus the decoupled RoPE key; others cache K and V per KV head. V4 caches
        one 512-value entry per compressed group of tokens (models/kv_cache.py has its layout)."""
        if self.is_mla:
            return (self.kv_lora_rank or 0) + self.qk_rope_head_dim
        if self.compress_ratios:
            return self.head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_dtype: str = "bfloat16") -> int:
        """Cache bytes each token adds, all layers, as the engine allocates them (models/kv_cache.py): for MLA
        the latent (70,272 B in BF16 for V3); for V3.2 the latent plus the indexer's key; for V4 the compressed
        entries and the indexer's keys a token adds on average (the sliding window and the compressors' state
        are a fixed amount per request on top: `kv_cache_layout(...).fixed_bytes_per_sequence`)."""
        from deepserve.models.kv_cache import kv_cache_layout

        return round(kv_cache_layout(self, kv_dtype).bytes_per_token)

    def summary(self) -> dict[str, Any]:
        """Facts for `deepserve model show` and --json output."""
        from deepserve.models.kv_cache import kv_cache_layout

        facts = asdict(self)
        facts.update(
            attention_kind=self.attention_kind,
            total_params=self.total_params,
            active_params=self.active_params,
            mtp_params=self.mtp_params(),
            draft_params_loaded=self.draft_params_loaded(),
            num_moe_layers=self.num_moe_layers,
            num_dense_layers=self.num_dense_layers,
            kv_bytes_per_token_bf16=self.kv_bytes_per_token("bfloat16"),
            kv_bytes_per_token_fp8=self.kv_bytes_per_token("fp8"),
        )
        default = kv_cache_layout(self, "auto")
        facts["kv_cache"] = default.to_json()
        return facts

    # ---- loading ----------------------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str) -> ModelSpec:
        config = _text_config(config)
        _refuse_unmodelled(config, name)
        missing = [key for key in _REQUIRED if key not in config]
        if missing:
            raise ModelError(
                f"config.json of {name} lacks required field(s) {', '.join(missing)}; "
                "is it a Hugging Face causal-LM config?"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        ratios = tuple(int(r) for r in config.get("compress_ratios") or ())[:layers]
        draft_layers = int(config.get("num_nextn_predict_layers") or 0)
        return cls(
            name=name,
            model_type=str(config.get("model_type", "unknown")),
            num_layers=layers,
            hidden_size=hidden,
            vocab_size=int(config["vocab_size"]),
            num_attention_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            architecture=str((config.get("architectures") or [""])[0]),
            q_lora_rank=_optional_int(config.get("q_lora_rank")),
            kv_lora_rank=_optional_int(config.get("kv_lora_rank")),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
            v_head_dim=int(config.get("v_head_dim") or 0),
            head_dim=int(config.get("head_dim") or hidden // heads),
            index_n_heads=int(config.get("index_n_heads") or 0),
            index_head_dim=int(config.get("index_head_dim") or 0),
            index_topk=int(config.get("index_topk") or 0),
            compress_ratios=ratios,
            sliding_window=int(config.get("sliding_window") or 0) if ratios else 0,
            o_lora_rank=int(config.get("o_lora_rank") or 0),
            o_groups=int(config.get("o_groups") or 0),
            hc_mult=int(config.get("hc_mult") or 0),
            num_hash_layers=int(config.get("num_hash_layers") or 0),
            expert_dtype=_expert_dtype(config),
            n_routed_experts=int(config.get("n_routed_experts") or config.get("num_local_experts") or 0),
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(config.get("moe_layer_freq") or 1),
            num_mtp_layers=draft_layers,
            draft_method=("dspark" if config.get("dspark_block_size") else "mtp") if draft_layers else None,
            dspark_block_size=int(config.get("dspark_block_size") or 0),
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


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint (V4.1's) nests the language model's config under text_config; the outer config
    keeps architectures and the quantization config."""
    inner = config.get("text_config")
    if not isinstance(inner, dict) or "num_hidden_layers" in config:
        return config
    merged = {**inner}
    for key in ("architectures", "quantization_config", "torch_dtype"):
        if key in config and key not in merged:
            merged[key] = config[key]
    return merged


UNMODELLED = {
    "DeepseekV41ForCausalLM": (
        "DeepSeek-V4.1 shares compressed KV across layers (kv_source_layer_ids), compresses by 1 or 2 and adds "
        "Engram n-gram memory tables; deepserve's parameter and KV-cache model covers V3, V3.2 and V4 only"
    ),
}


def _refuse_unmodelled(config: dict[str, Any], name: str) -> None:
    """Fail fast on an architecture whose memory the planner would get wrong, rather than plan it as another."""
    architecture = str((config.get("architectures") or [""])[0])
    if architecture in UNMODELLED or str(config.get("model_type", "")).startswith("deepseek_v41"):
        reason = UNMODELLED["DeepseekV41ForCausalLM"]
        raise ModelError(f"{name}: {reason}; plan, simulate and serve's memory check do not cover it")


def _optional_int(value: Any) -> int | None:
    return None if value in (None, 0) else int(value)


def _expert_dtype(config: dict[str, Any]) -> str | None:
    """V4 names its routed experts' dtype at the top level (vLLM's DeepseekV4FP8Config); V4.1 inside the
    quantization config."""
    value = config.get("expert_dtype") or (config.get("quantization_config") or {}).get("expert_dtype")
    return str(value) if value else None


def _quantization(config: dict[str, Any] | None) -> Quantization | None:
    if not config:
        return None
    method = str(config.get("quant_method", "unknown")).lower()
    if method == "fp8":
        block = config.get("weight_block_size")
        algo = config.get("moe_quant_algo")
        return Quantization(
            method="fp8",
            bits=8,
            block_size=(int(block[0]), int(block[1])) if block else None,
            scale_fmt=str(config["scale_fmt"]) if config.get("scale_fmt") else None,
            moe_quant_algo=str(algo).upper() if algo else None,
        )
    bits = int(config.get("bits") or config.get("w_bit") or 4)
    group = config.get("group_size") or config.get("q_group_size")
    return Quantization(method=method, bits=bits, group_size=int(group) if group else None)
