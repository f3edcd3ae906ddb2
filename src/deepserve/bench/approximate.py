"""Prompt lengths by a stated approximation, for a server that cannot count tokens for us (no /tokenize: SGLang's
OpenAI server, TensorRT-LLM's, a hosted API) when no local tokenizer is given.

The approximation: one token per word, and prompt text made only of common English words, each of which the
byte-pair vocabularies of current models (32K tokens and more) hold as a single token after a space. Before the run
it is checked against the server itself: two prompts of 64 and 192 words are sent (one output token each) and the
server's `usage.prompt_tokens` says how many tokens it counted per word and how many the template (BOS, chat markers)
adds; the template's tokens are then counted exactly, and the measured tokens per word are stated beside the result
(1.00 means exact; 1.05, prompts about 5% longer than asked). What the server actually processed is in every
record either way (`usage.prompt_tokens`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from deepserve.bench.types import ChatMessages

PROBE_WORDS = (64, 192)
PROBE_TIMEOUT_S = 60.0
EXTRA_MESSAGE_TOKENS = 4  # a rough allowance for each chat message after the first (role markers)
TEMPLATE_ID = -1  # the ids of the template's tokens: no word has a negative id
_UNITS = re.compile(r"\s*\S+")

_WORDS = (
    "the of and to in is was that for on it with as he be by at his this had not are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three states himself few house use during without again "
    "place american around however home small found thought went say part once general high upon school every "
    "does got united left number course war until always away something fact though water less public put think "
    "almost hand enough far took head yet government system better set told nothing night end why called find "
    "look going asked later point knew city next program business give group toward young days let room president "
    "side social given present several order national possible rather second face per among form important often "
    "things early white case john become large big need four within felt along children saw best church ever "
    "least power development light thing seemed family interest want members mind country area others done turned "
    "although open god service certain kind problem began different door thus help sense means whole matter "
    "perhaps itself york times law human line above name example action company hands local show whether five "
    "history gave today either act feet across taken past quite anything seen having death week experience body "
    "word half really field am car words already themselves information tell together college shall money period "
    "held keep sure real probably free seems political cannot behind miss question air office making brought "
    "whose special heard major problems ago became federal moment study available known result street economic "
    "boy position reason change south board individual job society areas west close turn love community true "
    "court force full seem policy voice million control land age wife low girl morning table book art black late "
    "idea hard short test sun fire food music road plan rate able cost data deal future game green hear hold hope "
    "hour kept lead level list lot main meet mean month move note paper pay play press price rest role save sea "
    "seven ship six size sort stand star start stay step stop story talk ten term top town tree type view wait "
    "walk wall watch wind wish yes "
)
COMMON_WORDS: tuple[str, ...] = tuple(" " + word for word in _WORDS.split())


@dataclass(frozen=True)
class Calibration:
    """What the server counted for the probe prompts: tokens per word, and the template's tokens per prompt."""

    tokens_per_word: float | None  # None: the server reported no usage
    template_tokens: int
    note: str

    def to_json(self) -> dict[str, Any]:
        return {"tokens_per_word": self.tokens_per_word, "template_tokens": self.template_tokens, "note": self.note}


class ApproximateTokenCounter:
    """A word is a token (see the module doc); a prompt's tokens are its words plus the template's, as measured."""

    concurrent = False  # no round trips: prompt builds run in turn
    can_decode = True

    def __init__(self, calibration: Calibration, endpoint_url: str) -> None:
        self.calibration = calibration
        self.source = f"approximate:one token per word, checked against {endpoint_url}"
        self.server_check = f"approximate ({calibration.note})"
        self._ids: dict[str, int] = {}
        self._units: list[str] = []

    def encode(self, text: str) -> list[int]:
        return [self._id(unit) for unit in _UNITS.findall(text)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self._units[i] for i in ids if i >= 0)

    def count(self, text: str) -> int:
        return len(_UNITS.findall(text))

    def prompt_ids(self, prompt: str | ChatMessages) -> list[int]:
        template = [TEMPLATE_ID] * self.calibration.template_tokens
        if isinstance(prompt, str):
            return template + self.encode(prompt)
        ids = list(template)
        for number, message in enumerate(prompt):
            ids += [TEMPLATE_ID] * (EXTRA_MESSAGE_TOKENS if number else 0) + self.encode(
                str(message.get("content", ""))
            )
        return ids

    def vocab_pieces(self) -> list[str]:
        return list(COMMON_WORDS)

    def render_chat(self, messages: ChatMessages) -> None:
        return None  # no chat template here: messages go to the chat endpoint instead

    def _id(self, unit: str) -> int:
        if unit not in self._ids:
            self._ids[unit] = len(self._units)
            self._units.append(unit)
        return self._ids[unit]


def calibrate(endpoint_url: str, model: str, headers: dict[str, str], verify_tls: bool = True) -> Calibration:
    """Ask the server to count two prompts of common words (one output token each, not streamed) and read
    `usage.prompt_tokens`: the slope is its tokens per word, the rest the template's tokens."""
    chat = endpoint_url.rstrip("/").endswith("chat/completions")
    counts: list[int] = []
    try:
        with httpx.Client(timeout=PROBE_TIMEOUT_S, headers=headers, verify=verify_tls) as client:
            block = "".join(COMMON_WORDS[(7 * i) % len(COMMON_WORDS)] for i in range(PROBE_WORDS[0]))
            for n in PROBE_WORDS:  # the same block repeated: the difference is whole blocks, the rest the template
                text = block * (n // PROBE_WORDS[0])
                body: dict[str, Any] = {"model": model, "max_tokens": 1, "stream": False}
                body |= {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
                response = client.post(endpoint_url, json=body)
                usage = response.json().get("usage") if response.status_code == 200 else None
                if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
                    return Calibration(None, 0, f"not checked: {endpoint_url} reported no usage.prompt_tokens")
                counts.append(usage["prompt_tokens"])
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return Calibration(None, 0, f"not checked: {endpoint_url} failed ({exc.__class__.__name__})")
    low, high = PROBE_WORDS
    per_word = (counts[1] - counts[0]) / (high - low)
    template = max(0, round(counts[0] - per_word * low))
    note = (
        f"{per_word:.3f} server tokens per word and {template} template tokens, from the server's usage of "
        f"{low}- and {high}-word probes: prompts are about {per_word:.2f} times the lengths asked"
    )
    return Calibration(per_word, template, note)
