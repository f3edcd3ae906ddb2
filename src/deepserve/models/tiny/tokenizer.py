"""The tiny checkpoints' tokenizer: byte-level BPE without merges (one token per UTF-8 byte) plus DeepSeek's special
tokens, so every text round-trips and a prompt of N tokens is easy to build. Both tiny models (V3 and V4) share the
byte tokens and the leading specials; each adds the special tokens its own chat format uses."""

from __future__ import annotations

from typing import Any

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
_LEADING_SPECIALS = [BOS, EOS, PAD]
TINY_VOCAB_SIZE = 320  # 3 leading specials + 256 bytes + trailing specials + placeholders
BYTE_TOKEN_OFFSET = len(_LEADING_SPECIALS)  # byte b is token BYTE_TOKEN_OFFSET + b
TRAILING_START = BYTE_TOKEN_OFFSET + 256

# DeepSeek-V3's chat and tool-call specials (its tokenizer's, in its order).
V3_SPECIALS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜fim▁hole｜>",
    "<｜fim▁begin｜>",
    "<｜fim▁end｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]
# DeepSeek-V4's encoder (vllm/tokenizers/deepseek_v4_encoding.py, vLLM 0.32) writes these as single tokens; its tool
# calls are DSML text (`<｜DSML｜invoke name=...>`), not special tokens.
V4_SPECIALS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
]


def special_tokens(trailing: list[str] | None = None) -> list[tuple[int, str]]:
    """(id, text) of every special token: the leading three, then TRAILING (V3's by default), then placeholders up
    to the vocabulary size."""
    trailing = V3_SPECIALS if trailing is None else trailing
    placeholders = [f"<｜place▁holder▁no▁{i}｜>" for i in range(TINY_VOCAB_SIZE - TRAILING_START - len(trailing))]
    leading = list(enumerate(_LEADING_SPECIALS))
    return leading + [(TRAILING_START + i, tok) for i, tok in enumerate(trailing + placeholders)]


def special_token_id(text: str, trailing: list[str] | None = None) -> int:
    return next(i for i, tok in special_tokens(trailing) if tok == text)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-printable-character map, in byte order (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_json(trailing: list[str] | None = None) -> dict[str, Any]:
    specials = special_tokens(trailing)
    vocab = {tok: i for i, tok in specials}
    vocab.update({char: BYTE_TOKEN_OFFSET + b for b, char in enumerate(_byte_level_alphabet())})
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in specials
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    bos_ref = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos_ref, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                bos_ref,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_config(chat_template: str | None, model_max_length: int) -> dict[str, Any]:
    """CHAT_TEMPLATE None: the model has no Jinja template (DeepSeek-V4 ships a Python encoder instead)."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def special_tokens_map() -> dict[str, str]:
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
