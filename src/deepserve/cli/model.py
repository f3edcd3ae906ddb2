"""`deepserve model`: architecture facts of presets and local checkpoints; write a tiny checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from deepserve.cli.output import console
from deepserve.models.presets import preset_names, preset_spec
from deepserve.models.resolve import load_spec
from deepserve.models.spec import ModelSpec
from deepserve.models.tiny import TINY_ARCHES, tiny_model_for, write_tiny_model
from deepserve.models.tiny.markov import MTP_VARIANTS


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


def _show(args: argparse.Namespace) -> int:
    spec = load_spec(args.name)
    if args.json:
        print(json.dumps(spec.summary(), indent=2, default=str))
    else:
        console().print(spec_table(spec))
    return 0


def spec_table(spec: ModelSpec) -> Table:
    table = Table(title=spec.name, show_header=False)
    rows = [
        ("model type", spec.model_type),
        ("layers", f"{spec.num_layers} ({spec.num_dense_layers} dense, {spec.num_moe_layers} MoE)"),
        ("hidden size", str(spec.hidden_size)),
        ("attention", _attention_text(spec)),
        ("experts", _experts_text(spec)),
        ("vocabulary", f"{spec.vocab_size:,}"),
        ("total parameters", _billions(spec.total_params) + _mtp_text(spec)),
        ("active parameters / token", _billions(spec.active_params)),
        (
            "KV cache / token",
            f"{spec.kv_bytes_per_token('bfloat16'):,} B (bf16), {spec.kv_bytes_per_token('fp8'):,} B (fp8)",
        ),
        ("weights", _weights_text(spec)),
        ("max positions", f"{spec.max_position_embeddings:,}"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def _attention_text(spec: ModelSpec) -> str:
    if spec.is_mla:
        return (
            f"MLA, {spec.num_attention_heads} heads, q_lora_rank {spec.q_lora_rank}, kv_lora_rank {spec.kv_lora_rank}, "
            f"rope {spec.qk_rope_head_dim}, nope {spec.qk_nope_head_dim}, v {spec.v_head_dim}"
        )
    return f"{spec.num_attention_heads} heads, {spec.num_kv_heads} KV heads of {spec.head_dim}"


def _experts_text(spec: ModelSpec) -> str:
    if not spec.is_moe:
        return "none (dense)"
    return (
        f"{spec.n_routed_experts} routed (top-{spec.num_experts_per_tok}) + {spec.n_shared_experts} shared, "
        f"intermediate {spec.moe_intermediate_size}"
    )


def _weights_text(spec: ModelSpec) -> str:
    if spec.quantization is None:
        return spec.torch_dtype
    q = spec.quantization
    detail = f"group {q.group_size}" if q.group_size else f"blocks {q.block_size}" if q.block_size else ""
    return f"{q.method} {q.bits}-bit {detail}".strip()


def _mtp_text(spec: ModelSpec) -> str:
    mtp = spec.mtp_params()
    return f" (+{_billions(mtp)} MTP)" if mtp else ""


def _billions(count: int) -> str:
    return f"{count / 1e9:,.1f}B" if count >= 1e9 else f"{count / 1e6:,.2f}M"


def _list(args: argparse.Namespace) -> int:
    table = Table("preset", "layers", "experts", "total", "active", "KV B/token (bf16)")
    for name in preset_names():
        spec = preset_spec(name)
        experts = f"{spec.n_routed_experts} top-{spec.num_experts_per_tok}"
        table.add_row(
            name,
            str(spec.num_layers),
            experts,
            _billions(spec.total_params),
            _billions(spec.active_params),
            f"{spec.kv_bytes_per_token():,}",
        )
    console().print(table)
    return 0


def _tiny(args: argparse.Namespace) -> int:
    model = tiny_model_for(args.arch, args.mtp)
    out = write_tiny_model(args.out, model.name)
    print(f"wrote {model.name} ({args.arch}, MTP: {args.mtp}) to {out}; serve it with `deepserve serve --model {out}`")
    return 0
