"""Tokenizers for the workload tests: the tiny model's byte-level one (no merges), and a small byte-level BPE trained
here whose merges make decoded random tokens re-encode to a different count, as real BPE tokenizers do."""

from __future__ import annotations

import pytest

from deepserve.bench.tokenizer import LocalTokenCounter
from deepserve.models.tiny import write_tiny_model

WORDS = ["serving", "benchmark", "token", "prefix", "cache", "expert", "latency", "throughput", "model", "deep"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenCounter:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path)
    return LocalTokenCounter.load(str(path))


@pytest.fixture(scope="session")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenCounter:
    """A byte-level BPE with merges (" tokens" is one token, "tok" + "ens" merge) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] + "s" * (j % 3 == 0) for j in range(40)) for i in range(200)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]:{% endif %}"
    )
    path = tmp_path_factory.mktemp("bpe")
    fast.save_pretrained(str(path))
    return LocalTokenCounter.load(str(path))
