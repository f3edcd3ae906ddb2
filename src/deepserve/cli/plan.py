"""`deepserve plan`: will it fit, how fast, for how many users, at what cost; `plan validate` and `plan fit`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deepserve.cli import plan_search, plan_validate
from deepserve.cli.flags import add_section_flags, section_overrides
from deepserve.config import load_section
from deepserve.plan.explain import budget_words, fitting_layout_text
from deepserve.plan.memory import DRAFT_COMPONENT
from deepserve.plan.planner import Plan, make_plan
from deepserve.plan.types import Deployment, PlanConfig
from deepserve.simulate.forecast import SimulatorForecaster

GB = 1e9


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="will a model fit on these GPUs, how fast, for how many users, at what cost",
        description=(
            "Per-GPU memory, fit, KV-cache capacity, throughput/TPOT/TTFT per concurrency, cost and engine command "
            "lines for a model on a GPU type. `plan validate` checks the model against published figures."
        ),
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML or JSON config file (section `plan`)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--concurrency", type=_levels, default=None, help="comma-separated concurrency levels (e.g. 1,8,64)"
    )
    add_section_flags(parser, PlanConfig, skip=("concurrency",))
    parser.set_defaults(handler=_plan)
    actions = parser.add_subparsers(dest="plan_command", metavar="ACTION", required=False)

    plan_validate.register(actions)
    plan_search.register(actions)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not levels:
        raise argparse.ArgumentTypeError("give at least one concurrency level")
    return levels


def _plan(args: argparse.Namespace) -> int:
    overrides = section_overrides(args, PlanConfig)
    if args.concurrency is not None:
        overrides["concurrency"] = args.concurrency
    config = load_section(PlanConfig, "plan", args.config, overrides)
    plan = make_plan(config, SimulatorForecaster() if config.num_prompts else None)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print_plan(Console(soft_wrap=True), plan)
    return 0


def _nodes_text(d: Deployment) -> str:
    """Nodes, and the machines where one node's NVLink domain spans several (an NVL72 rack's trays)."""
    if d.hosts > d.nodes:
        return f"{d.nodes} NVLink domain(s) over {d.hosts} machines"
    return f"{d.nodes} node(s)"


def print_plan(console: Console, plan: Plan) -> None:
    d, memory = plan.deployment, plan.deployment.memory
    console.print(
        f"[bold]{d.spec.name}[/] on {d.layout.gpus} x {d.accelerator.name} ({_nodes_text(d)}), "
        f"{d.layout.describe()}, weights {d.fmt.name} ({d.fmt.description}), KV cache {d.kv_dtype}",
        highlight=False,
    )
    console.print(_memory_table(plan))
    _print_speculation(console, plan)
    if plan.fits:
        console.print(
            f"[bold green]fits[/]: the KV cache holds {memory.kv_cache_tokens:,} tokens "
            f"({memory.kv_bytes_per_token:,} B/token for the model, {memory.kv_bytes_per_token_per_gpu:,} B on each "
            f"GPU: {memory.kv_placement}); {memory.max_concurrent_sequences:,} concurrent sequences of "
            f"{plan.config.input_len}+{plan.config.output_len} tokens; max_model_len {memory.max_model_len:,}",
            highlight=False,
        )
    else:
        console.print(f"[bold red]does not fit[/]: {_shortfall(plan)}", highlight=False)
        if plan.smallest_fitting_gpus:
            console.print(
                f"it fits on {plan.smallest_fitting_gpus} x {d.accelerator.name} "
                f"({fitting_layout_text(plan.smallest_fitting_gpus, d.accelerator.devices_per_node)})",
                highlight=False,
            )
        _print_explanations(console, plan)
        return
    console.print(_predictions_table(plan))
    if plan.forecasts:
        console.print(_forecasts_table(plan))
    if plan.config.slo_itl_ms is not None:
        within = plan.max_concurrency_within_slo
        text = "none: even one request misses it" if within is None else f"{within}"
        console.print(f"highest concurrency with mean ITL <= {plan.config.slo_itl_ms:g} ms: {text}", highlight=False)
    console.print(_model_line(plan), highlight=False)
    if plan.track_record is not None:
        console.print(f"[bold]track record[/]: {plan.track_record.words()}", highlight=False)
    _print_explanations(console, plan)
    for engine, line in plan.commands.items():
        console.print(f"[bold]{engine}[/]: {line}", soft_wrap=True, highlight=False)
    _print_serve_lines(console, plan)
    console.print(f"[bold]deploy[/]: {plan.deploy_render}", soft_wrap=True, highlight=False)


def _print_speculation(console: Console, plan: Plan) -> None:
    d = plan.deployment
    speculation, mtp = d.speculation, d.spec.mtp_params()
    if speculation is not None:
        console.print(f"speculative decoding: {speculation.describe()}", highlight=False)
    if speculation is not None and speculation.draft_layers:
        module = next((c for c in d.memory.components if c.component == DRAFT_COMPONENT), None)
        size = f"{module.bytes_per_gpu / GB:.2f} GB per GPU: " if module else ""
        console.print(
            f"loaded for speculative decoding: the {speculation.method.upper()} module ({size}its decoder layer and "
            "eh_proj; the embedding and output head are the main model's) and its KV cache (one more layer per token)",
            highlight=False,
        )
    elif mtp:
        console.print(
            f"not loaded: the MTP module ({mtp / 1e9:.1f}B parameters); engines load it only for speculative decoding "
            "(--speculative-method mtp)",
            highlight=False,
        )


def _forecasts_table(plan: Plan) -> Table:
    """The finite benchmark (--num-prompts) as the simulator runs it, beside the steady closed loop."""
    run = plan.forecasts[0].run
    rate = "all at once" if run.request_rate is None else f"at {run.request_rate:g} req/s"
    title = f"the benchmark forecast: {run.num_prompts} requests {rate}, per concurrency cap (steady in brackets)"
    table = Table(title=title)
    for column in ("concurrency", "output tok/s", "TPOT ms", "TTFT ms mean", "TTFT ms p99", "duration s"):
        table.add_column(column, justify="right")
    for forecast, steady in zip(plan.forecasts, plan.predictions, strict=True):
        table.add_row(
            str(forecast.run.concurrency),
            f"{forecast.output_throughput_tok_s:,.0f} ({steady.output_throughput_tok_s:,.0f})",
            f"{forecast.tpot_ms.mean:,.1f} ({steady.tpot_ms:,.1f})",
            f"{forecast.ttft_ms.mean:,.0f} ({steady.ttft_ms:,.0f})",
            f"{forecast.ttft_ms.p99:,.0f}",
            f"{forecast.duration_s:,.1f}",
        )
    return table


def _print_serve_lines(console: Console, plan: Plan) -> None:
    nodes = plan.deployment.hosts
    if len(plan.serve_commands) == 1:  # one machine, or "n/a: why"
        console.print(f"[bold]deepserve[/]: {plan.serve_commands[0]}", soft_wrap=True, highlight=False)
        return
    console.print(
        f"[bold]deepserve on {nodes} nodes[/] ({plan.deployment.engine}'s multi-node runtime; replace HEAD_NODE_IP "
        "with node 0's address on the network the nodes share; node 0 serves the API and the gateway, the others run "
        "headless):",
        highlight=False,
    )
    for rank, line in enumerate(plan.serve_commands):
        console.print(f"  node {rank}: {line}", soft_wrap=True, highlight=False)


def _model_line(plan: Plan) -> str:
    f, p = plan.factors, plan.factors.parameters
    launch = f.facts.step_launch(plan.rates.family if plan.rates else "16bit").replace("_", " ")
    overheads = [f"{p.kernels_per_layer:.1f} small kernels per layer ({launch})"]
    if p.step_overhead_ms:
        overheads.append(f"{p.step_overhead_ms:.2f} ms per step")
    if p.per_sequence_us:
        overheads.append(f"{p.per_sequence_us:.0f} us per sequence per step")
    if p.request_overhead_ms:
        overheads.append(f"{p.request_overhead_ms:.1f} ms per request before its first token")
    overheads.append(f"prompt FLOPs at {p.prefill_efficiency:.0%} of the kernel rates")
    return (
        f"performance model: engine profile {f.profile} {f.version} ({f.provenance}): {', '.join(overheads)}; "
        f"kernel figures: {plan.rates.provenance if plan.rates else 'table'} (docs/PLANNING.md explains them)"
    )


def _print_explanations(console: Console, plan: Plan) -> None:
    for explanation in plan.explanations:
        console.print(f"[bold]why {explanation.topic.replace('_', ' ')}[/]: {explanation.text}", highlight=False)


def _memory_table(plan: Plan) -> Table:
    memory = plan.deployment.memory
    table = Table(title="memory per GPU (largest pipeline stage), GB = 10^9 bytes")
    table.add_column("part")
    table.add_column("placement")
    table.add_column("GB", justify="right")
    for component in memory.components:
        if component.bytes_per_gpu:
            table.add_row(component.component, component.placement, f"{component.bytes_per_gpu / GB:,.2f}")
    table.add_row("[bold]weights[/]", plan.deployment.fmt.name, f"[bold]{memory.weights_bytes_per_gpu / GB:,.2f}[/]")
    table.add_row("activations + CUDA graphs", "reserve", f"{memory.reserve_bytes_per_gpu / GB:,.2f}")
    table.add_row("KV cache", memory.kv_placement, f"{memory.kv_cache_bytes_per_gpu / GB:,.2f}")
    share = budget_words(plan.config.gpu_memory_utilization, plan.deployment)
    table.add_row("engine budget", share, f"{memory.budget_bytes_per_gpu / GB:,.2f}")
    return table


def _predictions_table(plan: Plan) -> Table:
    """The cost column only when a GPU-hour price is known (a column of placeholders says nothing)."""
    priced = plan.config.gpu_hour_usd is not None
    title = f"predicted at {plan.config.input_len} in / {plan.config.output_len} out tokens"
    table = Table(title=title, caption=None if priced else "cost per 1M output tokens: give --gpu-hour-usd")
    columns = ["concurrency", "running", "output tok/s", "TPOT ms", "TTFT ms"] + (["$/1M out tok"] * priced)
    for column in columns:
        table.add_column(column, justify="right")
    for p in plan.predictions:
        row = [str(p.concurrency), str(p.running), f"{p.output_throughput_tok_s:,.0f}", f"{p.tpot_ms:,.1f}"]
        row.append(f"{p.ttft_ms:,.0f}")
        cost = plan.cost_per_million_output_tokens_usd(p)
        if priced:
            row.append("n/a" if cost is None else f"{cost:,.3f}")
        table.add_row(*row)
    return table


def _shortfall(plan: Plan) -> str:
    memory = plan.deployment.memory
    if memory.kv_cache_bytes_per_gpu <= 0:
        missing = -memory.kv_cache_bytes_per_gpu / GB
        return (
            f"weights {memory.weights_bytes_per_gpu / GB:,.1f} GB + reserve {memory.reserve_bytes_per_gpu / GB:,.1f} "
            f"GB per GPU exceed the {memory.budget_bytes_per_gpu / GB:,.1f} GB budget by {missing:,.1f} GB; use more "
            "GPUs (--gpus/--nodes), a smaller format (--weights awq-int4) or a larger GPU"
        )
    return (
        f"the KV cache holds {memory.kv_cache_tokens:,} tokens, fewer than max_model_len {memory.max_model_len:,}; "
        "lower --max-model-len or add memory"
    )
