"""Tiny V3 checkpoints whose next token is known in advance, so that speculative decoding can be tested for real.

The main model is edited into a Markov chain over the 256 byte tokens: every attention output and feed-forward
down-projection is zero, so the last hidden state is the current token's embedding, and the output head is built so
that from byte b the logits are exactly SUCCESSOR_LOGITS at b+1, b+2, b+3 (mod 256) and 0 everywhere else. The byte
embeddings are the rows of a scaled random orthogonal matrix (256 bytes, hidden size 256), which makes the logits
exact, not approximate. So greedy decoding counts up byte by byte (`abcdef…`), and sampling at temperature 1 draws
each step's increment (1, 2 or 3) independently with the probabilities `successor_probabilities()` gives. Special
tokens share the embedding of byte `a`, so a chat (whose prompt ends in `<｜Assistant｜>`) continues as after `a`.

The MTP layer is edited the same way: its attention and feed-forward outputs are zero, its head is the main model's
(vLLM 0.32 shares the main model's head with it anyway, vllm/v1/spec_decode/llm_base_proposer.py:1553), and its
projection ignores the main model's hidden state and passes the token's embedding on (`full`: every greedy draft is
what the main model then predicts, so all are accepted) or, for the bytes in `partial_draft_misses()`, the next
byte's embedding (`partial`: the draft after such a byte is b+2 where the main model predicts b+1, so it is
rejected; the rest are accepted, at a rate `simulate_greedy_speculation` predicts exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from deepserve.models.tiny.tokenizer import BYTE_TOKEN_OFFSET

if TYPE_CHECKING:
    import numpy as np

MtpVariant = Literal["none", "full", "partial"]
MTP_VARIANTS: tuple[MtpVariant, ...] = ("none", "full", "partial")
NUM_BYTES = 256
# Logits of b+1, b+2, b+3 after byte b: exact in bf16 (the engine computes logits in the model's dtype), and high
# enough that the other 317 tokens (logit 0) together get about 2e-5 of the probability.
SUCCESSOR_LOGITS = (16.0, 15.25, 14.25)
START_BYTE = ord("a")  # what special tokens behave as
# In the partial variant, bytes b with b % 5 == 0 draft b+2 instead of b+1. 5 is coprime to the stride of a fully
# accepted step for 1, 2 and 3 drafts (2, 3, 4 bytes), so no K locks into always or never hitting a miss: greedy
# acceptance settles near 2/3 (K=1), 3/4 (K=2) and 1/2 (K=3).
PARTIAL_MISS_MODULUS = 5


def successor_probabilities() -> tuple[float, ...]:
    """P(next = b+k | b) for k = 1, 2, 3 at temperature 1, ignoring the ~2e-5 left to the other tokens."""
    import math

    weights = [math.exp(logit - SUCCESSOR_LOGITS[0]) for logit in SUCCESSOR_LOGITS]
    return tuple(w / sum(weights) for w in weights)


def partial_draft_misses() -> frozenset[int]:
    """Bytes after which the partial variant's MTP layer drafts another token than the main model predicts."""
    return frozenset(b for b in range(NUM_BYTES) if b % PARTIAL_MISS_MODULUS == 0)


def byte_token(byte: int) -> int:
    return BYTE_TOKEN_OFFSET + byte % NUM_BYTES


def greedy_next(token: int) -> int:
    """The main model's greedy next token (a special token behaves as byte START_BYTE)."""
    return byte_token(_as_byte(token) + 1)


def greedy_draft(token: int, variant: MtpVariant) -> int:
    """The MTP layer's greedy draft after TOKEN."""
    byte = _as_byte(token)
    step = 2 if variant == "partial" and byte in partial_draft_misses() else 1
    return byte_token(byte + step)


def _as_byte(token: int) -> int:
    byte = token - BYTE_TOKEN_OFFSET
    return byte if 0 <= byte < NUM_BYTES else START_BYTE


# ---- what greedy speculative decoding does on these models ---------------------------------------------------------


@dataclass(frozen=True)
class SpeculationCounts:
    """What vLLM's spec-decode counters count, for one request."""

    drafts: int  # verification steps that carried drafts
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    tokens_per_step: tuple[int, ...]  # tokens each engine step emitted, the first (the prompt's) included

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def simulate_greedy_speculation(
    last_prompt_token: int, output_tokens: int, num_speculative_tokens: int, variant: MtpVariant
) -> SpeculationCounts:
    """Greedy decoding with K=NUM_SPECULATIVE_TOKENS MTP drafts per step, as vLLM runs it: the prompt's step emits
    one token, each later step verifies the K drafts made from the last token, emits the accepted ones plus the
    main model's next token, and ends the request after OUTPUT_TOKENS. (How vLLM trims drafts in the last step
    may differ by a step; compare rates, not exact counts.)"""
    k = num_speculative_tokens
    output = [greedy_next(last_prompt_token)]
    steps, per_position = [1], [0] * k
    drafts = 0
    while len(output) < output_tokens:
        proposed = _drafts(output[-1], k, lambda token: greedy_draft(token, variant))
        accepted = _accepted_prefix(output[-1], proposed)
        for position in range(accepted):
            per_position[position] += 1
        emitted = [*proposed[:accepted], greedy_next(proposed[accepted - 1] if accepted else output[-1])]
        emitted = emitted[: output_tokens - len(output)]
        drafts += 1
        output += emitted
        steps.append(len(emitted))
    return SpeculationCounts(drafts, drafts * k, sum(per_position), tuple(per_position), tuple(steps))


