"""StreamingLLM (Xiao et al., 2023): attention sinks plus the most recent tokens."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.methods.compressed import StaticMethod


@dataclasses.dataclass(frozen=True)
class StreamingLLM(StaticMethod):
    """Keep the first ``sinks`` real tokens and the last ``capacity - sinks`` prompt tokens.

    Deviation: the original rolls the window during decoding; here the prompt is compressed once
    and decoded tokens are appended (as in the prompt-compression comparisons of the papers).
    """

    sinks: int = 4
    name = "streaming_llm"

    def check_capacity(self, cap):
        """The sinks must fit in the budget."""
        if self.sinks > cap:
            raise ValueError(f"sinks {self.sinks} is larger than the budget of {cap} tokens per KV head")

    def select(self, layer, st, pad, cap):
        """Sinks at the start of each row's real tokens, then the most recent slots."""
        S = st.k.shape[2]
        slots = jnp.arange(S)[None, :]
        sink = (slots >= pad[:, None]) & (slots < pad[:, None] + self.sinks)
        recent = (slots >= st.prompt_len - (cap - self.sinks)) & (slots < st.prompt_len)
        return jnp.broadcast_to((sink | recent)[:, None, :], (pad.shape[0], st.k.shape[1], S))
