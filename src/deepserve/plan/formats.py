"""Weight formats: bytes per parameter of each model component, scales and zero points included.

A format quantizes the linear layers inside the decoder layers; embeddings, the output head, norms and the MoE
router stay in 16-bit in every published DeepSeek-V3 checkpoint (DeepSeek's FP8 release and the AWQ exports alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.errors import ConfigError, unknown_name
from deepserve.models.spec import ModelSpec

# Components whose matrices a quantized format converts; the others keep 16-bit.
QUANTIZED_COMPONENTS = frozenset(
    {"attention_latent", "attention_heads", "dense_mlp", "shared_experts", "routed_experts"}
)
FP32_SCALE_BYTES = 4
FP16_BYTES = 2


@dataclass(frozen=True)
class WeightFormat:
    name: str
    description: str
    quantized_bytes_per_param: float  # weights of the quantized linear layers, scales and zeros included
    unquantized_bytes_per_param: float  # embeddings, lm_head, norms, router
    compute_dtype: str  # the Tensor Core dtype the matmuls run in (catalog key)
    vllm_quantization: str | None = None  # --quantization for an on-the-fly format, None when the checkpoint says

    def bytes_per_param(self, component: str) -> float:
        if component in QUANTIZED_COMPONENTS:
            return self.quantized_bytes_per_param
        return self.unquantized_bytes_per_param


def _fp8_block(block: int) -> float:
    """1 byte per weight plus one FP32 scale per block x block tile (DeepSeek's 128 x 128)."""
    return 1 + FP32_SCALE_BYTES / (block * block)


def _int4_group(group: int) -> float:
    """AWQ int4: half a byte per weight, plus per group of GROUP input channels an FP16 scale and a 4-bit zero."""
    return 0.5 + (FP16_BYTES + 0.5) / group


FORMATS: dict[str, WeightFormat] = {
    fmt.name: fmt
    for fmt in (
        WeightFormat("bf16", "BF16 everywhere", 2.0, 2.0, "bf16"),
        WeightFormat("fp16", "FP16 everywhere", 2.0, 2.0, "fp16"),
        WeightFormat("fp8", "FP8 E4M3, FP32 scale per 128x128 block (DeepSeek's release)", _fp8_block(128), 2.0, "fp8"),
        WeightFormat(
            "fp8-dynamic",
            "FP8 quantized on the fly at load (vLLM --quantization fp8), per-tensor scales",
            1.0,
            2.0,
            "fp8",
            vllm_quantization="fp8",
        ),
        WeightFormat("awq-int4", "AWQ W4A16, group 64, FP16 scales + 4-bit zeros", _int4_group(64), 2.0, "fp16"),
    )
}

_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "awq": "awq-int4", "int4": "awq-int4", "fp8-block": "fp8"}


def get_format(name: str) -> WeightFormat:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ConfigError(unknown_name("weight format", name, list(FORMATS)))
    return FORMATS[key]


def checkpoint_format(spec: ModelSpec) -> WeightFormat:
    """The format the model's own checkpoint is stored in (what loads when --weights is not given)."""
    quant = spec.quantization
    if quant is None:
        return get_format(spec.torch_dtype if spec.torch_dtype in ("bfloat16", "float16") else "bf16")
    if quant.method == "fp8":
        block = quant.block_size[0] if quant.block_size else None
        return FORMATS["fp8"] if block == 128 else FORMATS["fp8-dynamic"]
    if quant.method in ("awq", "gptq") and quant.bits == 4:
        group = quant.group_size or 128
        fmt = FORMATS["awq-int4"]
        if group == 64:
            return fmt
        return WeightFormat(f"{quant.method}-int4-g{group}", f"int4 group {group}", _int4_group(group), 2.0, "fp16")
    raise ConfigError(
        f"{spec.name}: quantization {quant.method} {quant.bits}-bit is not modelled; pass --weights "
        f"({', '.join(FORMATS)})"
    )
