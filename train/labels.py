"""Training targets of Locret's retaining heads, from one jitted forward of the frozen model.

For a sample (prompt + answer, one sequence), per layer:

* **features** ``[S, F]``: each token's own pre-RoPE ``[Q, K, V]`` (the retaining head's input,
  :func:`kvjax.retaining_heads.head_features`);
* **labels** ``[H_kv, S]``: for each prompt token and KV head, the maximum *pre-softmax* attention
  score it receives from the answer tokens, over the answer's queries and the query heads of the
  head's GQA group (the paper's causal importance score). Scores are ``q . k / sqrt(d)``, the
  attention logits of the reference code's HF attention (scaled, before softmax); keys post-RoPE.

The forward runs through kvjax's own model with a recording method (:class:`LabelRecorder`, the
cache protocol's dense prefill), so the model is untouched and its parameters are a frozen input
(no gradient ever flows to them: training reads these arrays only).

Samples are laid out at one fixed length ``N`` (one compilation for a whole dataset): the prompt is
left-padded and the answer ends the sequence, at most ``answer_max`` tokens long.

An alternative target (:func:`reconstruction_labels`, ``kvjax train-locret --target reconstruction``): KVzip's
query-agnostic score of each prompt token (the attention it receives while the model repeats the prompt,
:mod:`kvjax.methods.kvzip`), as NVIDIA's KVzap trains its small per-layer heads. The label is the score's natural
logarithm (scores are attention probabilities spanning orders of magnitude; the logarithm keeps each head's ranking,
the only thing inference uses); it does not depend on the answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from kvjax.artifacts import no_artifact
from kvjax.attention import attention_by_slots
from kvjax.cache import Cache, CacheSpec
from kvjax.decoding import prefill_jit
from kvjax.retaining_heads import head_features
from kvjax.sharding import not_shardable


@struct.dataclass
class LabelState:
    """One layer's recording: ``features[B, N, F]`` and ``labels[B, Hkv, N]`` (f32; 0 outside the prompt)."""

    features: jax.Array
    labels: jax.Array
    answer_start: jax.Array  # int32 [B]: first answer slot of each row


