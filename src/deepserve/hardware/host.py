"""This machine's own speed, measured by deepserve: memory bandwidth and matrix-multiply FLOP rate.

The planner's CPU profile and the report's "how close to the hardware limit" line need these two numbers for the
machine the engine runs on. Datasheets do not give them for an arbitrary (often virtual) CPU, so we measure them,
once, and keep the result under DEEPSERVE_HOME keyed by host name and CPU model (`measured_host()` reuses it).

One measurement is the median, rate by rate, of PROBES probes a pause apart. A virtual machine's rates change with
its neighbours: on the 2-core Xeon VM one probe of the bf16 linear read anywhere from 290 to 960 GFLOP/s over one
benchmark run, and a single probe stored for good priced every later plan from whichever spell it fell in
(docs/PLANNING.md section 8). The slowest and fastest probe of the linear are kept beside the median, so a reader
sees how steady the machine was.

What is measured is what vLLM's CPU worker gets, not the whole machine: its OpenMP threads are bound to the physical
cores of one NUMA node less the cores vLLM reserves for its scheduler process (one per local worker on x86 and Arm,
vllm/utils/ompmultiprocessing.py), so a 2-core machine computes its model on one core. Measured here with every core,
the bf16 rate doubled on a quiet machine (30 against 15 GFLOP/s on one thread) while the engine's prefill did not
change, and the planner priced prompts at half their cost (docs/PLANNING.md section 8).

- Memory bandwidth: copies of an array far larger than the caches, split over the engine's threads (NumPy releases
  the GIL while copying), counted as bytes read plus bytes written, best of several repeats (STREAM's "copy").
- FLOP rate: PyTorch's bf16 linear layer on prefill-shaped operands (512 tokens, 512 in, 1,024 out) on the engine's
  threads: the path vLLM's CPU build takes for a bf16 model on a CPU where oneDNN has no bf16 matmul (it falls back
  to torch's linear), and a fair stand-in where it has. `engine_gflops` is that rate; it is what the planner uses for
  vLLM's CPU build, whose prompts reach a fitted share of it outside attention (the `vllm-cpu` profile's
  prefill_efficiency: 0.39 on the 2-core Xeon with AMX, where the tiny model's narrow GEMMs and the absorbed MLA
  projections run far below one 512 x 512 x 1,024 linear). NumPy's fp32 BLAS rate on every core is recorded beside
  it for the reader, and stands in where torch is not installed. Measured on a 2-core AVX2 machine: 15 GFLOP/s for
  the bf16 linear on one thread against 53-166 for NumPy's fp32 (square bf16 `a @ b` ran at 2).
- Attention rate: a causal prompt of 512 tokens and 8 heads at DeepSeek's per-head sizes, on the engine's threads,
  through the kernel vLLM's CPU build prefills MLA with, counted in the planner's FLOPs (the decompressed form:
  query and key 192, value 128 per head and position; causal FLOPs count half the score matrix):
  - on an x86 CPU with AMX tiles, vLLM 0.32 picks its AMX_MLA backend (vllm/platforms/cpu.py), which attends in the
    latent space (512 + 64 per position, one key shared by the heads) with its `extend_attention_cpu` kernel; we
    time that kernel where vLLM is installed. Measured on a 2-core Xeon with AMX: 110 GFLOP/s in the planner's count
    against 23 for PyTorch's SDPA on the same thread, so the SDPA figure priced a 512-token prompt of the tiny model
    about 50 ms too slow;
  - elsewhere vLLM's reference CPU MLA backend prefills with PyTorch's scaled-dot-product attention
    (vllm/v1/attention/backends/mla/cpu_mla.py), which we time. Measured on a 2-core AMD machine without bf16 units:
    19-26 GFLOP/s on one thread, up to 1.7 times the linear's; charged at the linear's rate, a 512-token prompt of
    the tiny model was predicted about 30 ms slower than its attention runs.
- Decode attention, on an x86 CPU with AMX tiles where vLLM is installed: its AMX MLA decode kernel
  (`decode_attention_cpu`) over 64 sequences of 512 cached positions, twice. With 4 query heads (the tiny
  models') the kernel is bound by the positions it walks, not by FLOPs: recorded as the cache bytes it reads per
  second (3-7 GB/s on the 2-core Xeon against 20-24 for a plain copy). With 128 heads (DeepSeek's) it is bound by
  FLOPs: recorded in the planner's absorbed count ((512 + 64) + 512 per head and position), 120-200 GFLOP/s there.
  The planner charges a decode step the larger of the two (plan/kernels.py); charged at the copy bandwidth, a step
  of 64 sequences of the tiny model at 576 positions was priced at 9 ms where the kernel took 33.
  Elsewhere, where vLLM is installed, the same two figures for the kernel its reference CPU MLA backend decodes with
  (`mla_decode_kvcache`, csrc/cpu/mla_decode.cpp; 16-position blocks). Measured on a 2-core AMD EPYC with
  AVX512-BF16 (2026-11-29): 3.1-4.0 GB/s of cache at 4 heads against 24-28 for a copy (about 300 ns a position
  and layer), 35-47 GFLOP/s at 128; charged at the copy bandwidth, the CPU profile predicted its decode steps at
  512-token prompts and 16-64 clients a quarter too fast (docs/PLANNING.md section 8).
- Whether the CPU has bf16 units (AVX512-BF16 or AMX) and AMX tiles: the latter decide vLLM's MLA backend, and with
  it whether prompts are chunked (engines/vllm.py, `cpu_runs_prompts_whole`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from deepserve.config import deepserve_home

COPY_BYTES = 512 * 1024**2  # per array; far beyond any CPU cache
MATMUL_SIZE = 1024
BF16_LINEAR_SHAPE = (512, 512, 1024)  # tokens, in features, out features: a prefill chunk through a projection
PREFILL_ATTENTION_SHAPE = (8, 512, 192, 128)  # heads, prompt tokens, query/key and value sizes per head (DeepSeek's)
REPEATS = 5
PROBES = 3  # probes of the whole machine behind one measurement; their median is stored
PROBE_PAUSE_S = 1.0  # between probes, so that they sample more than one instant of a shared machine
RATES = (  # the measured speeds, each the median of the probes
    "memory_bandwidth_gb_s",
    "fp32_gflops",
    "bf16_gflops",
    "attention_gflops",
    "decode_attention_gb_s",
    "decode_attention_gflops",
)
FORMAT = "deepserve-host/6"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
AMX_CPU_FLAG = "amx_tile"
LATENT_SIZES = (512, 64)  # MLA's compressed KV per position: kv_lora_rank, qk_rope_head_dim (DeepSeek V2/V3)
REFERENCE_BLOCK = 16  # positions per cache block: the only size vLLM's reference CPU MLA decode kernel takes
# At 128 heads that kernel is bound by FLOPs: an eighth of the sequences gives the same rate in an eighth of the time
# (on the 2-core EPYC, alternating: 39.2 and 38.5 GFLOP/s at 64 sequences, 233-237 ms a call; 38.7 and 38.6 at 8).
REFERENCE_FLOP_BOUND_FRACTION = 8
VLLM_RESERVED_CORES_PER_WORKER = 1  # vLLM keeps a core per local CPU worker for its scheduler (x86, Arm)


@dataclass(frozen=True)
class HostMeasurement:
    host: str
    cpu_model: str
    cores: int
    memory_bandwidth_gb_s: float  # copy bandwidth on the engine's threads, bytes read + written per second / 1e9
    fp32_gflops: float  # NumPy BLAS float32 matmul, all cores
    bf16_gflops: float | None  # PyTorch's bf16 linear on prefill-shaped operands, engine's threads; None without torch
    measured_at: str
    native_bf16: bool | None = None  # the CPU has bf16 units (AVX512-BF16 or AMX); None when unknown
    engine_threads: int = 1  # the threads vLLM's CPU worker computes on (engine_threads())
    attention_gflops: float | None = None  # causal bf16 prompt attention on the engine's threads (planner's FLOPs)
    decode_attention_gb_s: float | None = None  # vLLM's AMX MLA decode kernel at 4 heads: cache bytes read per second
    decode_attention_gflops: float | None = None  # the same kernel at 128 heads, in the planner's (absorbed) FLOPs
    amx: bool | None = None  # x86 AMX tiles: vLLM's CPU build then runs MLA with its AMX kernels; None when unknown
    attention_kernel: str = "sdpa"  # what attention_gflops timed: "sdpa" (PyTorch) or "amx_mla" (vLLM's kernel)
    decode_attention_kernel: str = "amx_mla"  # what the decode rates timed: "amx_mla" or "cpu_mla" (the reference)
    probes: int = 1  # probes behind the rates above, each rate their median
    bf16_gflops_range: tuple[float, float] | None = None  # the slowest and fastest probe of the bf16 linear
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


def has_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, which vLLM's CPU build needs for its AMX MLA backend and prefix cache."""
    return AMX_CPU_FLAG in cpu_flags()


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
    if isinstance(data.get("bf16_gflops_range"), list):  # JSON keeps the pair as a list
        data["bf16_gflops_range"] = tuple(data["bf16_gflops_range"])
    try:
        return HostMeasurement(**data)
    except TypeError:
        return None


