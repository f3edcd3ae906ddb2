"""Speculative decoding options: resolution per model and device, vLLM's --speculative-config JSON (validated with
vLLM's own SpeculativeConfig), SGLang's flags."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.engines.registry import get_engine
from deepserve.engines.speculative import (
    Speculation,
    resolve_speculation,
    sglang_speculative_flags,
    vllm_speculative_config,
)
from deepserve.errors import ConfigError
from deepserve.models.presets import preset_spec
from deepserve.models.resolve import ResolvedModel
from deepserve.models.spec import ModelSpec
from deepserve.models.tiny import tiny_config

V3 = preset_spec("deepseek-ai/DeepSeek-V3")
AWQ = preset_spec("cognitivecomputations/DeepSeek-V3-AWQ")
# The V3.2 and V4 families share the fields these rules read (model_type, name, next-n layers) with V3's shape.
V32 = replace(V3, name="deepseek-ai/DeepSeek-V3.2", model_type="deepseek_v32")
V4_FLASH = replace(V3, name="deepseek-ai/DeepSeek-V4-Flash", model_type="deepseek_v4")
V4_PRO = replace(V3, name="deepseek-ai/DeepSeek-V4-Pro", model_type="deepseek_v4")
V4_FLASH_0731 = preset_spec("deepseek-ai/DeepSeek-V4-Flash-0731")
GPU_MODEL = ResolvedModel("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3", on_cpu=False)


def resolve(spec: ModelSpec | None, method: str | None = None, tokens: int | None = None, **kw: Any) -> Speculation:
    speculation = resolve_speculation(method, tokens, spec, **kw)
    assert speculation is not None
    return speculation


def argv(engine: str, **fields: object) -> list[str]:
    return get_engine(engine).launch_spec(EngineConfig(**fields), GPU_MODEL, None).argv


# ---- when it is on, and with what ----------------------------------------------------------------------------------


def test_off_unless_asked_and_zero_tokens_or_none_turn_it_off() -> None:
    assert resolve_speculation(None, None, V3) is None
    assert resolve_speculation("none", None, V3) is None
    assert resolve_speculation(None, 0, V3) is None
    assert resolve_speculation("auto", 0, V3) is None
    assert "--speculative-config" not in argv("vllm")


def test_tokens_alone_take_the_models_own_module() -> None:
    assert resolve(V3, tokens=2) == Speculation("mtp", 2)
    assert resolve(V4_FLASH_0731, tokens=5).method == "dspark"


@pytest.mark.parametrize(
    ("spec", "engine", "hardware", "method", "tokens"),
    [
        (V3, "vllm", "hopper", "mtp", 1),  # vLLM's own default: one token per next-n layer
        (V32, "vllm", "hopper", "mtp", 3),  # vLLM recipe DeepSeek-V3.2
        (V4_FLASH, "vllm", "hopper", "mtp", 1),  # the Flash recipe's Hopper override
        (V4_FLASH, "vllm", "blackwell", "mtp", 2),
        (V4_PRO, "vllm", "hopper", "mtp", 2),  # the Pro recipe dropped the override (PR #435)
        (V4_FLASH_0731, "vllm", "blackwell", "dspark", 7),
        (V3, "sglang", "hopper", "mtp", 3),  # SGLang's cookbook: EAGLE 3/1/4
    ],
)
def test_auto_is_the_vendors_recommendation(
    spec: ModelSpec, engine: str, hardware: str, method: str, tokens: int
) -> None:
    speculation = resolve(spec, "auto", engine=engine, hardware_class=hardware)
    assert (speculation.method, speculation.num_tokens) == (method, tokens)
    assert speculation.source  # says where the choice comes from
    assert resolve(spec, "auto", 4, engine=engine, hardware_class=hardware).num_tokens == 4  # given tokens win


def test_dspark_runs_with_probabilistic_drafts_as_the_recipes() -> None:
    assert vllm_speculative_config(resolve(V4_FLASH_0731, "auto")) == {
        "method": "dspark",
        "num_speculative_tokens": 7,
        "draft_sample_method": "probabilistic",
    }


@pytest.mark.parametrize(
    ("spec", "method", "tokens", "fields", "message"),
    [
        (AWQ, "mtp", None, {}, "ships no MTP module"),
        (AWQ, "auto", None, {}, "ships no draft module"),
        (AWQ, None, 2, {}, "ngram"),  # the fix names the alternative
        (V4_FLASH_0731, "mtp", 2, {}, "use --speculative-method dspark"),
        (V3, "dspark", 2, {}, "ships no DSpark module"),
        (V3, "ngram", None, {}, "--num-speculative-tokens K"),  # no published count for n-gram
        (V3, "mtp", 2, {"prompt_lookup_max": 4}, "n-gram matching"),
        (V3, "ngram", 3, {"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "exceeds"),
        (V3, "draft_model", 3, {}, "--speculative-draft-model PATH"),
        (V3, "mtp", 3, {"draft_model": "/m"}, "draft_model"),
        (None, "auto", None, {}, "config.json is not on this machine"),
        (V3, "ngram", 3, {"engine": "sglang", "prompt_lookup_max": 4}, "trie"),
    ],
)
def test_what_cannot_run_fails_with_the_fix(
    spec: ModelSpec | None, method: str | None, tokens: int | None, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_speculation(method, tokens, spec, **fields)


def test_cpu_build_refuses_v4_mtp_and_long_ngram_prompts() -> None:
    with pytest.raises(ConfigError, match=r"does not implement DeepSeek-V4's MTP.*ngram"):
        resolve_speculation("mtp", 1, V4_FLASH, on_cpu=True)
    with pytest.raises(ConfigError, match="--max-model-len 2048"):
        resolve_speculation("ngram", 3, V4_FLASH, on_cpu=True, max_model_len=4096)
    assert resolve(V4_FLASH, "ngram", 3, on_cpu=True, max_model_len=2048).method == "ngram"
    assert resolve(V3, "mtp", 2, on_cpu=True).method == "mtp"  # V3's MTP runs on the CPU build (DESIGN.md)


def test_none_with_tokens_is_refused_when_the_config_loads() -> None:
    with pytest.raises(ValueError, match="drop one of them"):
        EngineConfig(speculative_method="none", num_speculative_tokens=2)


def test_launchers_need_the_model_to_resolve_auto() -> None:
    with pytest.raises(ConfigError, match="not resolved"):
        argv("vllm", speculative_method="auto")
    resolved = EngineConfig(num_speculative_tokens=2).with_speculation(resolve(V3, tokens=2))
    assert (resolved.speculative_method, resolved.num_speculative_tokens) == ("mtp", 2)


# ---- the engines' flags ---------------------------------------------------------------------------------------------


def test_vllm_speculative_config_json() -> None:
    line = argv("vllm", speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    assert json.loads(line[line.index("--speculative-config") + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    line = argv("vllm", speculative_method="draft_model", num_speculative_tokens=4, speculative_draft_model="/d")
    assert json.loads(line[line.index("--speculative-config") + 1])["model"] == "/d"


@pytest.mark.parametrize(
    ("speculation", "flags"),
    [
        (
            Speculation("mtp", 3),
            [
                ("--speculative-algorithm", "EAGLE"),
                ("--speculative-num-steps", 3),
                ("--speculative-eagle-topk", 1),
                ("--speculative-num-draft-tokens", 4),
            ],
        ),
        (Speculation("ngram", 4), [("--speculative-algorithm", "NGRAM"), ("--speculative-num-draft-tokens", 5)]),
        (Speculation("dspark", 7), [("--speculative-algorithm", "DSPARK"), ("--speculative-dspark-block-size", 7)]),
        (
            Speculation("draft_model", 2, draft_model="/d"),
            [
                ("--speculative-algorithm", "STANDALONE"),
                ("--speculative-draft-model-path", "/d"),
                ("--speculative-num-steps", 2),
                ("--speculative-eagle-topk", 1),
                ("--speculative-num-draft-tokens", 3),
            ],
        ),
    ],
)
def test_sglang_flags(speculation: Speculation, flags: list[tuple[str, object]]) -> None:
    assert sglang_speculative_flags(speculation) == flags


def test_sglang_command_line_carries_the_flags() -> None:
    line = argv("sglang", speculative_method="mtp", num_speculative_tokens=2)
    assert line[line.index("--speculative-algorithm") :][:8] == [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
    ]


# ---- vLLM's own class accepts what we write ------------------------------------------------------------------------


def test_vllm_accepts_our_speculative_config(tmp_path: Path) -> None:
    """Our JSON through vLLM 0.32's SpeculativeConfig, with a target ModelConfig of a tiny V3 that has one MTP
    layer (config.json only: neither needs weights): every field name and value must be one vLLM takes."""
    speculative = pytest.importorskip("vllm.config.speculative", reason="vLLM is not installed here")
    from vllm.config import ModelConfig, ParallelConfig

    config = tiny_config() | {"num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    target = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True)
    for ours in (
        Speculation("mtp", 1),
        Speculation("mtp", 3),
        Speculation("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4),
        Speculation("ngram", 5),
    ):
        fields = vllm_speculative_config(ours)
        parsed = speculative.SpeculativeConfig(
            target_model_config=target, target_parallel_config=ParallelConfig(), **fields
        )
        assert (parsed.method, parsed.num_speculative_tokens) == (ours.method, ours.num_tokens)
        if ours.prompt_lookup_max is not None:
            assert (parsed.prompt_lookup_min, parsed.prompt_lookup_max) == (2, 4)
    with pytest.raises(Exception, match="Unexpected keyword argument"):  # the check is real: a misspelt field fails
        speculative.SpeculativeConfig(method="ngram", num_speculative_token=3)