def _drafts(token: int, k: int, draft: Callable[[int], int]) -> list[int]:
    proposed = []
    for _ in range(k):
        token = draft(token)
        proposed.append(token)
    return proposed


def _accepted_prefix(token: int, proposed: list[int]) -> int:
    accepted = 0
    for draft in proposed:
        if greedy_next(token) != draft:
            break
        accepted, token = accepted + 1, draft
    return accepted


# ---- the weights ----------------------------------------------------------------------------------------------------


def apply_markov_weights(
    tensors: dict[str, np.ndarray], config: dict[str, Any], variant: MtpVariant, seed: int
) -> None:
    """Edit the seeded random V3 weights (TENSORS, bf16 bit patterns) in place into the chain described above."""
    import numpy as np

    from deepserve.models.safetensors_io import float32_to_bf16_bits

    hidden = config["hidden_size"]
    if hidden != NUM_BYTES:
        raise ValueError(f"the Markov tiny model needs hidden_size {NUM_BYTES} (one direction per byte), not {hidden}")
    embedding = _embedding(config["vocab_size"], hidden, seed)
    main_head = _head(embedding, _successor_logits(misses=frozenset()))
    updates = {"model.embed_tokens.weight": embedding, "lm_head.weight": main_head}
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            updates[name] = np.zeros(tensors[name].shape, dtype=np.float32)
    updates.update(_mtp_updates(config, embedding, main_head, variant))
    for name, value in updates.items():
        tensors[name] = float32_to_bf16_bits(value)


def _embedding(vocab: int, hidden: int, seed: int) -> np.ndarray:
    """Byte rows: a random orthogonal basis scaled to RMS 1 (RMSNorm leaves them as they are); other rows: byte
    `a`'s."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    basis, _ = np.linalg.qr(rng.standard_normal((hidden, hidden)))
    embedding = np.empty((vocab, hidden), dtype=np.float32)
    embedding[:] = basis[START_BYTE] * np.sqrt(hidden)
    embedding[BYTE_TOKEN_OFFSET : BYTE_TOKEN_OFFSET + NUM_BYTES] = basis * np.sqrt(hidden)
    return embedding


def _successor_logits(misses: frozenset[int]) -> np.ndarray:
    """[from byte, to byte] logits; bytes in MISSES swap their first two successors."""
    import numpy as np

    logits = np.zeros((NUM_BYTES, NUM_BYTES), dtype=np.float64)
    for byte in range(NUM_BYTES):
        order = (2, 1, 3) if byte in misses else (1, 2, 3)
        for logit, step in zip(SUCCESSOR_LOGITS, order, strict=True):
            logits[byte, (byte + step) % NUM_BYTES] = logit
    return logits


def _head(embedding: np.ndarray, byte_logits: np.ndarray) -> np.ndarray:
    """Output rows so that head @ embedding[b] == byte_logits[b] (exactly, the byte embeddings being orthogonal)."""
    import numpy as np

    bytes_ = embedding[BYTE_TOKEN_OFFSET : BYTE_TOKEN_OFFSET + NUM_BYTES].astype(np.float64)
    head = np.zeros(embedding.shape, dtype=np.float32)
    squared_norm = embedding.shape[1]  # each byte row has RMS 1
    head[BYTE_TOKEN_OFFSET : BYTE_TOKEN_OFFSET + NUM_BYTES] = (byte_logits.T @ bytes_) / squared_norm
    return head


def _mtp_updates(
    config: dict[str, Any], embedding: np.ndarray, main_head: np.ndarray, variant: MtpVariant
) -> dict[str, np.ndarray]:
    import numpy as np

    hidden = config["hidden_size"]
    misses = partial_draft_misses() if variant == "partial" else frozenset()
    # [embedding | hidden state] -> hidden: the embedding mapped as below; the main model's state ignored
    projection = np.concatenate([_draft_map(embedding, misses), np.zeros((hidden, hidden))], axis=1)
    updates: dict[str, np.ndarray] = {}
    for layer in range(config["num_hidden_layers"], config["num_hidden_layers"] + config["num_nextn_predict_layers"]):
        prefix = f"model.layers.{layer}."
        updates.update(
            {
                prefix + "embed_tokens.weight": embedding,
                prefix + "eh_proj.weight": projection.astype(np.float32),
                prefix + "shared_head.head.weight": main_head,
            }
        )
    return updates


def _draft_map(embedding: np.ndarray, misses: frozenset[int]) -> np.ndarray:
    """The linear map that sends byte b's embedding to byte b+1's for b in MISSES and leaves the others as they are
    (exact: the byte embeddings are an orthogonal basis)."""
    import numpy as np

    if not misses:
        return np.eye(embedding.shape[1])
    bytes_ = embedding[BYTE_TOKEN_OFFSET : BYTE_TOKEN_OFFSET + NUM_BYTES].astype(np.float64)
    targets = bytes_[[(b + 1) % NUM_BYTES if b in misses else b for b in range(NUM_BYTES)]]
    return np.asarray(targets.T @ bytes_ / embedding.shape[1])