@dataclasses.dataclass(frozen=True)
class LabelRecorder:
    """A recording "method": one dense causal prefill of prompt + answer that records features and labels.

    Not a KV-cache method (nothing is kept for decoding): it implements the protocol so the model's
    forward can be reused unchanged. ``answer_max``: answers occupy at most the last ``answer_max``
    slots (static, bounds the label computation to ``answer_max x N`` scores per head).
    """

    answer_max: int
    feature_dtype: str = "float32"
    name = "locret_labels"

    def recording(self) -> None:
        """Own prefill."""
        return None

    def artifact_for(self, spec: CacheSpec, artifact: Any = None) -> None:
        """No artifact."""
        no_artifact(artifact, self.name)

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Empty recordings for every layer (``prompt_slots`` = the whole sequence ``N``)."""
        self.artifact_for(spec, artifact)
        if not 0 < self.answer_max < spec.prompt_slots:
            raise ValueError(f"answer_max must be in [1, {spec.prompt_slots}), got {self.answer_max}")
        F = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        B, N = spec.batch, spec.prompt_slots
        layers = tuple(LabelState(jnp.zeros((B, N, F), self.feature_dtype), jnp.zeros((B, spec.num_kv_heads, N), jnp.float32),
                                  jnp.full((B,), N, jnp.int32)) for _ in range(spec.num_layers))
        return Cache.create(layers, self, spec)

    def prefill_chunk(self, state: LabelState, q, k, v, ctx):
        """The whole sequence in one call: causal attention, features of every token, labels of the prompt's."""
        B, N, Hq, D = q.shape
        Hkv = k.shape[2]
        if N != state.features.shape[1]:
            raise ValueError(f"the label recorder takes the whole sequence ({state.features.shape[1]} slots) in one call, got {N}")
        slots = jnp.arange(N, dtype=jnp.int32)
        kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        out = attention_by_slots(q, slots, kt, vt, jnp.broadcast_to(slots, (B, Hkv, N)), ctx.pad, scale=D**-0.5)

        A = self.answer_max
        qa = q[:, N - A:].astype(jnp.float32).reshape(B, A, Hkv, Hq // Hkv, D)
        s = jnp.einsum("bahgd,bhnd->bhgan", qa, kt.astype(jnp.float32), precision=lax.Precision.HIGHEST) * D**-0.5
        q_slots = N - A + jnp.arange(A)
        start = state.answer_start
        is_answer = q_slots[None, :] >= start[:, None]  # [B, A]
        s = jnp.where(is_answer[:, None, None, :, None], s, -jnp.inf)
        labels = jnp.max(s, axis=(2, 3))  # [B, Hkv, N]
        is_prompt = (slots[None, :] >= ctx.pad[:, None]) & (slots[None, :] < start[:, None])
        labels = jnp.where(is_prompt[:, None, :], labels, 0.0)
        feats = head_features(ctx.q_pre_rope, ctx.k_pre_rope, v).astype(state.features.dtype)
        return out, state.replace(features=feats, labels=labels)

    def finish_prefill(self, state, ctx):
        """Not used (the recorder is read after prefill)."""
        return state

    def decode_attend(self, state, q, k, v, ctx):
        """Not supported: the recorder only prefills."""
        raise ValueError("the label recorder only runs one prefill")

    def question_passes(self) -> int:
        """One (the recorder only prefills)."""
        return 1

    def state_partition(self, state, spec: CacheSpec):
        """Label recording runs on one device."""
        raise not_shardable(self.name, "training labels are recorded on one device")

    def stats(self, cache: Cache) -> dict:
        """Nothing to report."""
        return {}

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Not a decoding cache."""
        return 0


def layout(prompt: Sequence[int], answer: Sequence[int], length: int, answer_max: int, pad_id: int = 0):
    """(tokens ``[length]`` int32, pad, answer_start) of one sample left-padded to ``length`` with the answer last."""
    n_p, n_a = len(prompt), len(answer)
    if not 0 < n_a <= answer_max:
        raise ValueError(f"an answer of {n_a} tokens does not fit answer_max={answer_max}")
    if n_p + n_a > length:
        raise ValueError(f"prompt ({n_p}) + answer ({n_a}) tokens exceed the layout's {length} slots")
    pad = length - n_p - n_a
    tokens = np.full((length,), pad_id, np.int32)
    tokens[pad:] = np.asarray(list(prompt) + list(answer), np.int32)
    return tokens, pad, pad + n_p


def collect(model, prompt: Sequence[int], answer: Sequence[int], *, length: int, answer_max: int,
            feature_dtype: str = "float32"):
    """Features ``[L, length, F]`` and labels ``[L, Hkv, length]`` (numpy) of one sample, with its pad and answer start.

    ``model``: a loaded model (``kvjax.models.load_model``); its parameters are only read. Slots before
    ``pad`` and from ``answer_start`` on carry label 0 and must be masked by the trainer.
    """
    tokens, pad, start = layout(prompt, answer, length, answer_max)
    method = LabelRecorder(answer_max=answer_max, feature_dtype=feature_dtype)
    spec = CacheSpec.for_model(model.config, 1, length, 0, model.dtype)
    cache = method.init_cache(spec)
    cache = cache.replace(pad=jnp.asarray([pad], jnp.int32),
                          layers=tuple(st.replace(answer_start=jnp.asarray([start], jnp.int32)) for st in cache.layers))
    _, cache = prefill_jit(model.graphdef, model.params, jnp.asarray(tokens[None]), cache)
    feats = np.stack([np.asarray(st.features[0]) for st in cache.layers])
    labels = np.stack([np.asarray(st.labels[0]) for st in cache.layers])
    return feats, labels, pad, start


RECONSTRUCTION_FLOOR = 1e-9  # scores below it (a token nothing attends to) are labelled log(1e-9)


def reconstruction_labels(model, prompt: Sequence[int], *, length: int, pad: int, reconstruction) -> np.ndarray:
    """Labels ``[L, Hkv, length]`` (numpy float32) of one prompt laid out from slot ``pad`` on: the logarithm of KVzip's
    score of each prompt token per layer and KV head (``reconstruction``: the prompt's
    :class:`kvjax.methods.kvzip.ReconstructionPrompt`, ``kvjax.models.tokenizer.reconstruction_prompt``); 0 elsewhere."""
    from kvjax.decoding import prefill_prompt
    from kvjax.methods.kvzip import KVzip, reconstruct

    n = len(prompt)
    if pad < 0 or pad + n > length:
        raise ValueError(f"a prompt of {n} tokens from slot {pad} does not fit {length} slots")
    tokens = np.asarray([list(prompt)], np.int32)
    cache = KVzip(budget=1.0).init_cache(CacheSpec.for_model(model.config, 1, n, 0, model.dtype))
    _, cache = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), cache)
    cache = reconstruct(model.graphdef, model.params, cache, tokens, reconstruction)
    scores = np.stack([np.asarray(st.scores[0], np.float32) for st in cache.layers])  # [L, Hkv, n]
    labels = np.zeros((scores.shape[0], scores.shape[1], length), np.float32)
    labels[:, :, pad:pad + n] = np.log(np.maximum(scores, RECONSTRUCTION_FLOOR))
    return labels


__all__ = ["LabelRecorder", "LabelState", "RECONSTRUCTION_FLOOR", "layout", "collect", "reconstruction_labels"]
