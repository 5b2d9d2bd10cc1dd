"""A tiny random-weight Llama model (and a Gemma-3-style hybrid one) with a tokenizer
trained on the spot (no downloads).

vLLM's CPU attention kernel needs a head dimension of 64. The tokenizer is a word-level
one trained on a generated corpus, with a chat template that renders ``tool`` messages and
assistant ``tool_calls``, so the OpenAI-compatible server can serve agent turns.
Requires ``transformers`` and ``tokenizers`` (installed with vLLM).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "build_tiny_gemma3", "build_tiny_llama", "random_words"]

#: Renders system/user/assistant/tool messages; assistant tool calls as a bash block.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|{{ m['role'] }}|> "
    "{% if m['content'] %}{{ m['content'] }} {% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<|call|> {{ c['function']['name'] }} {{ c['function']['arguments'] }} "
    "{% endfor %}{% endif %}"
    "<|end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

_SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
_SPECIAL += ["<|end|>", "<|call|>"]
_VOCAB_WORDS = 2000


def random_words(rng: random.Random, n: int) -> str:
    """``n`` words of the tiny model's vocabulary (one token each)."""
    return " ".join(f"w{rng.randrange(_VOCAB_WORDS)}" for _ in range(n))


def _write_tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL)}
    for word in (
        [f"w{i}" for i in range(_VOCAB_WORDS)]
        + list("{}[]:,\"'=-_./")
        + [
            "bash",
            "ls",
            "pytest",
            "command",
        ]
    ):
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=_SPECIAL[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return len(vocab)


def build_tiny_llama(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 4,
    intermediate: int = 512,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a random-weight Llama model and its tokenizer to ``path`` (created); returns it.

    Idempotent: an existing model with the same settings is reused.
    """
    if hidden % heads or hidden // heads != 64:
        raise ValueError(
            f"hidden/heads must be 64 (the CPU kernel's head dim), got {hidden}/{heads}"
        )
    out = Path(path)
    settings = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "max_positions": max_positions,
        "seed": seed,
    }

    def make(vocab_size: int) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        return LlamaForCausalLM(config)  # type: ignore[no-untyped-call]

    return _build(out, settings, seed, make)


def _build(out: Path, settings: dict[str, Any], seed: int, make: Any) -> Path:
    """Write the tokenizer and ``make(vocab_size)``'s random weights (seeded, bfloat16) to
    ``out`` unless a model of the same ``settings`` is already there."""
    marker = out / "cachettl-tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return out
    import torch

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(out)
    torch.manual_seed(seed)
    model: Any = make(vocab_size)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    marker.write_text(json.dumps(settings))
    return out


def build_tiny_gemma3(
    path: str | Path,
    *,
    layers: int = 6,
    sliding_window: int = 128,
    hidden: int = 256,
    heads: int = 4,
    seed: int = 0,
) -> Path:
    """Write a random-weight Gemma-3-style text model (five sliding-window layers per
    full-attention layer, as Gemma-3; window ``sliding_window`` tokens, head dim 64) and the
    tiny tokenizer to ``path``; returns it. Idempotent like :func:`build_tiny_llama`."""
    out = Path(path)
    settings = {"arch": "gemma3", "layers": layers, "window": sliding_window, "seed": seed}
    settings.update(hidden=hidden, heads=heads)

    def make(vocab_size: int) -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=64,
            sliding_window=sliding_window,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        return Gemma3ForCausalLM(config)

    return _build(out, settings, seed, make)
