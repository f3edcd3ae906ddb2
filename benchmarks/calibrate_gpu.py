"""Calibrate the planner on a real GPU: PyTorch microbenchmarks of DeepSeek-V3's layer shapes at TP=8 shard sizes.

    python benchmarks/calibrate_gpu.py --out benchmarks/results/calibration_h100.json
    deepserve plan --gpu h100 ... --calibration benchmarks/results/calibration_h100.json

Three families, each timed with CUDA events (median of N runs after warm-up) and compared with the planner's
roofline for the same bytes and FLOPs on the catalog entry of the device:

- MLA decode attention over a latent cache: 16 heads per rank (128 / TP 8) attend over [batch, context, 576]
  latent vectors (absorbed form: scores against all 576 values, output from the first 512);
- MoE expert GEMMs: one MoE layer's 256 experts split 8 ways (gate+up 7168 -> 512, down 256 -> 7168), a batch of
  tokens routed top-8 uniformly at random, the touched experts run as one batched matmul (the shape of a fused MoE
  kernel: each touched expert's weights read once);
- dense GEMMs of the attention projections, the dense MLP and the output head at their TP=8 shard shapes, in BF16
  and, where torch._scaled_mm runs (Hopper and newer), FP8.

The JSON it writes has every measurement and a `planner` block: memory_efficiency (median achieved fraction of
datasheet bandwidth of the weight- and cache-streaming cases) and compute_efficiency (median achieved fraction of
dense peak of the large GEMMs in the planner's compute dtype). `--smoke` shrinks every shape for a CPU run that only
checks this script works; its file is marked and the planner refuses it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from deepserve.hardware.catalog import Accelerator, get_accelerator, match_device_name
from deepserve.models import load_spec

TP = 8


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

    @property
    def measured_over_roofline(self) -> float:
        return self.seconds / self.roofline_s


class Timer:
    def __init__(self, device: torch.device, warmup: int, iterations: int) -> None:
        self.device = device
        self.warmup = warmup
        self.iterations = iterations

    def median_s(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.iterations):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - began)
        return statistics.median(samples)


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

    def record(self, family: str, case: str, dtype: str, seconds: float, bytes_moved: float, flops: float) -> None:
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
            )
        )
        print(
            f"{family:12s} {case:34s} {dtype:5s} {seconds * 1e6:10.1f} us  roofline {roofline * 1e6:9.1f} us  "
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

                seconds = self.timer.median_s(attend)
                bytes_moved = cache.numel() * cache.element_size()
                flops = 2 * batch * heads * context * (width + latent)
                self.record("mla_decode", f"batch {batch} context {context}", "bf16", seconds, bytes_moved, flops)
                del cache, query

    # ---- MoE experts ----------------------------------------------------------------------------------------

    def moe_experts(self, batches: tuple[int, ...]) -> None:
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
            rows = int(counts.max())
            # The touched experts' weights, read once each: a contiguous slice has the same bytes as a gather of
            # the touched ones without the copy a gather would add.
            x = torch.randn(touched, rows, hidden, device=self.device, dtype=torch.bfloat16)

            def run(x: torch.Tensor = x, touched: int = touched) -> None:
                gate_up = torch.bmm(x, w13[:touched])
                act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
                torch.bmm(act, w2[:touched])

            seconds = self.timer.median_s(run)
            weights = touched * (hidden * 2 * inter + inter * hidden) * 2
            flops = 2 * batch * top_k * (hidden * 2 * inter + inter * hidden)
            case = f"batch {batch} ({touched} experts touched)"
            self.record("moe_experts", case, "bf16", seconds, weights, flops)

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
        fp8 = self.fp8_matmul()
        for name, (k_full, n_full) in shapes.items():
            k, n = self.dim(k_full), self.dim(n_full)
            weight = torch.randn(k, n, device=self.device, dtype=torch.bfloat16) * 0.02
            for m in rows:
                x = torch.randn(m, k, device=self.device, dtype=torch.bfloat16)
                seconds = self.timer.median_s(lambda x=x, weight=weight: torch.matmul(x, weight))
                self.record("dense_gemm", f"{name} m={m}", "bf16", seconds, (k * n + m * k + m * n) * 2, 2 * m * k * n)
                if fp8 is not None:
                    seconds = self.timer.median_s(fp8(x, weight))
                    self.record("dense_gemm", f"{name} m={m}", "fp8", seconds, k * n + m * k + m * n * 2, 2 * m * k * n)

    def fp8_matmul(self) -> Callable[[torch.Tensor, torch.Tensor], Callable[[], object]] | None:
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

        try:
            prepare(torch.zeros(16, 32, device=self.device), torch.zeros(32, 16, device=self.device))()
        except RuntimeError as exc:
            print(f"FP8 GEMMs skipped: {exc}", file=sys.stderr)
            return None
        return prepare

    # ---- summary --------------------------------------------------------------------------------------------

    def planner_block(self, compute_dtype: str) -> dict[str, Any]:
        """The two kernel efficiencies the planner uses. Streaming cases: MoE at batch <= 8, dense GEMMs at m=1,
        MLA decode at the longest context. Compute cases: dense GEMMs with the most rows, in COMPUTE_DTYPE when it
        was measured (else BF16)."""
        streaming = [
            m.bandwidth_fraction
            for m in self.results
            if (m.family == "moe_experts" and int(m.case.split()[1]) <= 8)
            or (m.family == "dense_gemm" and m.case.endswith(" m=1") and m.dtype == "bf16")
            or (m.family == "mla_decode" and m.case.endswith(f"context {max(self.contexts)}"))
        ]
        dtypes = {m.dtype for m in self.results if m.family == "dense_gemm"}
        dtype = compute_dtype if compute_dtype in dtypes else "bf16"
        largest = max(int(m.case.rsplit("=", 1)[1]) for m in self.results if m.family == "dense_gemm")
        compute = [
            m.compute_fraction
            for m in self.results
            if m.family == "dense_gemm" and m.dtype == dtype and m.case.endswith(f"m={largest}")
        ]
        return {
            "memory_efficiency": round(statistics.median(streaming), 4),
            "compute_efficiency": round(statistics.median(compute), 4),
            "compute_dtype": dtype,
            "memory_cases": len(streaming),
            "compute_cases": len(compute),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--gpu", default=None, help="catalog name of the device (default: from the driver's name)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="torch device")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, few runs: checks the script, measures nothing"
    )
    parser.add_argument("--iterations", type=int, default=20, help="timed runs per case (median is kept)")
    parser.add_argument("--compute-dtype", default="fp8", help="the planner's compute dtype to report (fp8, bf16)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run this on a GPU machine (or --device cpu --smoke to check the script)")
    device = torch.device(args.device)
    reported = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    acc = get_accelerator(args.gpu) if args.gpu else match_device_name(reported) or get_accelerator("cpu")
    shrink = 16 if args.smoke else 1
    timer = Timer(device, warmup=1 if args.smoke else 3, iterations=2 if args.smoke else args.iterations)
    calibration = Calibration(acc, device, timer, shrink)
    if args.smoke:
        calibration.contexts = (64, 128)
    print(f"calibrating on {reported} as catalog entry {acc.name}", flush=True)

    batches = (1, 8) if args.smoke else (1, 8, 32, 128)
    calibration.mla_decode(batches, calibration.contexts)
    calibration.moe_experts((1, 8, 64) if args.smoke else (1, 8, 32, 128, 512))
    calibration.dense_gemms((1, 64) if args.smoke else (1, 16, 128, 1024, 4096, 8192))

    result = {
        "device": reported,
        "catalog_entry": acc.name,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "tensor_parallel_shard": TP,
        "planner": calibration.planner_block(args.compute_dtype),
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
