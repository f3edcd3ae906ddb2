"""This machine's own speed, measured by deepserve: memory bandwidth and matrix-multiply FLOP rate.

The planner's CPU profile and the report's "how close to the hardware limit" line need these two numbers for the
machine the engine runs on. Datasheets do not give them for an arbitrary (often virtual) CPU, so we measure them,
once, and keep the result under DEEPSERVE_HOME keyed by host name and CPU model (`measured_host()` reuses it).

- Memory bandwidth: copies of an array far larger than the caches, split over one thread per core (NumPy releases
  the GIL while copying), counted as bytes read plus bytes written, best of several repeats (STREAM's "copy").
- FLOP rate: square matrix multiplies through NumPy's BLAS in float32, and, where torch is installed, PyTorch's bf16
  linear layer on prefill-shaped operands (512 tokens, 512 in, 1,024 out): the path vLLM's CPU build takes for a bf16
  model on a CPU where oneDNN has no bf16 matmul (it falls back to torch's linear), and a fair stand-in where it has.
  `engine_gflops` is that rate; it is what the planner uses for vLLM's CPU build. Measured on a 2-core AVX2 machine:
  13-35 GFLOP/s for the bf16 linear (loaded to quiet) against 53-166 for NumPy's fp32 (square bf16 `a @ b` ran at
  2); vLLM's prefill of the tiny model runs near the linear's loaded rate, far from fp32's, but does not speed up
  as the linear does on a quiet machine (docs/PLANNING.md section 8).
- Whether the CPU has bf16 units (AVX512-BF16 or AMX), recorded for the reader.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from deepserve.config import deepserve_home

COPY_BYTES = 512 * 1024**2  # per array; far beyond any CPU cache
MATMUL_SIZE = 1024
BF16_LINEAR_SHAPE = (512, 512, 1024)  # tokens, in features, out features: a prefill chunk through a projection
REPEATS = 5
FORMAT = "deepserve-host/3"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class HostMeasurement:
    host: str
    cpu_model: str
    cores: int
    memory_bandwidth_gb_s: float  # copy bandwidth over all cores, bytes read + written per second / 1e9
    fp32_gflops: float  # NumPy BLAS float32 matmul, all cores
    bf16_gflops: float | None  # PyTorch's bf16 linear on prefill-shaped operands, all cores; None without torch
    measured_at: str
    native_bf16: bool | None = None  # the CPU has bf16 units (AVX512-BF16 or AMX); None when unknown
    format: str = FORMAT

    @property
    def engine_gflops(self) -> float:
        """The rate vLLM's CPU build computes a bf16 model at: PyTorch's bf16 linear where torch is installed (see
        the module's doc string for the measurement behind it), else the fp32 BLAS rate."""
        return self.bf16_gflops or self.fp32_gflops

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def physical_memory_gib() -> float:
    """Installed RAM in GiB (what the CPU engine's KV cache and weights share)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 1024**3
    except (ValueError, OSError, AttributeError):
        return 16.0  # sysconf names differ off Linux; the planner only needs an order of magnitude here


def host_key() -> str:
    return f"{socket.gethostname()}|{cpu_model()}|{os.cpu_count()}"


def cache_path() -> Path:
    return deepserve_home() / "host.json"


def measured_host(refresh: bool = False) -> HostMeasurement:
    """This machine's measurement: the stored one when it was made on this host, else a new one (a few seconds),
    stored for next time."""
    if not refresh:
        stored = _read_cached()
        if stored is not None:
            return stored
    measurement = measure_host()
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": host_key(), **measurement.to_json()}, indent=2))
    return measurement


def _read_cached() -> HostMeasurement | None:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != host_key() or data.get("format") != FORMAT:
        return None
    data.pop("key")
    try:
        return HostMeasurement(**data)
    except TypeError:
        return None


def measure_host() -> HostMeasurement:
    return HostMeasurement(
        host=socket.gethostname(),
        cpu_model=cpu_model(),
        cores=os.cpu_count() or 1,
        memory_bandwidth_gb_s=round(copy_bandwidth_gb_s(), 2),
        fp32_gflops=round(numpy_matmul_gflops(), 1),
        bf16_gflops=_rounded(torch_bf16_matmul_gflops()),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        native_bf16=bool(cpu_flags() & set(BF16_CPU_FLAGS)) if Path("/proc/cpuinfo").is_file() else None,
    )


def copy_bandwidth_gb_s(nbytes: int = COPY_BYTES, repeats: int = REPEATS) -> float:
    threads = os.cpu_count() or 1
    source = np.ones(nbytes // 8, dtype=np.float64)
    target = np.empty_like(source)
    bounds = np.linspace(0, source.size, threads + 1, dtype=np.int64)
    chunks = [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

    def copy(chunk: tuple[int, int]) -> None:
        np.copyto(target[chunk[0] : chunk[1]], source[chunk[0] : chunk[1]])

    best_s = float("inf")
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in range(repeats):
            started = time.perf_counter()
            list(pool.map(copy, chunks))
            best_s = min(best_s, time.perf_counter() - started)
    return 2 * source.nbytes / best_s / 1e9


def numpy_matmul_gflops(size: int = MATMUL_SIZE, repeats: int = REPEATS) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    a @ b  # warm-up: BLAS thread pool start
    best_s = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best_s / 1e9


def torch_bf16_matmul_gflops(shape: tuple[int, int, int] = BF16_LINEAR_SHAPE, repeats: int = REPEATS) -> float | None:
    """PyTorch's bf16 linear layer, tokens x in_features -> out_features (SHAPE), best of REPEATS."""
    try:
        import torch
    except ImportError:
        return None
    tokens, features_in, features_out = shape
    x = torch.randn(tokens, features_in, dtype=torch.bfloat16)
    w = torch.randn(features_out, features_in, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, w)
    best_s = min(_timed(lambda: torch.nn.functional.linear(x, w)) for _ in range(repeats))
    return 2 * tokens * features_in * features_out / best_s / 1e9


def _timed(work: object) -> float:
    assert callable(work)
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
