"""Calibrate the planner on a real GPU: PyTorch microbenchmarks of each kind of work the step model uses
(plan/perf.py), at DeepSeek-V3's TP=8 shard shapes.

    python benchmarks/calibrate_gpu.py --out benchmarks/results/calibration_h100.json
    deepserve plan --gpu h100 ... --calibration benchmarks/results/calibration_h100.json

Each case is timed as a CUDA graph replays it (--iterations calls a graph, the per-call time of the median of five
replays after warm-up; launched back to back where capture fails, and on the CPU): the host's launch latency, which
the planner charges separately, is not counted. Each is compared with the device's datasheet figures from the
catalog:

- dense_gemm: the attention projections, the dense MLP and the output head at their shard shapes, in BF16 and,
  where torch._scaled_mm runs (Ada, Hopper and newer), FP8 with per-tensor scales, and on Hopper and newer with
  DeepSeek's block scales (1 x 128 activations, 128 x 128 weights, through torch.nn.functional.scaled_mm);
- moe_gemm: one MoE layer's 256 experts split 8 ways (gate+up 7168 -> 512, down 256 -> 7168), a batch of tokens
  routed top-8 uniformly at random, the touched experts run as one batched matmul (each touched expert's weights
  read once, as in a fused MoE kernel; each gets the mean number of tokens); BF16;
- moe_gemm under expert parallelism: one GPU's whole experts (256 / EP of them, gate+up 7168 -> 4096, down 2048 ->
  7168) for the tokens routed to them when every rank decodes 32-512 tokens (each rank's tokens x top-8 copies
  spread over the GPUs), 32-2048 tokens a rank: FP8 where the GPU has FP8 units, both as one grouped GEMM
  (torch._scaled_grouped_mm, rowwise scales) and as one block-scaled GEMM per expert; BF16 otherwise;
- FP4 (NVFP4: E2M1 values, an FP8 scale per 16) where the GPU has FP4 units (Blackwell, compute capability 10+)
  and torch has the dtype: the dense shapes and the EP experts, when torch._scaled_mm takes them (else noted);
- mla_decode: 16 heads per rank attend over [batch, context, 576] latent vectors (absorbed form), at 1K-4K and at
  long contexts (32K, 64K, 128K);
- mla_prefill: causal attention in MLA's decompressed form (query/key 192, value 128 per head, 16 heads per rank)
  through torch's scaled_dot_product_attention, at 2K-8K tokens, and an 8K-token chunk attending to 32K-128K cached
  positions (chunked prefill of a long prompt).

The JSON has every measurement and, under `planner.kinds`, the fields data/kernels.json has per kind and weight
family (memory_efficiency, compute_efficiency, floor_us), which `deepserve plan --calibration FILE` uses in place of
the table's: memory efficiency from the streaming cases (for GEMMs the slope of time against bytes, whose intercept
is moe_gemm's floor), compute efficiency from the compute-bound cases only (a kind with none keeps the table's);
where several FP8 kernels ran, the one nearest the engines' (block scales for dense GEMMs, the grouped GEMM for
experts) sets the figures.
All-reduce bandwidth is not measured here (it needs several GPUs: run nccl-tests' all_reduce_perf). `--smoke`
shrinks every shape for a CPU run that only checks the script works; its file is marked and the planner refuses it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from deepserve.hardware.catalog import Accelerator, get_accelerator, match_device_name
from deepserve.models import load_spec
from deepserve.plan.calibration import CALIBRATION_FORMAT

TP = 8

Fp8Builder = Callable[[torch.Tensor, torch.Tensor], Callable[[], object]]  # (x, weight) -> one GEMM's call
ExpertBuilder = Callable[[int, int, int, int], Callable[[], object]]  # (experts, rows, hidden, inter) -> a MoE step


@dataclass
class Measurement:
    family: str
    case: str
    dtype: str
    seconds: float
    bytes_moved: float
    flops: float
    roofline_s: float  # the planner's max(bytes / bandwidth, flops / peak) at 100% efficiency
    bandwidth_fraction: float  # achieved bytes/s over datasheet bandwidth
    compute_fraction: float  # achieved FLOP/s over datasheet dense peak for the dtype
    compute_bound: bool  # its roofline is set by FLOPs, not bytes: only such cases tell a compute efficiency
    scaling: str = ""  # FP8's scale layout and kernel: "tensor", "block" (1x128 / 128x128), "rowwise grouped"

    @property
    def measured_over_roofline(self) -> float:
        return self.seconds / self.roofline_s


class Timer:
    """Per-call time of a case's kernels as a CUDA graph replays them, CALLS calls in a graph (the way vLLM runs
    decode steps): neither the host's launch latency nor Python's per-call work is counted, which the planner charges
    separately (kernels.json's launch_us). Launched back to back instead where a case cannot be captured, and on
    the CPU (--smoke)."""

    def __init__(self, device: torch.device, warmup: int, calls: int, samples: int = 5) -> None:
        self.device = device
        self.warmup = warmup
        self.calls = calls
        self.samples = samples
        self.uncaptured: list[str] = []  # cases timed back to back because capture failed

    def median_s(self, fn: Callable[[], object], case: str = "") -> float:
        for _ in range(self.warmup):
            fn()
        replay = self._graph(fn, case) if self.device.type == "cuda" else None
        run, repeats = (replay, 1) if replay else (fn, self.calls)
        return statistics.median(self._elapsed_s(run, repeats) / self.calls for _ in range(self.samples))

    def _graph(self, fn: Callable[[], object], case: str) -> Callable[[], object] | None:
        graph = torch.cuda.CUDAGraph()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # allocations on the capture stream before capture, as torch's graph docs ask
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                for _ in range(self.calls):
                    fn()
        except RuntimeError as exc:
            self.uncaptured.append(f"{case}: {exc}".splitlines()[0])
            return None
        return graph.replay

    def _elapsed_s(self, run: Callable[[], object], repeats: int) -> float:
        if self.device.type != "cuda":
            began = time.perf_counter()
            for _ in range(repeats):
                run()
            return time.perf_counter() - began
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3


class Calibration:
    def __init__(self, acc: Accelerator, device: torch.device, timer: Timer, shrink: int) -> None:
        self.acc = acc
        self.device = device
        self.timer = timer
        self.shrink = shrink  # divides every model dimension in --smoke runs
        self.spec = load_spec("deepseek-ai/DeepSeek-V3")
        self.results: list[Measurement] = []
        self.contexts: tuple[int, ...] = (1024, 4096)

    def dim(self, value: int) -> int:
        return max(value // self.shrink, 1)

    def record(
        self, family: str, case: str, dtype: str, seconds: float, bytes_moved: float, flops: float, scaling: str = ""
    ) -> None:
        bandwidth = self.acc.memory_bandwidth_gb_s * 1e9
        peak = self.acc.peak_tflops(dtype) * 1e12
        roofline = max(bytes_moved / bandwidth, flops / peak)
        self.results.append(
            Measurement(
                family,
                case,
                dtype,
                seconds,
                bytes_moved,
                flops,
                roofline,
                bytes_moved / seconds / bandwidth,
                flops / seconds / peak,
                flops / peak >= bytes_moved / bandwidth,
                scaling,
            )
        )
        label = f"{dtype} {scaling}".strip()
        print(
            f"{family:12s} {case:44s} {label:20s} {seconds * 1e6:10.1f} us  roofline {roofline * 1e6:9.1f} us  "
            f"BW {bytes_moved / seconds / 1e9:8.1f} GB/s  {flops / seconds / 1e12:8.2f} TFLOP/s",
            flush=True,
        )

    # ---- MLA decode attention -------------------------------------------------------------------------------

    def mla_decode(self, batches: tuple[int, ...], contexts: tuple[int, ...]) -> None:
        spec = self.spec
        heads = self.dim(spec.num_attention_heads // TP)
        latent = self.dim(spec.kv_lora_rank or 512)
        width = latent + self.dim(spec.qk_rope_head_dim)
        for batch in batches:
            for context in contexts:
                cache = torch.randn(batch, context, width, device=self.device, dtype=torch.bfloat16)
                query = torch.randn(batch, heads, width, device=self.device, dtype=torch.bfloat16)
                scale = width**-0.5

                def attend(cache: torch.Tensor = cache, query: torch.Tensor = query, scale: float = scale) -> None:
                    scores = torch.softmax(torch.matmul(query, cache.transpose(1, 2)).float() * scale, dim=-1)
                    torch.matmul(scores.to(cache.dtype), cache[..., :latent])

                case = f"batch {batch} context {context}"
                seconds = self.timer.median_s(attend, f"mla_decode {case}")
                bytes_moved = cache.numel() * cache.element_size()
                flops = 2 * batch * heads * context * (width + latent)
                self.record("mla_decode", case, "bf16", seconds, bytes_moved, flops)
                del cache, query

    # ---- MLA prefill attention ------------------------------------------------------------------------------

    def mla_prefill(self, lengths: tuple[int, ...]) -> None:
        spec = self.spec
        heads = self.dim(spec.num_attention_heads // TP)
        qk = self.dim(spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        v = self.dim(spec.v_head_dim)
        for length in lengths:
            q = torch.randn(1, heads, length, qk, device=self.device, dtype=torch.bfloat16)
            k = torch.randn(1, heads, length, qk, device=self.device, dtype=torch.bfloat16)
            value = torch.randn(1, heads, length, v, device=self.device, dtype=torch.bfloat16)

            def attend(q: torch.Tensor = q, k: torch.Tensor = k, value: torch.Tensor = value) -> None:
                torch.nn.functional.scaled_dot_product_attention(q, k, value, is_causal=True)

            seconds = self.timer.median_s(attend, f"mla_prefill {length} tokens")
            flops = 2 * heads * (qk + v) * length * length / 2  # causal: half the score matrix
            bytes_moved = (q.numel() + k.numel() + 2 * value.numel()) * 2
            self.record("mla_prefill", f"{length} tokens", "bf16", seconds, bytes_moved, flops)
            del q, k, value

    # ---- MoE experts ----------------------------------------------------------------------------------------

    def moe_gemm(self, batches: tuple[int, ...]) -> None:
        spec = self.spec
        experts, top_k = spec.n_routed_experts, spec.num_experts_per_tok
        hidden, inter = self.dim(spec.hidden_size), self.dim(spec.moe_intermediate_size // TP)
        w13 = torch.randn(experts, hidden, 2 * inter, device=self.device, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(experts, inter, hidden, device=self.device, dtype=torch.bfloat16) * 0.02
        generator = torch.Generator().manual_seed(0)
        for batch in batches:
            choice = torch.rand(batch, experts, generator=generator).topk(top_k, dim=1).indices
            counts = torch.bincount(choice.flatten(), minlength=experts)
            touched = int((counts > 0).sum())
            rows = -(-batch * top_k // touched)  # the mean per touched expert: the padded batch does the work counted
            # The touched experts' weights, read once each: a contiguous slice has the same bytes as a gather of
            # the touched ones without the copy a gather would add.
            x = torch.randn(touched, rows, hidden, device=self.device, dtype=torch.bfloat16)

            def run(x: torch.Tensor = x, touched: int = touched) -> None:
                gate_up = torch.bmm(x, w13[:touched])
                act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
                torch.bmm(act, w2[:touched])

            seconds = self.timer.median_s(run, f"moe_gemm batch {batch}")
            weights = touched * (hidden * 2 * inter + inter * hidden) * 2
            flops = 2 * batch * top_k * (hidden * 2 * inter + inter * hidden)
            case = f"batch {batch} ({touched} experts touched)"
            self.record("moe_gemm", case, "bf16", seconds, weights, flops)

    # ---- dense GEMMs ----------------------------------------------------------------------------------------

    def dense_gemms(self, rows: tuple[int, ...]) -> None:
        spec = self.spec
        heads = spec.num_attention_heads // TP
        shapes = {
            "q_a 7168x1536 (replicated)": (spec.hidden_size, spec.q_lora_rank or spec.hidden_size),
            "q_b 1536x3072": (spec.q_lora_rank or spec.hidden_size, heads * (spec.qk_nope_head_dim + 64)),
            "o_proj 2048x7168": (heads * spec.v_head_dim, spec.hidden_size),
            "dense_mlp gate_up 7168x4608": (spec.hidden_size, 2 * spec.intermediate_size // TP),
            "lm_head 7168x16160": (spec.hidden_size, spec.vocab_size // TP),
        }
        for name, (k_full, n_full) in shapes.items():
            k, n = self.dim(k_full), self.dim(n_full)
            weight = torch.randn(k, n, device=self.device, dtype=torch.bfloat16) * 0.02
            for m in rows:
                x = torch.randn(m, k, device=self.device, dtype=torch.bfloat16)
                seconds = self.timer.median_s(lambda x=x, weight=weight: torch.matmul(x, weight), f"{name} m={m}")
                self.record("dense_gemm", f"{name} m={m}", "bf16", seconds, (k * n + m * k + m * n) * 2, 2 * m * k * n)
                for scaling, prepare in self.fp8_gemms.items():
                    seconds = self._fp8_seconds(prepare, x, weight, f"{name} m={m} fp8 {scaling}")
                    if seconds is not None:
                        nbytes = k * n + m * k + m * n * 2 + (k * n / 128**2 + m * k / 128) * 4 * (scaling == "block")
                        self.record("dense_gemm", f"{name} m={m}", "fp8", seconds, nbytes, 2 * m * k * n, scaling)

    def _fp8_seconds(self, prepare: Fp8Builder, x: torch.Tensor, weight: torch.Tensor, case: str) -> float | None:
        """The time of one FP8 GEMM, or None (said so) where this shape is one the kernel refuses."""
        try:
            return self.timer.median_s(prepare(x, weight), case)
        except (RuntimeError, ValueError) as exc:
            print(f"{case} skipped: {exc}".splitlines()[0], file=sys.stderr)
            return None

    @cached_property
    def fp8_gemms(self) -> dict[str, Fp8Builder]:
        """The FP8 GEMMs this device runs, by scale layout ("tensor", "block"): each probed once, the ones that
        cannot run left out (and said so)."""
        builders = {"tensor": self.fp8_matmul(), "block": self.fp8_block_matmul()}
        return {scaling: build for scaling, build in builders.items() if build is not None}

    def fp8_matmul(self) -> Fp8Builder | None:
        """FP8 x FP8 -> BF16 with per-tensor scales via torch._scaled_mm, where the device runs it."""
        if self.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
            return None
        if torch.cuda.get_device_capability(self.device) < (8, 9):
            return None
        one = torch.ones((), device=self.device, dtype=torch.float32)

        def prepare(x: torch.Tensor, weight: torch.Tensor) -> Callable[[], object]:
            a = x.to(torch.float8_e4m3fn)
            b = weight.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
            return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        return _probed("FP8 GEMMs (per-tensor scales)", prepare, self.device)

    def fp8_block_matmul(self) -> Fp8Builder | None:
        """FP8 x FP8 -> BF16 with DeepSeek's block scales (activations per 1 x 128, weights per 128 x 128), as its
        FP8 checkpoints run, via torch.nn.functional.scaled_mm (cuBLAS's block-scaled GEMM on Hopper)."""
        functional: Any = torch.nn.functional
        if self.device.type != "cuda" or not hasattr(functional, "scaled_mm"):
            print("block-scaled FP8 GEMMs skipped: no CUDA device or torch without F.scaled_mm", file=sys.stderr)
            return None
        if torch.cuda.get_device_capability(self.device) < (9, 0):
            print("block-scaled FP8 GEMMs skipped: they need Hopper or newer", file=sys.stderr)
            return None
        # the recipes are spelt BlockWise1x128 in torch 2.11 and newer, Blockwise_1x128 in some earlier builds
        activations, weights = (
            getattr(functional.ScalingType, new, None) or getattr(functional.ScalingType, old)
            for new, old in (("BlockWise1x128", "Blockwise_1x128"), ("BlockWise128x128", "Blockwise_128x128"))
        )

        def prepare(x: torch.Tensor, weight: torch.Tensor) -> Callable[[], object]:
            (m, k), n = x.shape, weight.shape[1]
            rows = m + -m % 4  # the kernel takes a token count that is a multiple of 4: the batch is zero-padded
            a = torch.zeros(rows, k, device=self.device, dtype=torch.float8_e4m3fn)
            a[:m] = x.to(torch.float8_e4m3fn)
            k_blocks = -(-k // 128)
            a_scale = torch.ones(k_blocks, rows, device=self.device, dtype=torch.float32).t()  # token-major
            b = weight.t().contiguous().to(torch.float8_e4m3fn)  # [n, k]: its transpose is column-major
            b_scale = torch.ones(-(-n // 128), k_blocks + -k_blocks % 4, device=self.device, dtype=torch.float32)
            return lambda: functional.scaled_mm(
                a,
                b.t(),
                a_scale,
                activations,
                b_scale.t(),
                weights,
                output_dtype=torch.bfloat16,
            )

        return _probed("block-scaled FP8 GEMMs", prepare, self.device)

    # ---- MoE experts under expert parallelism ---------------------------------------------------------------

    def moe_gemm_ep(self, ep_sizes: tuple[int, ...], tokens_per_rank: tuple[int, ...]) -> None:
        """One GPU's whole experts (256 / EP) for the tokens the all-to-all brings it: every rank's tokens x top-8
        copies spread uniformly over the EP GPUs, the local experts touched as routing says. Timed with each kernel
        this GPU has: one grouped FP8 GEMM (rowwise scales), one block-scaled FP8 GEMM per expert, BF16 where it has
        no FP8 units."""
        spec = self.spec
        hidden, inter = self.dim(spec.hidden_size), self.dim(spec.moe_intermediate_size)
        builders = self.expert_builders()
        for ep in ep_sizes:
            local = max(spec.n_routed_experts // ep, 1)
            for tokens in tokens_per_rank:
                arrivals = tokens * spec.num_experts_per_tok  # copies per GPU on average
                generator = torch.Generator().manual_seed(ep * 100_003 + tokens)
                counts = torch.bincount(torch.randint(0, local, (arrivals,), generator=generator), minlength=local)
                touched = int((counts > 0).sum())
                rows = -(-arrivals // touched)
                case = f"ep{ep} batch {arrivals} ({tokens} tokens/rank, {touched}/{local} experts)"
                for (dtype, scaling), build in builders.items():
                    try:
                        run = build(touched, rows, hidden, inter)
                        seconds = self.timer.median_s(run, f"moe_gemm {case} {scaling}")
                    except (RuntimeError, ValueError) as exc:
                        print(f"moe_gemm {case} {dtype} {scaling} skipped: {exc}".splitlines()[0], file=sys.stderr)
                        continue
                    weights = touched * 3 * hidden * inter * (1 if dtype == "fp8" else 2)
                    self.record("moe_gemm", case, dtype, seconds, weights, 2 * arrivals * 3 * hidden * inter, scaling)
                    del run

    def expert_builders(self) -> dict[tuple[str, str], ExpertBuilder]:
        """Per (dtype, scaling), a builder of one expert-parallel MoE step on this device: (experts, rows, hidden,
        intermediate) -> its call."""
        scaling = next((scaling for scaling in ("block", "tensor") if scaling in self.fp8_gemms), None)
        if scaling is None:
            return {("bf16", ""): self._bf16_experts}
        per_expert = self.fp8_gemms[scaling]
        builders: dict[tuple[str, str], ExpertBuilder] = {}
        if self._grouped_fp8_runs():
            builders["fp8", "rowwise grouped"] = self._grouped_fp8_experts
        builders["fp8", f"{scaling} per expert"] = lambda e, r, h, i: self._looped_fp8_experts(per_expert, e, r, h, i)
        return builders

    def _bf16_experts(self, experts: int, rows: int, hidden: int, inter: int) -> Callable[[], object]:
        x = torch.randn(experts, rows, hidden, device=self.device, dtype=torch.bfloat16)
        w13 = torch.randn(experts, hidden, 2 * inter, device=self.device, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(experts, inter, hidden, device=self.device, dtype=torch.bfloat16) * 0.02

        def run() -> None:
            gate_up = torch.bmm(x, w13)
            torch.bmm(torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:], w2)

        return run

    def _looped_fp8_experts(
        self, gemm: Fp8Builder, experts: int, rows: int, hidden: int, inter: int
    ) -> Callable[[], object]:
        x = torch.randn(rows, hidden, device=self.device, dtype=torch.bfloat16)
        act = torch.randn(rows, inter, device=self.device, dtype=torch.bfloat16)
        calls = [
            gemm(x, torch.randn(hidden, 2 * inter, device=self.device, dtype=torch.bfloat16) * 0.02)
            for _ in range(experts)
        ]
        calls += [
            gemm(act, torch.randn(inter, hidden, device=self.device, dtype=torch.bfloat16) * 0.02)
            for _ in range(experts)
        ]

        def run() -> None:
            for call in calls:
                call()

        return run

    def _grouped_fp8_experts(self, experts: int, rows: int, hidden: int, inter: int) -> Callable[[], object]:
        """torch._scaled_grouped_mm over [experts, rows, K] x [experts, K, N] with rowwise scales: one kernel for
        every local expert, as a fused MoE runs them (rows padded to 16, as the kernel asks)."""
        rows += -rows % 16
        fp8 = torch.float8_e4m3fn

        def operands(k: int, n: int) -> tuple[torch.Tensor, ...]:
            a = torch.randn(experts, rows, k, device=self.device).to(fp8)
            b = torch.randn(experts, n, k, device=self.device).to(fp8).transpose(-2, -1)  # column-major per expert
            scale_a = torch.ones(experts, rows, device=self.device, dtype=torch.float32)
            scale_b = torch.ones(experts, n, device=self.device, dtype=torch.float32)
            return a, b, scale_a, scale_b

        up, down = operands(hidden, 2 * inter), operands(inter, hidden)

        def run() -> None:
            for a, b, scale_a, scale_b in (up, down):
                torch._scaled_grouped_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)

        return run

    def _grouped_fp8_runs(self) -> bool:
        if not hasattr(torch, "_scaled_grouped_mm"):
            print("grouped FP8 MoE skipped: torch without _scaled_grouped_mm", file=sys.stderr)
            return False
        try:
            self._grouped_fp8_experts(2, 16, 256, 128)()
            torch.cuda.synchronize(self.device)
        except (RuntimeError, ValueError, TypeError) as exc:
            print(f"grouped FP8 MoE skipped: {exc}".splitlines()[0], file=sys.stderr)
            return False
        return True

    # ---- FP4 ------------------------------------------------------------------------------------------------

    def fp4_gemms(self, rows: tuple[int, ...]) -> None:
        """NVFP4 GEMMs where the GPU has FP4 units and torch exposes the dtype; skipped (and said so) otherwise."""
        fp4 = self.fp4_matmul()
        if fp4 is None:
            return
        spec = self.spec
        for name, (k, n) in {"expert gate_up 7168x4096": (spec.hidden_size, 2 * spec.moe_intermediate_size)}.items():
            for m in rows:
                run = fp4(m, k, n)
                seconds = self.timer.median_s(run, f"{name} m={m} fp4")
                nbytes = k * n / 2 + k * n / 16 + m * k + m * n * 2  # E2M1 weights, one FP8 scale per 16, FP8 in
                self.record("dense_gemm", f"{name} m={m}", "fp4", seconds, nbytes, 2 * m * k * n)

    def fp4_matmul(self) -> Callable[[int, int, int], Callable[[], object]] | None:
        if self.device.type != "cuda" or not hasattr(torch, "float4_e2m1fn_x2"):
            print("FP4 GEMMs skipped: no CUDA device or torch without float4_e2m1fn_x2", file=sys.stderr)
            return None
        if torch.cuda.get_device_capability(self.device) < (10, 0):
            print("FP4 GEMMs skipped: the GPU has no FP4 units (compute capability < 10)", file=sys.stderr)
            return None

        def prepare(m: int, k: int, n: int) -> Callable[[], object]:
            a = torch.randint(0, 255, (m, k // 2), device=self.device, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
            b = torch.randint(0, 255, (n, k // 2), device=self.device, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
            scale_a = torch.ones(m, k // 16, device=self.device, dtype=torch.float8_e4m3fn)
            scale_b = torch.ones(n, k // 16, device=self.device, dtype=torch.float8_e4m3fn)
            return lambda: torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)

        try:
            prepare(128, 256, 128)()
        except (RuntimeError, TypeError) as exc:
            print(f"FP4 GEMMs skipped: {exc}".splitlines()[0], file=sys.stderr)
            return None
        return prepare

    # ---- long contexts --------------------------------------------------------------------------------------

    def long_prefill_chunks(self, chunk: int, contexts: tuple[int, ...]) -> None:
        """A prompt chunk of CHUNK tokens attending to CONTEXT cached positions (keys and values decompressed), as
        chunked prefill runs a long prompt's later chunks."""
        spec = self.spec
        heads = self.dim(spec.num_attention_heads // TP)
        qk = self.dim(spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        v = self.dim(spec.v_head_dim)
        for context in contexts:
            q = torch.randn(1, heads, chunk, qk, device=self.device, dtype=torch.bfloat16)
            k = torch.randn(1, heads, context, qk, device=self.device, dtype=torch.bfloat16)
            value = torch.randn(1, heads, context, v, device=self.device, dtype=torch.bfloat16)

            def attend(q: torch.Tensor = q, k: torch.Tensor = k, value: torch.Tensor = value) -> None:
                torch.nn.functional.scaled_dot_product_attention(q, k, value)

            case = f"chunk {chunk} over {context} cached"
            seconds = self.timer.median_s(attend, f"mla_prefill {case}")
            flops = 2 * heads * (qk + v) * chunk * context
            bytes_moved = (q.numel() + k.numel() + value.numel() + q.numel() // qk * v) * 2
            self.record("mla_prefill", case, "bf16", seconds, bytes_moved, flops)
            del q, k, value

    # ---- summary --------------------------------------------------------------------------------------------

    def planner_block(self) -> dict[str, Any]:
        """Per kind and weight family, what data/kernels.json holds. Memory efficiency: for GEMMs, the slope of time
        against bytes over the streaming cases (one row; MoE: up to 32 tokens), whose intercept is the fixed time of
        a call (kept as moe_gemm's floor; the planner charges dense launches itself); for decode attention, the
        longest contexts' median. Compute efficiency: the median over the compute-bound cases. A figure no case
        could tell is left out (the table's stays)."""
        kinds: dict[str, dict[str, dict[str, float]]] = {}
        for dtype, family in (("bf16", "16bit"), ("fp8", "fp8")):
            dense = _as_engines_run([m for m in self.results if m.family == "dense_gemm" and m.dtype == dtype])
            if dense:
                streaming = [m for m in dense if _rows(m) == 1]
                kinds.setdefault("dense_gemm", {})[family] = self._figures(streaming, dense, by_line=True)
        for dtype, family in (("bf16", "16bit"), ("fp8", "fp8"), ("fp4", "fp4")):
            moe = _as_engines_run([m for m in self.results if m.family == "moe_gemm" and m.dtype == dtype])
            if moe:
                small = [m for m in moe if _rows(m) <= (256 if m.case.startswith("ep") else 32)]
                figures = self._figures(small, moe, by_line=True)
                figures["floor_us"] = round(_intercept(small)[0], 2)
                kinds.setdefault("moe_gemm", {})[family] = figures
        fp4 = [m for m in self.results if m.family == "dense_gemm" and m.dtype == "fp4"]
        if fp4:
            kinds.setdefault("dense_gemm", {})["fp4"] = self._figures([m for m in fp4 if _rows(m) == 1], fp4, True)
        decode = [m for m in self.results if m.family == "mla_decode"]
        if decode:
            longest = [m for m in decode if int(m.case.rsplit(" ", 1)[1]) >= max(self.contexts)]
            kinds["mla_decode"] = {"any": self._figures(longest, decode)}
        prefill = [m for m in self.results if m.family == "mla_prefill"]
        if prefill:
            kinds["mla_prefill"] = {"any": self._figures([], prefill)}
        measured = {
            kind: {
                family: f for family, f in by_family.items() if f.keys() & {"memory_efficiency", "compute_efficiency"}
            }
            for kind, by_family in kinds.items()
        }
        return {"kinds": {kind: by_family for kind, by_family in measured.items() if by_family}}

    def _figures(
        self, streaming: list[Measurement], cases: list[Measurement], by_line: bool = False
    ) -> dict[str, float]:
        figures: dict[str, float] = {"floor_us": 0.0}
        bandwidth = _intercept(streaming)[1] if by_line else 0.0
        if bandwidth:
            figures["memory_efficiency"] = round(min(bandwidth / (self.acc.memory_bandwidth_gb_s * 1e9), 1.0), 4)
        elif streaming:
            figures["memory_efficiency"] = round(
                min(statistics.median(m.bandwidth_fraction for m in streaming), 1.0), 4
            )
        bound = [m.compute_fraction for m in cases if m.compute_bound]
        if bound:
            figures["compute_efficiency"] = round(min(statistics.median(bound), 1.0), 4)
        return figures


# Of the kernels timed for one kind, the one nearest what vLLM and SGLang run for DeepSeek's FP8 checkpoints (block
# scales; a fused MoE kernel over every local expert) sets the planner's figures; the others stay in the file.
ENGINE_LIKE_SCALINGS = ("block", "rowwise grouped", "block per expert", "tensor per expert", "tensor", "")


def _as_engines_run(cases: list[Measurement]) -> list[Measurement]:
    present = {m.scaling for m in cases}
    best = next((scaling for scaling in ENGINE_LIKE_SCALINGS if scaling in present), None)
    return [m for m in cases if m.scaling == best]


def _probed(what: str, prepare: Fp8Builder, device: torch.device) -> Fp8Builder | None:
    """PREPARE where one small GEMM through it runs on DEVICE; else None, and why on stderr."""
    try:
        x = torch.randn(16, 256, device=device, dtype=torch.bfloat16)
        prepare(x, torch.randn(256, 256, device=device, dtype=torch.bfloat16))()
        torch.cuda.synchronize(device)
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        print(f"{what} skipped: {exc}".splitlines()[0], file=sys.stderr)
        return None
    return prepare


def _rows(m: Measurement) -> int:
    """The batch (rows, tokens) of a dense or MoE case: `... m=128`, `batch 8 (...)` or `ep8 batch 256 (...)`."""
    if "m=" in m.case:
        return int(m.case.rsplit("=", 1)[1])
    words = m.case.split()
    return int(words[words.index("batch") + 1])


def _intercept(cases: list[Measurement]) -> tuple[float, float]:
    """Least-squares line seconds = floor + bytes / bandwidth over CASES: (floor in us, bandwidth in B/s; 0 when
    the cases cannot tell)."""
    if len(cases) < 2:
        return 0.0, 0.0
    xs = [m.bytes_moved for m in cases]
    ys = [m.seconds for m in cases]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    if slope <= 0:
        return 0.0, 0.0
    return max(mean_y - slope * mean_x, 0.0) * 1e6, 1 / slope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--gpu", default=None, help="catalog name of the device (default: from the driver's name)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="torch device")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, few runs: checks the script, measures nothing"
    )
    parser.add_argument(
        "--iterations", type=int, default=20, help="calls per CUDA graph (per timed sample); five samples a case"
    )
    parser.add_argument(
        "--long-context",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time attention at 32K-128K contexts (decode, and an 8K prompt chunk over them)",
    )
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run this on a GPU machine (or --device cpu --smoke to check the script)")
    device = torch.device(args.device)
    reported = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    acc = get_accelerator(args.gpu) if args.gpu else match_device_name(reported) or get_accelerator("cpu")
    shrink = 16 if args.smoke else 1
    timer = Timer(device, warmup=1 if args.smoke else 3, calls=2 if args.smoke else args.iterations)
    calibration = Calibration(acc, device, timer, shrink)
    if args.smoke:
        calibration.contexts = (64, 128)
    print(f"calibrating on {reported} as catalog entry {acc.name}", flush=True)

    batches = (1, 8) if args.smoke else (1, 8, 32, 128)
    calibration.mla_decode(batches, calibration.contexts)
    calibration.mla_prefill((64, 128) if args.smoke else (2048, 4096, 8192))
    calibration.moe_gemm((1, 8, 64) if args.smoke else (1, 8, 16, 32, 128, 512, 4096, 16384))
    calibration.dense_gemms((1, 64) if args.smoke else (1, 16, 128, 1024, 4096, 8192))
    calibration.moe_gemm_ep((8, 32) if args.smoke else (8, 16, 32, 64), (4, 16) if args.smoke else (32, 128, 512, 2048))
    calibration.fp4_gemms((1, 64) if args.smoke else (1, 16, 128, 1024, 4096))
    if args.long_context:
        long = (256, 512) if args.smoke else (32768, 65536, 131072)
        calibration.mla_decode((1, 8), long)
        calibration.long_prefill_chunks(64 if args.smoke else 8192, long)

    result = {
        "format": CALIBRATION_FORMAT,
        "device": reported,
        "catalog_entry": acc.name,
        "hardware_class": acc.hardware_class,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "tensor_parallel_shard": TP,
        "timing": "CUDA graph replay of calls per sample" if device.type == "cuda" else "calls back to back",
        "timed_back_to_back": timer.uncaptured,  # cases a CUDA graph could not capture
        "planner": calibration.planner_block(),
        "measurements": [
            {**asdict(m), "measured_over_roofline": round(m.measured_over_roofline, 4)} for m in calibration.results
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}: {result['planner']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
