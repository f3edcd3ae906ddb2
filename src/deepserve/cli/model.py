"""`deepserve model`: architecture facts of presets and local checkpoints; write a tiny checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from deepserve.cli.output import console
from deepserve.errors import ConfigError, ModelError
from deepserve.models.kv_cache import KVCacheLayout, kv_cache_layout
from deepserve.models.presets import Preset, preset_info, preset_names, preset_spec
from deepserve.models.resolve import load_spec
from deepserve.models.spec import ModelSpec
from deepserve.models.tiny import TINY_ARCHES, tiny_model_for, write_tiny_model
from deepserve.models.tiny.markov import MTP_VARIANTS
from deepserve.plan.formats import checkpoint_format


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="show model architecture facts; write a tiny checkpoint")
    commands = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    show = commands.add_parser("show", help="layers, experts, parameters and KV-cache bytes of a preset or path")
    show.add_argument("name", help="preset name (see `deepserve model list`) or a directory with config.json")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(handler=_show)

    listing = commands.add_parser("list", help="list the built-in presets")
    listing.set_defaults(handler=_list)

    tiny = commands.add_parser(
        "tiny",
        help="write a tiny DeepSeek checkpoint (real architecture, seeded weights) that vLLM's CPU build serves",
        description="Write a tiny checkpoint. The same models are presets, generated on first use: "
        "deepserve/tiny-deepseek-v3 (tiny), deepserve/tiny-deepseek-v4 (tiny-v4), "
        "deepserve/tiny-deepseek-v3-mtp (tiny-mtp), deepserve/tiny-deepseek-v3-mtp-partial (tiny-mtp-partial).",
    )
    tiny.add_argument("--out", type=Path, required=True, help="directory to write (created if missing)")
    tiny.add_argument("--arch", choices=TINY_ARCHES, default="deepseek-v3", help="architecture (default: %(default)s)")
    tiny.add_argument(
        "--mtp",
        choices=MTP_VARIANTS,
        default="none",
        help="deepseek-v3 only: add one MTP layer whose drafts are all accepted (full) or about two in three "
        "(partial) under greedy decoding; the main model then counts up byte by byte (default: %(default)s)",
    )
    tiny.set_defaults(handler=_tiny)


KV_CONTEXTS = (8_192, 131_072, 1_048_576)  # what `model show` prices the KV cache at


def _show(args: argparse.Namespace) -> int:
    spec = load_spec(args.name)
    if args.json:
        print(json.dumps(show_json(spec), indent=2, default=str))
    else:
        console().print(spec_table(spec))
    return 0


def show_json(spec: ModelSpec) -> dict[str, Any]:
    """`model show --json`: the spec's facts, its KV cache in each dtype at KV_CONTEXTS, the published figures."""
    facts = spec.summary()
    facts["kv_cache_by_dtype"] = {dtype: kv_cache_layout(spec, dtype).to_json() for dtype in _kv_dtypes(spec)}
    info = _published(spec)
    if info is not None:
        facts["published"] = {f.name: {"value": f.value, "source": f.source} for f in info.published}
    return facts


def spec_table(spec: ModelSpec) -> Table:
    table = Table(title=spec.name, show_header=False)
    rows = [
        ("model type", f"{spec.model_type} ({spec.architecture})" if spec.architecture else spec.model_type),
        ("layers", _layers_text(spec)),
        ("hidden size", str(spec.hidden_size)),
        ("attention", _attention_text(spec)),
        ("experts", _experts_text(spec)),
        ("vocabulary", f"{spec.vocab_size:,}"),
        ("total parameters", _billions(spec.total_params) + _published_text(spec, "total_params") + _mtp_text(spec)),
        ("active parameters / token", _billions(spec.active_params) + _published_text(spec, "active_params")),
        ("draft modules", _draft_text(spec)),
        ("weights", _weights_text(spec)),
        ("max positions", f"{spec.max_position_embeddings:,}"),
    ]
    for dtype in _kv_dtypes(spec):
        rows.extend(_kv_rows(spec, dtype))
    for key, value in rows:
        table.add_row(key, value)
    return table


def _kv_dtypes(spec: ModelSpec) -> tuple[str, ...]:
    """The cache dtypes worth showing: 16-bit and FP8 (V4 has one default, FP8; BF16 on request)."""
    return ("fp8", "bfloat16") if spec.attention_kind == "compressed_sparse" else ("bfloat16", "fp8")


def _kv_rows(spec: ModelSpec, dtype: str) -> list[tuple[str, str]]:
    cache = kv_cache_layout(spec, dtype)
    label = f"KV cache / token ({cache.kv_dtype})"
    at = ", ".join(_at(cache, n, spec.max_position_embeddings) for n in KV_CONTEXTS)
    if cache.is_linear:
        rows = [(label, f"{cache.bytes_per_token:,.0f} B, every token alike")]
        rows.append(("", f"per sequence at {at}"))
        return rows
    rows = [
        (
            label,
            f"{cache.bytes_per_token:,.0f} B of growth ({cache.content_bytes_per_token:,.0f} B of entries, the rest "
            f"page padding) + {cache.fixed_bytes_per_sequence / 1e6:,.1f} MB fixed per request",
        ),
        ("", f"per sequence at {at}"),
    ]
    rows.extend(("", line) for line in cache.growth())
    return rows


def _at(cache: KVCacheLayout, tokens: int, max_positions: int) -> str:
    if tokens > max_positions:
        return f"{_short(tokens)}: beyond the model's {max_positions:,} positions"
    total = cache.bytes_per_sequence(tokens)
    return f"{_short(tokens)}: {total / tokens:,.0f} B/token ({total / 1e9:,.2f} GB)"


