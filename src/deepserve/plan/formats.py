"""Weight formats: bytes per parameter of each model component, scales and zero points included, and which GPUs
run each format natively.

A format quantizes the linear layers inside the decoder layers; embeddings, the output head, norms, the MoE router
and V4's compressors stay 16-bit and V4's hyper-connection mixers FP32 in every published DeepSeek checkpoint.
DeepSeek-V4's release mixes formats: FP8 attention and shared experts with MXFP4 routed experts; NVIDIA's NVFP4
repack keeps the FP8 part and re-quantizes the routed experts to NVFP4.

Scale overheads per weight:

| format | routed experts | other quantized layers |
|---|---|---|
| fp8 (V3) | 1 + 4/128^2: E4M3, an FP32 scale per 128x128 block | same |
| mxfp4 (V4) | 0.5 + 1/32: E2M1, an E8M0 scale per 32 (OCP MX) | 1 + 1/128^2: FP8, a UE8M0 scale per block |
| nvfp4 (V4 repack) | 0.5 + 1/16: E2M1, an E4M3 scale per 16 (+ an FP32 scale per tensor) | as mxfp4 |
| awq-int4 | 0.5 + 2.5/64: int4, an FP16 scale and a 4-bit zero per 64 inputs | same |
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.errors import ConfigError, unknown_name
from deepserve.hardware.catalog import Accelerator
from deepserve.models.presets import exports_of, preset_spec
from deepserve.models.spec import ModelSpec

# Components whose matrices a quantized format converts; the others keep 16-bit (hyper-connections FP32).
QUANTIZED_COMPONENTS = frozenset(
    {"attention_latent", "attention_heads", "indexer", "dense_mlp", "shared_experts", "routed_experts"}
)
FP32_COMPONENTS = frozenset({"hyper_connections"})
FP32_SCALE_BYTES = 4
E8M0_SCALE_BYTES = 1
FP8_SCALE_BYTES = 1
FP16_BYTES = 2
FP32_BYTES = 4
MX_BLOCK = 32  # OCP microscaling: one E8M0 scale per 32 elements
NVFP4_BLOCK = 16  # NVFP4: one E4M3 scale per 16 elements


@dataclass(frozen=True)
class WeightFormat:
    name: str
    description: str
    quantized_bytes_per_param: float  # weights of the quantized linear layers, scales and zeros included
    unquantized_bytes_per_param: float  # embeddings, lm_head, norms, router
    compute_dtype: str  # the Tensor Core dtype the matmuls run in (catalog key)
    vllm_quantization: str | None = None  # --quantization for an on-the-fly format, None when the checkpoint says
    routed_expert_bytes_per_param: float | None = None  # routed experts when they differ (V4's FP4 experts)
    expert_format: str | None = None  # "mxfp4" / "nvfp4": the routed experts' 4-bit format

    def bytes_per_param(self, component: str) -> float:
        if component == "routed_experts" and self.routed_expert_bytes_per_param is not None:
            return self.routed_expert_bytes_per_param
        if component in FP32_COMPONENTS:
            return FP32_BYTES
        if component in QUANTIZED_COMPONENTS:
            return self.quantized_bytes_per_param
        return self.unquantized_bytes_per_param


@dataclass(frozen=True)
class FormatSupport:
    """How a GPU runs a format's routed experts (the rest of each format runs natively wherever it is offered)."""

    kind: str  # "native", "weight-only" (dequantized in the GEMM, 16-bit activations), "unsupported"
    expert_compute_dtype: str  # the dtype the expert GEMMs compute in on this GPU (catalog key)
    kernel: str  # the engine's kernel, in words
    source: str


def _fp8_block(block: int, scale_bytes: int = FP32_SCALE_BYTES) -> float:
    """1 byte per weight plus one scale per block x block tile (DeepSeek's 128 x 128)."""
    return 1 + scale_bytes / (block * block)


def _int4_group(group: int) -> float:
    """AWQ int4: half a byte per weight, plus per group of GROUP input channels an FP16 scale and a 4-bit zero."""
    return 0.5 + (FP16_BYTES + 0.5) / group


MXFP4_BYTES = 0.5 + E8M0_SCALE_BYTES / MX_BLOCK
NVFP4_BYTES = 0.5 + FP8_SCALE_BYTES / NVFP4_BLOCK

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
        WeightFormat(
            "mxfp4",
            "MXFP4 routed experts (E2M1, E8M0 scale per 32) + FP8 E4M3 elsewhere with a UE8M0 scale per 128x128 "
            "block (DeepSeek-V4's release)",
            _fp8_block(128, E8M0_SCALE_BYTES),
            2.0,
            "fp8",
            routed_expert_bytes_per_param=MXFP4_BYTES,
            expert_format="mxfp4",
        ),
        WeightFormat(
            "nvfp4",
            "NVFP4 routed experts (E2M1, FP8 scale per 16 + FP32 per tensor) + FP8 E4M3 elsewhere with a UE8M0 "
            "scale per 128x128 block (NVIDIA's DeepSeek-V4 repacks)",
            _fp8_block(128, E8M0_SCALE_BYTES),
            2.0,
            "fp8",
            routed_expert_bytes_per_param=NVFP4_BYTES,
            expert_format="nvfp4",
        ),
    )
}

