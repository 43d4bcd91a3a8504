"""Tokenizers and chat templates through `transformers`, from an HF directory or a GGUF file."""

from __future__ import annotations

import os
from typing import Callable


def load_tokenizer(path: str):
    """A `transformers` tokenizer for an HF directory or a ``.gguf`` file.

    GGUF tokenizers are converted once and saved under the kvjax cache directory (conversion of a
    150K-token vocabulary takes seconds).
    """
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    from kvjax.models.registry import cache_dir

    stat = os.stat(path)
    saved = os.path.join(cache_dir(), "tokenizers", f"{os.path.basename(path)}-{stat.st_size}-{int(stat.st_mtime)}")
    if os.path.isfile(os.path.join(saved, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(saved)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    tok.save_pretrained(saved)
    return tok


def format_prompt(tokenizer, prompt: str, chat: bool) -> str:
    """Apply the tokenizer's chat template (one user turn + generation prompt) when ``chat`` is set."""
    if not chat:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template; this model has none")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def fill_sentences(size: Callable[[int], int], budget: int, *, patience: int) -> list[int]:
    """Stream positions ``k = 0, 1, ...`` whose ``size(k)`` (estimated tokens) fill ``budget``: consecutive
    sentences while they fit, then later, shorter ones fill the gap; stops after ``patience`` that do not fit.
    Shared by the task generators (``kvjax.evals.tasks``) and the training data (``kvjax.train.data``)."""
    chosen, used, k, skipped = [], 0, 0, 0
    while skipped < patience:
        if used + size(k) <= budget:
            chosen.append(k)
            used += size(k)
        else:
            skipped += 1
        k += 1
    return chosen


def reconstruction_prompt(tokenizer, chat: bool):
    """KVzip's reconstruction passes for prompts formatted with ``chat`` (:class:`kvjax.methods.kvzip.ReconstructionPrompt`).

    As NVIDIA kvpress ``KVzipPress``: the chat template is applied to a dummy user turn and split there, giving the
    tokens before the context (``prefix``: counted as a formatted prompt is tokenized, special tokens added only
    without ``chat``, as ``kvjax.evals.tasks.tokenize_prompt`` does) and after it
    (``suffix``: end of turn and assistant header). Without ``chat`` the prefix is empty and the suffix ``"\\n"``.
    """
    from kvjax.methods.kvzip import FIRST_PROMPT, LATER_PROMPT, ReconstructionPrompt

    if chat:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = format_prompt(tokenizer, dummy + separator, True)
        before, suffix_text = text.split(separator)
        prefix_text = before.split(dummy)[0]
    else:
        prefix_text, suffix_text = "", "\n"
    prefix = len(tokenizer(prefix_text, add_special_tokens=not chat)["input_ids"])

    def ids(text):
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    return ReconstructionPrompt(prefix=prefix, first=ids(FIRST_PROMPT), later=ids(LATER_PROMPT), suffix=ids(suffix_text))