def _short(tokens: int) -> str:
    return f"{tokens // 1_048_576}M" if tokens >= 1_048_576 else f"{tokens // 1024}K"


def _layers_text(spec: ModelSpec) -> str:
    text = f"{spec.num_layers} ({spec.num_dense_layers} dense, {spec.num_moe_layers} MoE"
    if spec.num_hash_layers:
        text += f", the first {spec.num_hash_layers} routed by token-id hash"
    text += ")"
    if spec.compress_ratios:
        kinds = [(0, "window only"), (4, "CSA, 1 entry per 4 tokens"), (128, "HCA, 1 entry per 128 tokens")]
        present = [f"{spec.layers_with_ratio(r)} {name}" for r, name in kinds if spec.layers_with_ratio(r)]
        text += "; " + ", ".join(present)
    return text


def _attention_text(spec: ModelSpec) -> str:
    kind = spec.attention_kind
    if kind == "compressed_sparse":
        return (
            f"compressed sparse (V4): {spec.num_attention_heads} heads of {spec.head_dim} sharing one K=V entry, "
            f"sliding window {spec.sliding_window}, q_lora_rank {spec.q_lora_rank}, output in {spec.o_groups} groups "
            f"of rank {spec.o_lora_rank}, hyper-connections x{spec.hc_mult}; lightning indexer "
            f"{spec.index_n_heads} heads x {spec.index_head_dim}, top-{spec.index_topk} on CSA layers"
        )
    if spec.is_mla:
        text = (
            f"MLA, {spec.num_attention_heads} heads, q_lora_rank {spec.q_lora_rank}, kv_lora_rank {spec.kv_lora_rank}, "
            f"rope {spec.qk_rope_head_dim}, nope {spec.qk_nope_head_dim}, v {spec.v_head_dim}"
        )
        if kind == "mla_sparse":
            text += (
                f"; DeepSeek Sparse Attention: lightning indexer {spec.index_n_heads} heads x {spec.index_head_dim} "
                f"picks the top {spec.index_topk} positions, with its own per-token key cache"
            )
        return text
    return f"{spec.num_attention_heads} heads, {spec.num_kv_heads} KV heads of {spec.head_dim}"


def _experts_text(spec: ModelSpec) -> str:
    if not spec.is_moe:
        return "none (dense)"
    text = (
        f"{spec.n_routed_experts} routed (top-{spec.num_experts_per_tok}) + {spec.n_shared_experts} shared, "
        f"intermediate {spec.moe_intermediate_size}"
    )
    return text + (f", {spec.expert_dtype.upper()} routed experts" if spec.expert_dtype else "")


def _weights_text(spec: ModelSpec) -> str:
    try:
        fmt = checkpoint_format(spec)
    except ConfigError:
        fmt = None
    if fmt is not None:
        return f"{fmt.name}: {fmt.description}"
    q = spec.quantization
    if q is None:
        return spec.torch_dtype
    detail = f"group {q.group_size}" if q.group_size else f"blocks {q.block_size}" if q.block_size else ""
    return f"{q.method} {q.bits}-bit {detail}".strip()


def _draft_text(spec: ModelSpec) -> str:
    if spec.draft_method is None:
        return "none"
    what = "MTP layer(s)"
    if spec.draft_method == "dspark":
        what = f"DSpark draft layers (block size {spec.dspark_block_size})"
    return (
        f"{spec.num_mtp_layers} {what}: {_billions(spec.draft_params_loaded())} loaded with --speculative-config "
        f'\'{{"method": "{spec.draft_method}"}}\''
    )


def _mtp_text(spec: ModelSpec) -> str:
    mtp = spec.mtp_params()
    return f" (+{_billions(mtp)} MTP)" if mtp else ""


def _published(spec: ModelSpec) -> Preset | None:
    try:
        return preset_info(spec.name)
    except ModelError:
        return None  # a local checkpoint directory


def _published_text(spec: ModelSpec, fact: str) -> str:
    info = _published(spec)
    published = info.fact(fact) if info is not None else None
    return f"; model card {_billions(int(published.value))}" if published is not None else ""


def _billions(count: int) -> str:
    return f"{count / 1e9:,.1f}B" if count >= 1e9 else f"{count / 1e6:,.2f}M"


def _list(args: argparse.Namespace) -> int:
    table = Table("preset", "attention", "layers", "experts", "total", "active", "KV B/token", "KV fixed/request")
    for name in preset_names():
        spec = preset_spec(name)
        cache = kv_cache_layout(spec, "fp8" if spec.attention_kind != "mla" else "bfloat16")
        experts = f"{spec.n_routed_experts} top-{spec.num_experts_per_tok}"
        fixed = f"{cache.fixed_bytes_per_sequence / 1e6:,.1f} MB" if cache.fixed_bytes_per_sequence else "-"
        table.add_row(
            name,
            spec.attention_kind,
            str(spec.num_layers),
            experts,
            _billions(spec.total_params),
            _billions(spec.active_params),
            f"{cache.bytes_per_token:,.0f} ({cache.kv_dtype})",
            fixed,
        )
    console().print(table)
    return 0


def _tiny(args: argparse.Namespace) -> int:
    model = tiny_model_for(args.arch, args.mtp)
    out = write_tiny_model(args.out, model.name)
    print(f"wrote {model.name} ({args.arch}, MTP: {args.mtp}) to {out}; serve it with `deepserve serve --model {out}`")
    return 0
