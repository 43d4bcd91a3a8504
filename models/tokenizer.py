"""Tokenizers and chat templates through `transformers`, from an HF directory or a GGUF file."""

from __future__ import annotations

import os


def load_tokenizer(path: str):
    """A `transformers` tokenizer for an HF directory or a ``.gguf`` file.

    GGUF tokenizers are converted once and saved under the kvjax cache directory (conversion of a
    150K-token vocabulary takes seconds).
    """
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    from models.registry import cache_dir

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
