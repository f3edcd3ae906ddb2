"""Speculative decoding as the engines run it: which draft method, how many draft tokens per step, and the flags
each engine takes for it (vLLM's `--speculative-config` JSON, SGLang's `--speculative-*` flags).

Off unless asked for. Speculation buys one user's speed with work the engine does whether or not drafts are
accepted (a draft pass per token, and verification of K+1 tokens per sequence each step), so at high concurrency it
can cost throughput (vLLM's GB300 blog: it "hurts at high concurrency"), it takes memory (the MTP layer and its KV
cache), and on this CPU build it was slower than none even at 100% acceptance (shared/DESIGN.md, 2026-11-26). vLLM
and SGLang leave it off by default, and vLLM's DeepSeek-V3.2 recipe marks it opt-in. So `EngineConfig`'s default is
off; asking for it without details takes the vendors' recommended setting for the model:

- `--speculative-method auto`: the model's own draft module (MTP, or DSpark on DSpark checkpoints) with the vendor's
  recommended number of draft tokens;
- `--num-speculative-tokens K` alone: the model's own module with K draft tokens (0: off);
- `--speculative-method mtp|dspark|ngram|draft_model`: that method, with the recommended K where there is one;
- `--speculative-method none`: off (the default; also overrides a config file).

Sources of the names: vLLM 0.32's `SpeculativeConfig` (vllm/config/speculative.py: `method`, `num_speculative_tokens`,
`model`, `prompt_lookup_min`, `prompt_lookup_max`, `draft_sample_method`; tests validate our JSON with that class);
SGLang's server arguments (sgl-project/sglang python/sglang/srt/server_args.py, spec namespace at commit 001067f:
`--speculative-algorithm` with builtins EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, DFLASH, DSPARK,
`--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`,
`--speculative-draft-model-path`, `--speculative-dspark-block-size`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from deepserve.errors import ConfigError
from deepserve.models.spec import ModelSpec

SpeculativeMethod = Literal["none", "auto", "mtp", "dspark", "ngram", "draft_model"]
MODULE_METHODS = ("mtp", "dspark")  # draft layers shipped inside the checkpoint
# vLLM's CPU build: n-gram speculation caps the tokens scheduled per step at this many (a longer prompt waits
# forever; shared/DESIGN.md, 2026-11-26, on DeepSeek-V4)
CPU_NGRAM_MAX_PROMPT_TOKENS = 2048
V4_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")
# Checkpoints that ship a DSpark draft module instead of (0731) or beside (0813, -DSpark) the MTP head
DSPARK_ONLY_MARKERS = ("-0731",)
# vLLM's recipes run DSpark with probabilistic drafts (DeepSeek-V4-Flash.yaml, DeepSeek-V4-Pro.yaml)
DSPARK_DRAFT_SAMPLING = "probabilistic"  # "no MTP head (do not use method mtp)": vLLM recipe DeepSeek-V4-Flash.yaml


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding resolved to what an engine runs: the method and K draft tokens per step."""

    method: str  # mtp, dspark, ngram, draft_model
    num_tokens: int
    draft_model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_sample_method: str | None = None  # vLLM's, for DSpark as its recipes run it
    source: str = ""  # where a value the user did not give comes from

    def describe(self) -> str:
        text = f"{self.method}, {self.num_tokens} draft token(s) per step"
        if self.draft_model:
            text += f", draft model {self.draft_model}"
        if self.prompt_lookup_max is not None:
            text += f", n-gram window {self.prompt_lookup_min or self.prompt_lookup_max}-{self.prompt_lookup_max}"
        return text + (f" ({self.source})" if self.source else "")


@dataclass(frozen=True)
class Recommendation:
    method: str
    num_tokens: int
    source: str


def requested(method: str | None, num_tokens: int | None) -> bool:
    """Whether the config asks for speculative decoding at all (before looking at the model)."""
    if method == "none" or num_tokens == 0:
        return False
    return method is not None or num_tokens is not None


def model_module(spec: ModelSpec) -> str | None:
    """The draft module the checkpoint ships (its config: DSpark where it names a DSpark block size, else MTP where
    it has next-n layers)."""
    if spec.model_type == "deepseek_v41":
        return "dspark"  # vLLM rejects method "mtp" for V4.1: its mtp.* weights are DSpark stages
    return spec.draft_method


