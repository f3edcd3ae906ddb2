"""Calibrate the planner on a real GPU: PyTorch microbenchmarks of each kind of work the step model uses
(plan/perf.py), at DeepSeek-V3's TP=8 shard shapes.

    python benchmarks/calibrate_gpu.py --out benchmarks/results/calibration_h100.json
    deepserve plan --gpu h100 ... --calibration benchmarks/results/calibration_h100.json

Each case is timed with CUDA events (median of N runs after warm-up) and compared with the device's datasheet
figures from the catalog:

- dense_gemm: the attention projections, the dense MLP and the output head at their shard shapes, in BF16 and,
  where torch._scaled_mm runs (Ada, Hopper and newer), FP8 with per-tensor scales;
- moe_gemm: one MoE layer's 256 experts split 8 ways (gate+up 7168 -> 512, down 256 -> 7168), a batch of tokens
  routed top-8 uniformly at random, the touched experts run as one batched matmul (each touched expert's weights
  read once, as in a fused MoE kernel); BF16;
- mla_decode: 16 heads per rank attend over [batch, context, 576] latent vectors (absorbed form);
- mla_prefill: causal attention in MLA's decompressed form (query/key 192, value 128 per head, 16 heads per rank)
  through torch's scaled_dot_product_attention, at 2K-8K tokens.

The JSON has every measurement and, under `planner.kinds`, the fields data/kernels.json has per kind and weight
family (memory_efficiency, compute_efficiency, floor_us), which `deepserve plan --calibration FILE` uses in place of
the table's: memory efficiency from the streaming cases (small batches), compute efficiency from the largest, and
for moe_gemm the floor as the intercept of time against bytes over the small batches. All-reduce bandwidth is not
measured here (it needs several GPUs: run nccl-tests' all_reduce_perf). `--smoke` shrinks every shape for a CPU
run that only checks the script works; its file is marked and the planner refuses it.
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
from deepserve.plan.calibration import CALIBRATION_FORMAT

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

            seconds = self.timer.median_s(attend)
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

    def planner_block(self) -> dict[str, Any]:
        """Per kind and weight family, what data/kernels.json holds: the streaming cases' median bandwidth
        fraction, the largest cases' median compute fraction, and (moe_gemm) the fixed time of one call."""
        kinds: dict[str, dict[str, dict[str, float]]] = {}
        for dtype, family in (("bf16", "16bit"), ("fp8", "fp8")):
            dense = [m for m in self.results if m.family == "dense_gemm" and m.dtype == dtype]
            if dense:
                largest = max(_rows(m) for m in dense)
                kinds.setdefault("dense_gemm", {})[family] = _figures(
                    [m for m in dense if _rows(m) == 1], [m for m in dense if _rows(m) == largest]
                )
        moe = [m for m in self.results if m.family == "moe_gemm"]
        if moe:
            small = [m for m in moe if _rows(m) <= 32]
            floor_us, bandwidth = _intercept(small)
            figures = _figures(small, [max(moe, key=_rows)])
            figures["floor_us"] = round(floor_us, 2)
            if bandwidth:
                figures["memory_efficiency"] = round(min(bandwidth / (self.acc.memory_bandwidth_gb_s * 1e9), 1.0), 4)
            kinds["moe_gemm"] = {"16bit": figures}
        decode = [m for m in self.results if m.family == "mla_decode"]
        if decode:
            longest = [m for m in decode if m.case.endswith(f"context {max(self.contexts)}")]
            kinds["mla_decode"] = {"any": _figures(longest, [max(decode, key=lambda m: m.flops)])}
        prefill = [m for m in self.results if m.family == "mla_prefill"]
        if prefill:
            kinds["mla_prefill"] = {"any": _figures(prefill, prefill, memory=False)}
        return {"kinds": kinds}


def _rows(m: Measurement) -> int:
    """The batch (rows, tokens) of a dense or MoE case: `... m=128` or `batch 8 (...)`."""
    if "m=" in m.case:
        return int(m.case.rsplit("=", 1)[1])
    return int(m.case.split()[1])


def _figures(streaming: list[Measurement], compute: list[Measurement], memory: bool = True) -> dict[str, float]:
    return {
        "memory_efficiency": round(min(statistics.median(m.bandwidth_fraction for m in streaming), 1.0), 4)
        if memory
        else 0.9,  # prefill attention is compute-bound; the table's value for its (small) cache reads
        "compute_efficiency": round(min(statistics.median(m.compute_fraction for m in compute), 1.0), 4),
        "floor_us": 0.0,
    }


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
    parser.add_argument("--iterations", type=int, default=20, help="timed runs per case (median is kept)")
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
    calibration.mla_prefill((64, 128) if args.smoke else (2048, 4096, 8192))
    calibration.moe_gemm((1, 8, 64) if args.smoke else (1, 8, 16, 32, 128, 512))
    calibration.dense_gemms((1, 64) if args.smoke else (1, 16, 128, 1024, 4096, 8192))

    result = {
        "format": CALIBRATION_FORMAT,
        "device": reported,
        "catalog_entry": acc.name,
        "hardware_class": acc.hardware_class,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "tensor_parallel_shard": TP,
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