def measure_host(probes: int = PROBES, pause_s: float = PROBE_PAUSE_S) -> HostMeasurement:
    """PROBES probes of this machine, PAUSE_S apart, as one measurement: each rate the median of the probes'."""
    taken = []
    for index in range(probes):
        if index:
            time.sleep(pause_s)
        taken.append(probe_host())
    return median_measurement(taken)


def median_measurement(probes: Sequence[HostMeasurement]) -> HostMeasurement:
    """One measurement from several of the same machine: each rate the median of those measured, the rest (names,
    flags, time) from the first; `probes` counts them all."""
    rates: dict[str, Any] = {}
    for name in RATES:
        values = [getattr(probe, name) for probe in probes if getattr(probe, name) is not None]
        rates[name] = _rounded(statistics.median(values)) if values else None
    linear = [probe.bf16_gflops for probe in probes if probe.bf16_gflops is not None]
    spread = (min(linear), max(linear)) if len(linear) > 1 else None  # one probe has no spread
    count = sum(probe.probes for probe in probes)
    return replace(probes[0], **rates, probes=count, bf16_gflops_range=spread)


def probe_host() -> HostMeasurement:
    """One probe of each rate (a second or a few)."""
    threads = engine_threads()
    flags = cpu_flags() if Path("/proc/cpuinfo").is_file() else None  # None: no word from the OS either way
    amx = AMX_CPU_FLAG in flags if flags is not None else None
    attention = vllm_amx_prefill_attention_gflops(threads=threads) if amx else None
    kernel = "amx_mla" if attention else "sdpa"
    if amx is False:
        decode, decode_kernel = vllm_reference_decode_attention(threads=threads), "cpu_mla"
    else:  # an AMX host whose kernels fail stays unmeasured: vLLM does not run the reference kernel there
        decode, decode_kernel = vllm_amx_decode_attention(threads=threads) if attention else None, "amx_mla"
    attention = attention or torch_prefill_attention_gflops(threads=threads)
    return HostMeasurement(
        host=socket.gethostname(),
        cpu_model=cpu_model(),
        cores=os.cpu_count() or 1,
        memory_bandwidth_gb_s=round(copy_bandwidth_gb_s(threads=threads), 2),
        fp32_gflops=round(numpy_matmul_gflops(), 1),
        bf16_gflops=_rounded(torch_bf16_matmul_gflops(threads=threads)),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        native_bf16=bool(flags & set(BF16_CPU_FLAGS)) if flags is not None else None,
        engine_threads=threads,
        attention_gflops=_rounded(attention),
        amx=amx,
        attention_kernel=kernel,
        decode_attention_gb_s=_rounded(decode.cache_gb_s) if decode else None,
        decode_attention_gflops=_rounded(decode.gflops) if decode else None,
        decode_attention_kernel=decode_kernel,
    )