def recommendation(spec: ModelSpec, engine: str, hardware_class: str | None) -> Recommendation | None:
    """The vendor's recommended draft method and token count for SPEC on ENGINE (None where none is published)."""
    module = model_module(spec)
    if module is None:
        return None
    if engine == "sglang":
        if module != "mtp":
            return None  # SGLang publishes no DSpark recipe for DeepSeek
        return Recommendation(
            "mtp", 3, "SGLang's DeepSeek cookbook: EAGLE steps 3, topk 1, draft tokens 4 (low latency)"
        )
    if module == "dspark":
        return Recommendation("dspark", 7, "vLLM recipes DeepSeek-V4-Flash/Pro: dspark, 7 tokens, probabilistic drafts")
    if spec.model_type == "deepseek_v4":
        if "flash" in spec.name.lower() and hardware_class == "hopper":
            return Recommendation("mtp", 1, "vLLM recipe DeepSeek-V4-Flash: mtp, 1 token on Hopper")
        return Recommendation("mtp", 2, "vLLM recipes DeepSeek-V4-Flash/Pro: mtp, 2 tokens (Pro: PR #435)")
    if spec.model_type == "deepseek_v32":
        return Recommendation("mtp", 3, "vLLM recipe DeepSeek-V3.2: mtp, 3 tokens")
    return Recommendation(
        "mtp", 1, "vLLM's own default for MTP: one token per next-n layer (vllm/config/speculative.py)"
    )


def resolve_speculation(
    method: str | None,
    num_tokens: int | None,
    spec: ModelSpec | None,
    *,
    engine: str = "vllm",
    on_cpu: bool = False,
    hardware_class: str | None = None,
    draft_model: str | None = None,
    prompt_lookup_min: int | None = None,
    prompt_lookup_max: int | None = None,
    max_model_len: int | None = None,
) -> Speculation | None:
    """What the engine will run for these settings on SPEC (None: off), or a ConfigError saying why it cannot
    and what to do instead. SPEC None: a model whose config.json is not here (only explicit settings work)."""
    check_consistent(method, num_tokens)
    if not requested(method, num_tokens):
        _no_lookup_window(prompt_lookup_min, prompt_lookup_max, "ngram")
        return None
    advice = recommendation(spec, engine, "cpu" if on_cpu else hardware_class) if spec is not None else None
    chosen = _method(method, spec, advice)
    if spec is not None:
        _check_module(chosen, spec)
    tokens, source = _tokens(chosen, num_tokens, advice)
    speculation = Speculation(
        method=chosen,
        num_tokens=tokens,
        draft_model=draft_model,
        prompt_lookup_min=prompt_lookup_min,
        prompt_lookup_max=prompt_lookup_max,
        draft_sample_method=DSPARK_DRAFT_SAMPLING if chosen == "dspark" else None,
        source=source,
    )
    _check(speculation, spec, engine, on_cpu, max_model_len)
    return speculation


def check_consistent(method: str | None, num_tokens: int | None) -> None:
    """Settings that contradict each other whatever the model."""
    if method == "none" and num_tokens:
        raise ConfigError(
            f"--speculative-method none turns speculative decoding off, but --num-speculative-tokens {num_tokens} "
            "asks for it: drop one of them"
        )


def _method(method: str | None, spec: ModelSpec | None, advice: Recommendation | None) -> str:
    if method not in (None, "auto"):
        return method
    if spec is None:
        raise ConfigError(
            "the model's config.json is not on this machine, so its draft module is unknown: name the method with "
            "--speculative-method mtp (DeepSeek's multi-token prediction), dspark, ngram or draft_model"
        )
    module = model_module(spec)
    if module is None:
        raise ConfigError(
            f"{spec.name} ships no draft module (num_nextn_predict_layers is 0, as in AWQ exports): use "
            "--speculative-method ngram (drafts from the prompt) or draft_model with --speculative-draft-model PATH"
        )
    return advice.method if advice is not None else module


def _tokens(method: str, num_tokens: int | None, advice: Recommendation | None) -> tuple[int, str]:
    if num_tokens is not None:
        return num_tokens, ""
    if advice is not None and advice.method == method:
        return advice.num_tokens, advice.source
    raise ConfigError(
        f"no published recommendation for the number of draft tokens with --speculative-method {method} on this "
        "model: give --num-speculative-tokens K (e.g. 3)"
    )


def _check(
    speculation: Speculation, spec: ModelSpec | None, engine: str, on_cpu: bool, max_model_len: int | None
) -> None:
    method = speculation.method
    if method == "draft_model" and not speculation.draft_model:
        raise ConfigError("--speculative-method draft_model needs the draft's weights: --speculative-draft-model PATH")
    if method != "draft_model" and speculation.draft_model:
        raise ConfigError(
            f"--speculative-draft-model is the draft of --speculative-method draft_model, not of {method}: drop one"
        )
    if method != "ngram":
        _no_lookup_window(speculation.prompt_lookup_min, speculation.prompt_lookup_max, method)
    elif engine == "sglang" and (speculation.prompt_lookup_min or speculation.prompt_lookup_max):
        raise ConfigError(
            "SGLang's NGRAM drafts from a token trie and has no lookup window: drop --prompt-lookup-min/max"
        )
    _check_window(speculation.prompt_lookup_min, speculation.prompt_lookup_max)
    if on_cpu:
        _check_cpu(method, spec, max_model_len)


