"""Counting tokens the way the server does: a local Hugging Face tokenizer, or the server's own /tokenize.

Two kinds of count matter to a benchmark and they differ by the tokens the server adds:
- `encode`/`count`: the tokens of a piece of text on its own, nothing added (how long a generated reply is);
- `prompt_ids`: what the server actually processes for a prompt: the BOS a completion prompt gets, or the whole
  chat template around chat messages. This is what "input length" means everywhere in `deepserve bench`, and it is
  the number the server reports as `usage.prompt_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx

from deepserve.bench.types import ChatMessages
from deepserve.errors import ConfigError, DeepserveError

TOKENIZE_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 5.0
LOCAL_TOKENIZER_MODES = ("auto", "hf")  # vLLM's modes that are a plain Hugging Face tokenizer


@dataclass(frozen=True)
class TokenizerOptions:
    """vLLM's tokenizer flags: --served-model-name (the name the server's /tokenize knows), --tokenizer-mode,
    --trust-remote-code, --skip-tokenizer-init (no local tokenizer: the server's counts only)."""

    served_model: str | None = None
    mode: str = "auto"
    trust_remote_code: bool = False
    server_only: bool = False
    verify_tls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # --chat-template-kwargs: chat prompts are measured with them
    endpoint_url: str | None = None  # the generation endpoint: checks an approximate count against the server's usage
    exact_lengths: bool = False  # --exact-prompt-lengths: no approximation, an error instead


class TokenizerError(DeepserveError):
    """No way to count tokens, or the tokenizer failed on an input."""


@runtime_checkable
class TokenCounter(Protocol):
    """Tokenization that a workload and the metrics share. `source` says which tokenizer, for the results."""

    source: str  # "local:/path/to/tokenizer" or "server:http://host:port/tokenize"

    @property
    def concurrent(self) -> bool:
        """Whether calls may overlap (each is a round trip to the server): prompt builds then run in threads."""
        ...

    @property
    def can_decode(self) -> bool:
        """Whether ids turn back into text (a server without /detokenize cannot: prompts are then cut by words)."""
        ...

    @property
    def server_check(self) -> str | None:
        """How the counts were checked against the server's, for the results; None when not checked."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of TEXT alone, without BOS or any other special token added."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of IDS, special tokens kept, spaces exactly as tokenized."""
        ...

    def count(self, text: str) -> int:
        """len(encode(text)): e.g. the tokens of a generated reply."""
        ...

    def prompt_ids(self, prompt: str | ChatMessages) -> list[int]:
        """The ids the server processes for PROMPT: a text gets the tokenizer's special tokens (BOS); chat messages
        are rendered with the model's chat template and the generation prompt (`<｜Assistant｜>`)."""
        ...

    def vocab_pieces(self) -> list[str] | None:
        """Texts of single tokens that re-encode to themselves (for random prompts), or None if unknown."""
        ...

    def render_chat(self, messages: ChatMessages) -> str | None:
        """MESSAGES as one completion prompt with the model's chat template; None when this tokenizer has no
        template at hand (the server's and the approximation render nothing here)."""
        ...


def load_token_counter(
    tokenizer: str | None,
    base_url: str,
    model: str,
    api_key: str | None,
    options: TokenizerOptions | None = None,
) -> TokenCounter:
    """A local tokenizer directory when TOKENIZER is given or MODEL names a local directory, else the server's
    /tokenize and /detokenize (vLLM's). Checked here, before any work starts: the server's tokenizer must answer,
    and a local one must count like the server wherever the server can tell (see `check_against_server`)."""
    options = options or TokenizerOptions()
    if options.server_only and tokenizer:
        raise ConfigError("--skip-tokenizer-init loads no tokenizer: leave out --tokenizer, or that flag")
    served = options.served_model or model
    template = options.chat_template_kwargs
    path = (
        None if options.server_only else tokenizer or (model if model and Path(model).expanduser().is_dir() else None)
    )
    if path:
        local = LocalTokenCounter.load(path, options.mode, options.trust_remote_code, template)
        probe = ServerTokenCounter(
            base_url, served, api_key, probe=True, verify_tls=options.verify_tls, chat_template_kwargs=template
        )
        try:
            local.server_check = check_against_server(local, probe)
        finally:
            probe.close()
        return local
    counter = ServerTokenCounter(
        base_url, served, api_key, verify_tls=options.verify_tls, chat_template_kwargs=template
    )
    try:
        counter.check()
    except TokenizerError as exc:
        if options.server_only:
            raise TokenizerError(f"{exc}; --skip-tokenizer-init needs the server's /tokenize to count tokens") from exc
        return _without_server_tokenizer(exc, model, served, api_key, options)
    counter.check_decode()
    return counter


def _without_server_tokenizer(
    why: TokenizerError, model: str, served: str, api_key: str | None, options: TokenizerOptions
) -> TokenCounter:
    """No /tokenize and no local tokenizer: deepserve's own tiny model's tokenizer (written here byte for byte), else
    the stated approximation (approximate.py), unless exact lengths were required."""
    tiny_dir = _tiny_tokenizer_dir(model)
    if tiny_dir is not None:
        local = LocalTokenCounter.load(str(tiny_dir), chat_template_kwargs=options.chat_template_kwargs)
        local.server_check = f"unverified ({why}); deepserve's tiny model, whose tokenizer it writes byte for byte"
        return local
    if options.exact_lengths or options.endpoint_url is None:
        raise TokenizerError(
            f"{why}; pass --tokenizer DIR (a local tokenizer directory) for exact prompt lengths, or leave out "
            "--exact-prompt-lengths to run with approximate ones (one token per common English word, checked against "
            "the server's usage)"
        ) from why
    from deepserve.bench.approximate import ApproximateTokenCounter, calibrate

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    calibration = calibrate(options.endpoint_url, served, headers, options.verify_tls)
    counter = ApproximateTokenCounter(calibration, options.endpoint_url)
    counter.server_check = f"approximate: the server cannot count tokens ({why}); {calibration.note}"
    return counter


def counting_method(counter: TokenCounter) -> dict[str, Any]:
    """How the run's prompt lengths were counted, for the results and the console: exactly with the server's own
    tokenizer (with or without its /detokenize), exactly with a local tokenizer, or by the stated approximation."""
    if isinstance(counter, ServerTokenCounter):
        method = "server" if counter.can_decode else "server-tokenize-only"
    elif isinstance(counter, LocalTokenCounter):
        method = "local"
    else:
        method = "approximate"
    return {
        "method": method,
        "exact": method != "approximate",
        "source": counter.source,
        "check": counter.server_check,
    }


def _tiny_tokenizer_dir(model: str) -> Path | None:
    """The tokenizer of deepserve's own tiny model when MODEL names it: generated here exactly as the server's was,
    so a front end without /tokenize (deepserve's gateway) does not stop a benchmark of it."""
    from deepserve.models.resolve import models_cache_dir
    from deepserve.models.tiny import ensure_tiny_model, is_tiny_model, tiny_model

    if not is_tiny_model(model):
        return None
    return ensure_tiny_model(models_cache_dir(), tiny_model(model).name)


# Texts whose token counts differ between tokenizers that load or add specials differently: spaces, digits,
# punctuation, non-ASCII, as a completion prompt and as a chat message.
CHECK_PROMPTS: list[str | ChatMessages] = [
    "Hello, world! deepserve measures 2048 tokens; naïve café ✓",
    [{"role": "user", "content": "How long is this prompt, in tokens?"}],
]


def check_against_server(local: TokenCounter, server: ServerTokenCounter) -> str:
    """Compare LOCAL with the server's own tokenizer on a few prompts: a mismatch (another tokenizer, a BOS added
    on one side only, another chat template) would make every prompt length wrong, so it is an error. A server
    without /tokenize cannot be asked: the result says the counts are unverified."""
    for prompt in CHECK_PROMPTS:
        try:
            remote_ids = server.prompt_ids(prompt)
        except TokenizerError as exc:
            return f"unverified ({exc})"
        local_ids = local.prompt_ids(prompt)
        if local_ids != remote_ids:
            where = next((i for i, (a, b) in enumerate(zip(local_ids, remote_ids, strict=False)) if a != b), None)
            where = min(len(local_ids), len(remote_ids)) if where is None else where
            raise TokenizerError(
                f"the tokenizer {local.source} does not count like the server ({server.source}): {prompt!r} is "
                f"{len(local_ids)} tokens here and {len(remote_ids)} there (first difference at token {where}); "
                "point --tokenizer at the served model's tokenizer, or leave it out to count with the server's"
            )
    return f"matches {server.source}"


class LocalTokenCounter:
    """A Hugging Face tokenizer loaded from a local directory (tokenizer.json, tokenizer_config.json); no network."""

    concurrent = False  # one process, one tokenizer: builds run in turn
    can_decode = True

    def __init__(self, hf_tokenizer: Any, path: str, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self._tok = hf_tokenizer
        self.source = f"local:{path}"
        self.server_check: str | None = None  # set by load_token_counter: "matches …" or "unverified (…)"
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # passed to the chat template, as the server
        self._pieces: list[str] | None = None

    @classmethod
    def load(
        cls,
        path: str,
        mode: str = "auto",
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> LocalTokenCounter:
        """MODE: vLLM's --tokenizer-mode; only the Hugging Face ones load here (the server applies its own mode
        when it counts). CHAT_TEMPLATE_KWARGS: passed to the chat template, as the server will."""
        if mode not in LOCAL_TOKENIZER_MODES:
            raise ConfigError(
                f"--tokenizer-mode {mode} needs vLLM's own tokenizer classes, which deepserve bench does not load; "
                "leave out --tokenizer (and a local --model directory) to count with the server's /tokenize, which "
                "uses the server's tokenizer mode, or pass --tokenizer-mode auto"
            )
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise ConfigError(
                f"tokenizer {path!r} is not a local directory; pass --tokenizer DIR with tokenizer.json "
                "(models are never downloaded), or leave it out to count with the server's /tokenize"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - transformers comes with vLLM
            raise TokenizerError(
                "a local tokenizer needs the `transformers` package: pip install transformers"
            ) from exc
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=trust_remote_code
            )
        except Exception as exc:
            raise TokenizerError(f"cannot load a tokenizer from {directory}: {exc}") from exc
        return cls(hf_tokenizer, str(directory.resolve()), chat_template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def prompt_ids(self, prompt: str | ChatMessages) -> list[int]:
        if isinstance(prompt, str):
            return list(self._tok(prompt, add_special_tokens=True)["input_ids"])
        # vLLM renders the template to text, then tokenizes it without adding special tokens (the template has them)
        return list(self._tok(self._render(prompt), add_special_tokens=False)["input_ids"])

    def render_chat(self, messages: ChatMessages) -> str:
        """MESSAGES as one completion prompt: the chat template's text without the leading BOS, which the server
        adds to every completion prompt itself (else the model would see two)."""
        rendered = self._render(messages)
        bos = getattr(self._tok, "bos_token", None)
        if bos and rendered.startswith(bos) and self.prompt_ids("")[:1] == [self._tok.bos_token_id]:
            rendered = rendered[len(bos) :]
        return rendered

    def _render(self, messages: ChatMessages) -> str:
        if not getattr(self._tok, "chat_template", None):
            raise TokenizerError(f"tokenizer {self.source} has no chat template; use the completions endpoint")
        return str(
            self._tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
        )

    def vocab_pieces(self) -> list[str]:
        if self._pieces is None:
            self._pieces = _stable_vocab_pieces(self._tok)
        return self._pieces


def _stable_vocab_pieces(hf_tokenizer: Any) -> list[str]:
    """Single vocabulary tokens whose text is printable ASCII and re-encodes to that same one token.

    ASCII keeps every cut between tokens a cut between characters (no half UTF-8 sequences); word-like pieces with
    a leading space are preferred where the vocabulary has enough of them, because a space starts a new
    pre-token in byte-level BPE, so neighbours rarely merge."""
    # added tokens (specials, reserved placeholders, chat markers) are control tokens, not text
    special = set(hf_tokenizer.all_special_ids) | set(hf_tokenizer.get_added_vocab().values())
    ids = [i for i in range(len(hf_tokenizer)) if i not in special]
    texts = hf_tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    candidates = [(i, t) for i, t in zip(ids, texts, strict=True) if t.isascii() and t.isprintable() and t.strip()]
    encoded = hf_tokenizer([t for _, t in candidates], add_special_tokens=False)["input_ids"]
    stable = [t for (i, t), e in zip(candidates, encoded, strict=True) if list(e) == [i]]
    words = [t for t in stable if t.startswith(" ") and t[1:].isalnum()]
    return sorted(words if len(words) >= 512 else stable)


class ServerTokenCounter:
    """The server's tokenizer over HTTP: vLLM's POST /tokenize and /detokenize (at the server root, not /v1)."""

    concurrent = True  # calls are HTTP round trips: prompt builds may overlap them (httpx.Client is thread-safe)
    can_decode = True  # False: the server has /tokenize but no /detokenize (check_decode); prompts are cut by words

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        transport: httpx.BaseTransport | None = None,
        probe: bool = False,
        verify_tls: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """TRANSPORT: httpx's, by default the network (a test's MockTransport answers in-process). PROBE: a short
        timeout, for a check that must not hold up a run whose server cannot answer. CHAT_TEMPLATE_KWARGS: sent with
        chat prompts, as with the requests."""
        self.root_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.source = f"server:{self.root_url}/tokenize"
        self.server_check = "is the server's"
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = PROBE_TIMEOUT_S if probe else TOKENIZE_TIMEOUT_S
        self._client = httpx.Client(timeout=timeout, headers=headers, verify=verify_tls, transport=transport)

    def check(self) -> None:
        """Fail fast when the server cannot tokenize for us (TokenizerError with the server's answer)."""
        self.encode("hello")

    def check_decode(self) -> None:
        """Whether /detokenize answers too (vLLM's does; other servers have only /tokenize): without it prompts are
        still exact, cut at word boundaries and measured again instead of cut at a token and decoded."""
        try:
            self.decode(self.encode("hello"))
        except TokenizerError as exc:
            self.can_decode = False
            self.server_check = f"is the server's, without /detokenize ({exc})"

    def encode(self, text: str) -> list[int]:
        return self._tokenize({"prompt": text, "add_special_tokens": False})

    def decode(self, ids: list[int]) -> str:
        body = self._post("/detokenize", {"model": self.model, "tokens": ids})
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise TokenizerError(f"{self.root_url}/detokenize answered without a 'prompt' string: {body!r:.200}")
        return prompt

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def prompt_ids(self, prompt: str | ChatMessages) -> list[int]:
        if isinstance(prompt, str):
            return self._tokenize({"prompt": prompt, "add_special_tokens": True})
        chat: dict[str, Any] = {"messages": prompt, "add_generation_prompt": True}
        if self.chat_template_kwargs:
            chat["chat_template_kwargs"] = self.chat_template_kwargs
        return self._tokenize(chat)

    def vocab_pieces(self) -> list[str] | None:
        return None  # the server does not list its vocabulary; random prompts use pseudo-words instead

    def render_chat(self, messages: ChatMessages) -> None:
        return None  # the server renders chat only inside a request: messages go to the chat endpoint instead

    def close(self) -> None:
        self._client.close()

    def _tokenize(self, payload: dict[str, Any]) -> list[int]:
        body = self._post("/tokenize", {"model": self.model, **payload})
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise TokenizerError(f"{self.root_url}/tokenize answered without a 'tokens' list: {body!r:.200}")
        return [int(t) for t in tokens]

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        url = self.root_url + path
        try:
            response = self._client.post(url, json=payload)
        except httpx.HTTPError as exc:
            raise TokenizerError(f"cannot reach {url} to count tokens: {exc}") from exc
        if response.status_code != 200:
            raise TokenizerError(f"{url} answered HTTP {response.status_code}: {_error_message(response)}")
        try:
            body = response.json()
        except ValueError as exc:
            raise TokenizerError(f"{url} answered with something that is not JSON: {response.text[:200]!r}") from exc
        if not isinstance(body, dict):
            raise TokenizerError(f"{url} answered with JSON that is not an object: {body!r:.200}")
        return body


def _error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(body, dict) and body.get("detail"):
            return str(body["detail"])
    except ValueError:
        pass
    return response.text[:200]
