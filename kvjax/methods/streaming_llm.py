"""StreamingLLM (Xiao et al., 2023): attention sinks plus the most recent tokens."""

from __future__ import annotations

import dataclasses

from kvjax.methods.base import PagedAppend, PromptCompression
from kvjax.selection import RecencyScores, SinksAndRecent, UniformCapacity


@dataclasses.dataclass(frozen=True)
class StreamingLLM(PromptCompression):
    """Keep the first ``sinks`` real tokens and the last ``capacity - sinks`` prompt tokens.

    Deviation: the original rolls the window during decoding; here the prompt is compressed once
    and later tokens are appended (as in the prompt-compression comparisons of the papers).
    """

    sinks: int = 4
    name = "streaming_llm"

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.lookahead:
            raise ValueError("streaming_llm keeps the most recent tokens: a look-ahead changes nothing (its scores "
                             f"rise with position), got lookahead={self.lookahead}")

    def check_capacity(self, cap):
        """The sinks must fit in the budget."""
        if self.sinks > cap:
            raise ValueError(f"sinks {self.sinks} is larger than the budget of {cap} tokens per KV head")

    def components(self):
        """Recency + uniform + sinks-and-recent + pages."""
        return RecencyScores(), UniformCapacity(), SinksAndRecent(self.sinks), PagedAppend(self.page_size, self.implementation)
