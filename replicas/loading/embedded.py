"""The embedded test models: random weights with a fixed seed and a real byte-level BPE
tokenizer trained on an in-module corpus, built once into the model cache
(`replicas.loading.prepare`). Needs torch; only a process that builds a model imports it."""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from replicas.loading.model_files import EmbeddedSpec

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Fixed English text so common words become single tokens; the pseudo-words below supply the
# volume needed to reach a 32k vocabulary.  Nothing is read from the environment.
_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A serving system takes requests from many users
at once, splits long prompts into chunks, and keeps every running sequence moving so that no
user waits behind another user's prompt. Each step packs decode tokens first and fills the
rest of the budget with prefill, which keeps the time between tokens steady.
Once upon a time there was a small model that lived on a laptop. It could not write poems or
answer questions, but it could count tokens very quickly, and that made it useful for tests.
Good software is measured, not guessed: record the latency of the first token, the time per
output token, the throughput, and the queue length, then compare them against a baseline.
Hello, world! What time is it? It is 10:45 in the morning, 2024-06-01, and the temperature is
21.5 degrees. Prices: $3.99, 50%, #42, user@example.com, https://example.com/path?q=1&x=2.
def add(a, b): return a + b  # code-like text: indentation, brackets, operators
"""

_ONSETS = ("", *"b c d f g h j k l m n p r s t v w z br ch cl dr gr pl sh st th tr qu".split())
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")


def _training_corpus(vocab_size: int, seed: int) -> list[str]:
    """Deterministic corpus: the English text plus enough distinct pseudo-words for the vocab."""
    rng = random.Random(seed)
    # About two distinct words per vocab entry: measured to let BPE reach the full size.
    target = max(4000, 2 * vocab_size)
    seen: set[str] = set()
    words: list[str] = []
    while len(seen) < target:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                       for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.1:
            word = word.capitalize()
        elif rng.random() < 0.03:
            word = str(rng.randint(0, 99999))
        seen.add(word)
        words.append(word)
    lines = [" ".join(words[i:i + 12]) + "." for i in range(0, len(words), 12)]
    return _ENGLISH.splitlines() * 20 + lines


def build_tokenizer(vocab_size: int, seed: int = 0,
                    max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer offline; any unicode text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False so decode(encode(text)) == text with no leading-space artefacts.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        # The full byte alphabet guarantees every input is encodable (no unknown tokens).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(vocab_size, seed), trainer)
    # One "<|endoftext|>" serves as bos/eos/pad/unk, as in GPT-2 (byte-level BPE never needs unk).
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN, extra_special_tokens=[IM_START, IM_END], model_max_length=max_length)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_embedded(spec: EmbeddedSpec, out_dir: Path) -> None:
    """Write tokenizer + randomly initialised Llama weights for ``spec`` into ``out_dir``."""
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed, spec.max_position_embeddings)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    shape = asdict(spec)
    del shape["seed"]
    # Never smaller than the tokenizer, or a token id would index past the embedding.
    shape["vocab_size"] = max(spec.vocab_size, len(tokenizer))
    config = LlamaConfig(
        **shape, head_dim=spec.hidden_size // spec.num_attention_heads,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        tie_word_embeddings=False, dtype="float32")
    # fork_rng: seed the weights without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    # A chat turn ends with <|im_end|>; generation stops on it as on <|endoftext|>.
    model.generation_config.eos_token_id = [eos_id, tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