def engine_threads(
    cpuinfo: str | None = None, allowed: set[int] | None = None, node_cpus: set[int] | None = None
) -> int:
    """The OpenMP threads of one vLLM CPU worker bound automatically (VLLM_CPU_OMP_THREADS_BIND=auto): one logical
    CPU per physical core of its NUMA node, less the one core vLLM reserves for the scheduler process; at least one."""
    allowed = allowed if allowed is not None else _allowed_cpus()
    node = node_cpus if node_cpus is not None else _first_numa_node_cpus(min(allowed, default=0))
    cores = _physical_cores(cpuinfo if cpuinfo is not None else _read_cpuinfo(), allowed & node if node else allowed)
    return max(1, cores - VLLM_RESERVED_CORES_PER_WORKER)


def _physical_cores(cpuinfo: str, cpus: set[int]) -> int:
    """Distinct (package, core) pairs among CPUS in /proc/cpuinfo's text; the CPU count where it names no cores."""
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo.split("\n\n"):
        fields = dict(_field(line) for line in block.splitlines() if ":" in line)
        if fields.get("processor", "").isdigit() and int(fields["processor"]) in cpus and "core id" in fields:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or len(cpus)


def _field(line: str) -> tuple[str, str]:
    name, value = line.split(":", 1)
    return name.strip(), value.strip()


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _first_numa_node_cpus(cpu: int) -> set[int]:
    """The CPUs of the NUMA node holding CPU (empty where sysfs does not say, as off Linux)."""
    for cpulist in sorted(Path("/sys/devices/system/node").glob("node*/cpulist")):
        cpus = parse_cpu_list(cpulist.read_text())
        if cpu in cpus:
            return cpus
    return set()


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list (/sys/.../cpulist, cpuset.cpus): "0-3,8" is {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def copy_bandwidth_gb_s(nbytes: int = COPY_BYTES, repeats: int = REPEATS, threads: int | None = None) -> float:
    threads = threads or os.cpu_count() or 1
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


def torch_bf16_matmul_gflops(
    shape: tuple[int, int, int] = BF16_LINEAR_SHAPE, repeats: int = REPEATS, threads: int | None = None
) -> float | None:
    """PyTorch's bf16 linear layer, tokens x in_features -> out_features (SHAPE), on THREADS (torch's default where
    None), best of REPEATS."""
    try:
        import torch
    except ImportError:
        return None
    tokens, features_in, features_out = shape
    x = torch.randn(tokens, features_in, dtype=torch.bfloat16)
    w = torch.randn(features_out, features_in, dtype=torch.bfloat16)
    with _torch_threads(torch, threads):
        torch.nn.functional.linear(x, w)
        best_s = min(_timed(lambda: torch.nn.functional.linear(x, w)) for _ in range(repeats))
    return 2 * tokens * features_in * features_out / best_s / 1e9


def torch_prefill_attention_gflops(
    shape: tuple[int, int, int, int] = PREFILL_ATTENTION_SHAPE, repeats: int = REPEATS, threads: int | None = None
) -> float | None:
    """PyTorch's causal scaled-dot-product attention over one prompt (SHAPE: heads, tokens, query/key size, value
    size) on THREADS, best of REPEATS; FLOPs of the causal half of the scores and of the weighted values."""
    try:
        import torch
    except ImportError:
        return None
    heads, tokens, qk_size, v_size = shape
    q = torch.randn(1, heads, tokens, qk_size, dtype=torch.bfloat16)
    k = torch.randn(1, heads, tokens, qk_size, dtype=torch.bfloat16)
    v = torch.randn(1, heads, tokens, v_size, dtype=torch.bfloat16)

    def attend() -> object:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    with _torch_threads(torch, threads):
        attend()
        best_s = min(_timed(attend) for _ in range(repeats))
    return 2 * heads * tokens * (tokens / 2) * (qk_size + v_size) / best_s / 1e9


def vllm_amx_prefill_attention_gflops(
    shape: tuple[int, int, int, int] = PREFILL_ATTENTION_SHAPE, repeats: int = REPEATS, threads: int | None = None
) -> float | None:
    """vLLM's AMX MLA prefill kernel (`extend_attention_cpu`, what its AMX_MLA backend calls) over one prompt of
    SHAPE's heads and tokens in MLA's latent space, on THREADS, best of REPEATS; its rate in the FLOPs the planner
    counts for the decompressed form (SHAPE's query/key and value sizes), so that it compares with SDPA's. None where
    vLLM's CPU build or the CPU's AMX is missing."""
    ops = _vllm_amx_ops()
    if ops is None:
        return None
    import torch

    heads, tokens, qk_size, v_size = shape
    latent, rope = LATENT_SIZES
    query = torch.randn(tokens, heads, latent + rope, dtype=torch.bfloat16)
    cache = torch.randn(tokens, 1, latent + rope, dtype=torch.bfloat16)
    out = torch.empty(tokens, heads, latent, dtype=torch.bfloat16)
    positions = torch.arange(tokens, dtype=torch.int64).unsqueeze(0)  # request 0's token i sits in row i
    one = torch.zeros(1, dtype=torch.int64)
    length = torch.tensor([tokens], dtype=torch.int64)

    def attend() -> None:
        ops.cpu_mla_extend(  # new tokens, cache, paging of one request that is all prompt; no cap, window or sinks
            query, cache, cache[..., :latent], out, cache, cache[..., :latent], positions, one, length, length,
            one * 0, tokens, (latent + rope) ** -0.5, 0.0, False, 0, None, None, None,
        )  # fmt: skip

    try:
        with _torch_threads(torch, threads):
            attend()
            best_s = min(_timed(attend) for _ in range(repeats))
    except (RuntimeError, AttributeError):  # a build without the AMX kernels, or a CPU that refuses the tiles
        return None
    return 2 * heads * tokens * (tokens / 2) * (qk_size + v_size) / best_s / 1e9


@dataclass(frozen=True)
class DecodeAttentionRates:
    cache_gb_s: float  # few heads: the latent cache bytes the kernel walks per second
    gflops: float  # many heads: the planner's absorbed FLOPs per second


def vllm_amx_decode_attention(
    sequences: int = 64, positions: int = 512, heads: tuple[int, int] = (4, 128), threads: int | None = None
) -> DecodeAttentionRates | None:
    """vLLM's AMX MLA decode kernel (`decode_attention_cpu`, what its AMX_MLA backend calls for decoding sequences)
    over SEQUENCES of POSITIONS cached tokens, on THREADS, at the two head counts of HEADS (see the module's doc
    string); None where vLLM's CPU build or the CPU's AMX is missing."""
    ops = _vllm_amx_ops()
    if ops is None:
        return None
    try:
        few = _amx_decode_seconds(ops, sequences, positions, heads[0], threads)
        many = _amx_decode_seconds(ops, sequences, positions, heads[1], threads)
    except (RuntimeError, AttributeError):  # a build without the AMX kernels
        return None
    return _decode_rates(sequences, positions, heads[1], few, many)


def vllm_reference_decode_attention(
    sequences: int = 64, positions: int = 512, heads: tuple[int, int] = (4, 128), threads: int | None = None
) -> DecodeAttentionRates | None:
    """The decode kernel of vLLM's reference CPU MLA backend (`mla_decode_kvcache`, what it decodes with where the
    CPU has no AMX tiles), over the same sequences and head counts as the AMX one; None where vLLM's CPU build does
    not import or has no such kernel."""
    try:
        from vllm import _custom_ops as ops
    except Exception:  # vLLM's import fails in many ways off its CPU build; any of them means no kernel to time
        return None
    flop_bound = max(1, sequences // REFERENCE_FLOP_BOUND_FRACTION)
    try:
        few = _reference_decode_seconds(ops, sequences, positions, heads[0], threads)
        many = _reference_decode_seconds(ops, flop_bound, positions, heads[1], threads)
    except (RuntimeError, AttributeError):  # a build without the kernel
        return None
    return _decode_rates(sequences, positions, heads[1], few, many, flop_bound)


def _decode_rates(
    sequences: int, positions: int, many_heads: int, few_s: float, many_s: float, many_sequences: int | None = None
) -> DecodeAttentionRates:
    """The cache rate of SEQUENCES at few heads in FEW_S, the FLOP rate of MANY_SEQUENCES (default: as many) at
    MANY_HEADS in MANY_S."""
    latent, rope = LATENT_SIZES
    cache_bytes = sequences * positions * (latent + rope) * 2  # bf16
    flops = 2 * (many_sequences or sequences) * positions * many_heads * (latent + rope + latent)
    return DecodeAttentionRates(cache_bytes / few_s / 1e9, flops / many_s / 1e9)


def _vllm_amx_ops() -> Any:
    """vLLM's custom operators where this CPU has AMX tiles and vLLM's CPU build imports; else None (its AMX
    kernels must not run on a CPU without the tiles)."""
    if not has_amx_tiles():
        return None
    try:
        import torch
        from vllm import _custom_ops as ops
    except Exception:  # vLLM's import fails in many ways off its CPU build; any of them means no kernel to time
        return None
    if not torch.cpu._is_amx_tile_supported():
        return None
    # Linux hands a process the AMX tile state only on request: vLLM's MLA kernels ran without asking, but its MoE
    # kernel died of SIGILL, so ask before any of them runs.
    init = getattr(torch.cpu, "_init_amx", None)
    return ops if init is None or init() else None


def _amx_decode_seconds(ops: Any, sequences: int, positions: int, heads: int, threads: int | None) -> float:
    """Best of REPEATS of one decode step's attention for one layer; the split of each sequence's positions over
    partial results is the backend's (amx_mla.py's _compute_num_kv_splits, here for one thread per core)."""
    import torch

    latent, rope = LATENT_SIZES
    splits = 1
    while splits < positions // 512:
        splits *= 2
    query = torch.randn(sequences, heads, latent + rope, dtype=torch.bfloat16)
    cache = torch.randn(sequences * positions, 1, latent + rope, dtype=torch.bfloat16)
    out = torch.zeros(sequences, heads, latent, dtype=torch.bfloat16)
    partial = torch.zeros(sequences, heads, splits, latent + 1, dtype=torch.float32)
    rows = torch.arange(sequences * positions, dtype=torch.int64).view(sequences, positions)
    lengths = torch.full((sequences,), positions, dtype=torch.int64)

    def attend() -> None:
        ops.cpu_mla_decode(  # the cache already holds the new tokens (no key/value to write); no cap or window
            query, cache, cache[..., :latent], out, None, None, None, partial, rows,
            torch.arange(sequences, dtype=torch.int64), lengths, (latent + rope) ** -0.5, 0.0, False, 0, None, None,
        )  # fmt: skip

    with _torch_threads(torch, threads):
        attend()
        return min(_timed(attend) for _ in range(REPEATS))


def _reference_decode_seconds(ops: Any, sequences: int, positions: int, heads: int, threads: int | None) -> float:
    """Best of REPEATS of one decode step's attention for one layer through the reference kernel, its cache in
    blocks of REFERENCE_BLOCK positions as the CPU platform sets them for MLA."""
    import torch

    latent, rope = LATENT_SIZES
    blocks = -(-positions // REFERENCE_BLOCK)
    cache = torch.randn(sequences * blocks, REFERENCE_BLOCK, latent + rope, dtype=torch.bfloat16)
    query = torch.randn(sequences, heads, latent + rope, dtype=torch.bfloat16)
    out = torch.zeros(sequences, heads, latent, dtype=torch.bfloat16)
    tables = torch.arange(sequences * blocks, dtype=torch.int32).view(sequences, blocks)
    lengths = torch.full((sequences,), positions, dtype=torch.int32)

    def attend() -> None:
        ops.mla_decode_kvcache_cpu(out, query, cache, (latent + rope) ** -0.5, tables, lengths)

    with _torch_threads(torch, threads):
        attend()
        return min(_timed(attend) for _ in range(REPEATS))


@contextlib.contextmanager
def _torch_threads(torch: Any, threads: int | None) -> Iterator[None]:
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        yield
    finally:
        torch.set_num_threads(default_threads)


def _timed(work: object) -> float:
    assert callable(work)
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