_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "awq": "awq-int4",
    "int4": "awq-int4",
    "fp8-block": "fp8",
    "fp4": "mxfp4",
    "mxfp4-experts": "mxfp4",
    "nvfp4-experts": "nvfp4",
    "nvfp4-moe": "nvfp4",
}

_VLLM_MXFP4 = "vLLM 0.32 vllm/model_executor/layers/fused_moe/oracle/mxfp4.py (select_deepseek_v4_mxfp4_moe_backend)"
_VLLM_NVFP4 = "vLLM 0.32 vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"


def format_support(fmt: WeightFormat, accelerator: Accelerator) -> FormatSupport:
    """How ACCELERATOR runs FMT's routed experts in vLLM 0.32. FP4 is native on Blackwell (SM100/SM103: FlashInfer's
    TRT-LLM MXFP4 x MXFP8 kernel or DeepGEMM's FP8 x FP4; SM120: FlashInfer/b12x for NVFP4, Marlin for MXFP4) and
    on CDNA4 (MI355X: AITER's MXFP4 kernels). Hopper and Ampere run MXFP4 and NVFP4 experts weight-only through
    Marlin (or Humming): 4-bit weights dequantized inside a 16-bit GEMM. CDNA3 (MI300X/MI325X) has no FP4 kernel
    for V4 in vLLM 0.32 (AITER's MXFP4 MoE is gfx950-only; the fallback is emulation)."""
    if fmt.expert_format is None:
        return FormatSupport("native", fmt.compute_dtype, "the format's own kernels", "")
    arch = accelerator.architecture
    native_fp4 = "fp4" in accelerator.dense_tflops
    if fmt.expert_format == "nvfp4" and accelerator.vendor == "amd":
        return FormatSupport("unsupported", "bf16", "no NVFP4 MoE kernel on ROCm", _VLLM_NVFP4)
    if native_fp4 and arch in ("sm100", "sm103"):
        if fmt.expert_format == "nvfp4":
            return FormatSupport("native", "fp4", "FlashInfer TRT-LLM NVFP4 MoE (W4A4)", _VLLM_NVFP4)
        return FormatSupport("native", "fp8", "FlashInfer TRT-LLM MXFP4 x MXFP8 or DeepGEMM FP8 x FP4", _VLLM_MXFP4)
    if native_fp4 and arch == "sm120":
        if fmt.expert_format == "nvfp4":
            return FormatSupport("native", "fp4", "FlashInfer CUTLASS / b12x NVFP4 MoE", _VLLM_NVFP4)
        return FormatSupport("weight-only", "bf16", "Marlin MXFP4 (W4A16); b12x on request", _VLLM_MXFP4)
    if native_fp4 and arch == "gfx950":
        return FormatSupport("native", "fp4", "AITER MXFP4 MoE (CK, gfx950)", _VLLM_MXFP4)
    if accelerator.vendor == "nvidia" and arch in ("sm80", "sm89", "sm90"):
        return FormatSupport(
            "weight-only", "bf16", "Marlin / Humming W4A16: weights dequantized in the GEMM", _VLLM_MXFP4
        )
    if accelerator.vendor == "amd":
        return FormatSupport("unsupported", "bf16", "AITER's MXFP4 MoE needs gfx950; gfx942 falls back to emulation",
                             _VLLM_MXFP4)  # fmt: skip
    return FormatSupport("unsupported", "bf16", f"no FP4 MoE kernel for {accelerator.name}", _VLLM_MXFP4)


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
        if spec.expert_dtype == "fp4":
            return FORMATS["nvfp4"] if quant.moe_quant_algo == "NVFP4" else FORMATS["mxfp4"]
        block = quant.block_size[0] if quant.block_size else None
        if block and block != 128:
            return WeightFormat(
                f"fp8-block{block}", f"FP8 E4M3, scale per {block}x{block} block", _fp8_block(block), 2.0, "fp8"
            )
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


def loads_as(stored: WeightFormat, asked: WeightFormat) -> bool:
    """Whether an engine loading a checkpoint stored as STORED runs ASKED: the same format, or FP8 quantized while
    loading a 16-bit checkpoint (vLLM's --quantization fp8)."""
    on_the_fly = asked.vllm_quantization is not None and stored.name in ("bf16", "fp16")
    return asked.name == stored.name or on_the_fly


def published_export(model: str, fmt: WeightFormat) -> str | None:
    """The preset that holds MODEL's weights re-quantized to FMT (e.g. DeepSeek-V3's AWQ export), or None."""
    return next((name for name in exports_of(model) if checkpoint_format(preset_spec(name)).name == fmt.name), None)
