"""Passkey retrieval prompts: a random number hidden at a chosen depth in repeated filler text.

The classic filler of the passkey task (Mohtashami & Jaggi, 2023), sized in the model's own tokens.
"""

from __future__ import annotations

import dataclasses
import random

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? Answer with the number only."


@dataclasses.dataclass(frozen=True)
class PasskeySample:
    """One prompt (without chat template), its expected answer and where the needle sits."""

    prompt: str
    answer: str
    depth: float
    num_tokens: int


def make_passkey(tokenizer, target_tokens: int, depth: float = 0.5, seed: int = 0, digits: int = 5) -> PasskeySample:
    """A passkey prompt of about ``target_tokens`` tokens (filler counted with ``tokenizer``), needle at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = str(rng.randrange(10 ** (digits - 1), 10**digits))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    intro = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    fixed = len(tokenizer(intro + needle + QUESTION, add_special_tokens=False)["input_ids"])
    per_filler = len(tokenizer(FILLER * 10, add_special_tokens=False)["input_ids"]) / 10
    n_filler = max(int((target_tokens - fixed) / per_filler), 1)
    before = round(n_filler * depth)
    prompt = intro + FILLER * before + needle + FILLER * (n_filler - before) + QUESTION
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return PasskeySample(prompt=prompt, answer=key, depth=depth, num_tokens=n)