def _check_module(method: str, spec: ModelSpec) -> None:
    module = model_module(spec)
    name = spec.name.lower()
    if method == "mtp" and (spec.num_mtp_layers == 0 or any(marker in name for marker in DSPARK_ONLY_MARKERS)):
        hint = "use --speculative-method dspark" if module == "dspark" else "use --speculative-method ngram"
        raise ConfigError(
            f"{spec.name} ships no MTP module (num_nextn_predict_layers 0 or a DSpark-only release): {hint}"
        )
    if method == "mtp" and spec.model_type == "deepseek_v41":
        raise ConfigError(
            f"vLLM rejects method mtp for {spec.name}: its next-n layers are DSpark stages; "
            "use --speculative-method dspark"
        )
    if method == "dspark" and module != "dspark":
        raise ConfigError(
            f"{spec.name} ships no DSpark module (DeepSeek-V4-Flash-0731, V4-Pro-0813 and the -DSpark checkpoints do): "
            "use --speculative-method mtp"
        )


def _check_cpu(method: str, spec: ModelSpec | None, max_model_len: int | None) -> None:
    is_v4 = spec is not None and spec.model_type in V4_MODEL_TYPES
    if is_v4 and method in MODULE_METHODS:
        raise ConfigError(
            f"vLLM's CPU build does not implement DeepSeek-V4's {method.upper()} drafts (NotImplementedError in "
            "vllm/models/deepseek_v4/cpu/mtp.py): use --speculative-method ngram with --max-model-len "
            f"{CPU_NGRAM_MAX_PROMPT_TOKENS} or less, or serve on a GPU"
        )
    if is_v4 and method == "ngram" and (max_model_len is None or max_model_len > CPU_NGRAM_MAX_PROMPT_TOKENS):
        raise ConfigError(
            f"on vLLM's CPU build n-gram speculation on DeepSeek-V4 caps a step at {CPU_NGRAM_MAX_PROMPT_TOKENS} "
            f"tokens and a longer prompt waits forever: give --max-model-len {CPU_NGRAM_MAX_PROMPT_TOKENS} or less"
        )


def _no_lookup_window(minimum: int | None, maximum: int | None, method: str) -> None:
    if minimum is not None or maximum is not None:
        raise ConfigError(
            f"--prompt-lookup-min/--prompt-lookup-max set n-gram matching, which {method} does not use: give "
            "--speculative-method ngram or drop them"
        )


def _check_window(minimum: int | None, maximum: int | None) -> None:
    if minimum is not None and maximum is not None and minimum > maximum:
        raise ConfigError(f"--prompt-lookup-min {minimum} exceeds --prompt-lookup-max {maximum}")


# ---- the engines' flags -------------------------------------------------------------------------------------------


def vllm_speculative_config(speculation: Speculation) -> dict[str, object]:
    """vLLM's `--speculative-config` as a dict (fields of vllm/config/speculative.py's SpeculativeConfig)."""
    config: dict[str, object] = {"method": speculation.method, "num_speculative_tokens": speculation.num_tokens}
    if speculation.draft_model:
        config["model"] = speculation.draft_model
    if speculation.prompt_lookup_min is not None:
        config["prompt_lookup_min"] = speculation.prompt_lookup_min
    if speculation.prompt_lookup_max is not None:
        config["prompt_lookup_max"] = speculation.prompt_lookup_max
    if speculation.draft_sample_method is not None:
        config["draft_sample_method"] = speculation.draft_sample_method
    return config


def vllm_speculative_json(speculation: Speculation) -> str:
    return json.dumps(vllm_speculative_config(speculation), separators=(",", ":"))


# our method -> SGLang's --speculative-algorithm (DeepSeek's MTP runs as EAGLE with the checkpoint's next-n layer;
# NEXTN is SGLang's alias for it, EAGLE is what its DeepSeek cookbook writes)
SGLANG_ALGORITHMS = {"mtp": "EAGLE", "dspark": "DSPARK", "ngram": "NGRAM", "draft_model": "STANDALONE"}


def sglang_speculative_flags(speculation: Speculation) -> list[tuple[str, object]]:
    """SGLang's flags for SPECULATION: a chain of K drafts (topk 1), whose verify window is K+1 tokens."""
    method, k = speculation.method, speculation.num_tokens
    flags: list[tuple[str, object]] = [("--speculative-algorithm", SGLANG_ALGORITHMS[method])]
    if method == "dspark":
        return [*flags, ("--speculative-dspark-block-size", k)]
    if method == "ngram":
        return [*flags, ("--speculative-num-draft-tokens", k + 1)]
    flags += [("--speculative-draft-model-path", speculation.draft_model)] if speculation.draft_model else []
    return [
        *flags,
        ("--speculative-num-steps", k),
        ("--speculative-eagle-topk", 1),
        ("--speculative-num-draft-tokens", k + 1),
    ]
