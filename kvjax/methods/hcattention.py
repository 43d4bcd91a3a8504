"""HCAttention (Yang et al.): product-quantized keys on the device, values in host memory, and top-p
(cumulative attention mass) selection of the values that take part in each decode step.

Lifecycle:

* **prefill** is the ordinary dense staging (shared with every static method, :mod:`kvjax.shared_prefill`).
* **finish_prefill** encodes each layer's prompt keys (post-RoPE) to codes ``P[B, Hkv, S, g]`` against
  the layer's codebooks (uint8 for ``c <= 256``, uint16 above; :func:`kvjax.pq_codebooks.encode_keys`),
  drops the full keys from the device and moves the prompt's values to ``pinned_host`` memory, stored in the
  spec's ``kv_dtype`` (int8 / fp8 with a float32 scale per token and KV head beside them; dequantized on the
  host by the host path, on the device after the transfer by the device path). With
  ``groups=0`` the keys stay exact on the device (the paper's "value offloading only" configuration).
* **decode_attend** (any number of new tokens: a question or one decoded token) per layer and query:

  1. approximate logits of the prompt tokens ``z~_j = sum_i T[i, P[j, i]]`` from the lookup table
     ``T = q . C`` (Eq. 3; :func:`kvjax.pallas_kernels.pq_attention.pq_scores`, the Pallas kernel, on
     accelerators, one call per layer for every query head and new token; on the XLA path, the same
     sum as ``q . decode(P)``, faster on CPU than the table gather);
     the tokens appended after the prompt keep exact keys and values on the device;
  2. one softmax over both (Eq. 2), then the smallest set of prompt tokens whose cumulative mass,
     with the always-kept newer tokens counted first, reaches ``tau`` (Eq. 4; found by a sort-free
     radix search on the threshold, :func:`kvjax.selection.top_p_select`; tokens tied at the threshold are all kept);
  3. the weighted sum of the selected values (Eq. 5), by one of two paths: ``value_path="host"``
     sends the weights (dense over the prompt) to the host, computes the weighted sum where the values live over
     the selected rows only (a ``compute_on`` host region, :func:`kvjax.host_tier.weighted_union_on_host`) and
     brings back ``[Hq, D]`` per row; ``value_path="device"`` brings the selected value rows to the device in one
     batched transfer per layer (:func:`kvjax.host_tier.gather_rows`) and sums there.

Where kvjax differs from the paper (each a choice the paper leaves open or one forced by our setting):

* **Renormalisation** (``renormalize=True``): Eq. 5 sums the selected tokens' probabilities as they
  are, which scales the output by the selected mass (about ``tau``); kvjax divides by the selected
  mass, so the output is a convex combination of values. ``renormalize=False`` is the literal Eq. 5.
  With ``tau = 1`` both are the same.
* **Newest tokens exact**: tokens after the prompt (question, decoded tokens) keep exact keys and
  values on the device and are always part of the selection; only the prompt is quantized and
  offloaded. The paper quantizes every key; its memory table counts the prompt.
* **Exact prompt tail** (``local``, default 0: off, the paper): the last ``local`` prompt tokens are
  kept like the newer tokens (exact K/V on the device, always selected) instead of quantized and
  offloaded. For this method the two evaluation protocols differ only in whether the question's own
  keys are quantized (inside the prompt) or exact (appended after compression), and at 8K, g = D/2,
  that decides the answer: query-agnostic 95.8%, query-aware 27.1% (48 prompts each; the answers drop
  digits of the needle). Measured effect of ``local=64`` (query-aware, 8K, g = D/2, the same 48
  prompts, ``docs/results/qwen2.5-coder-0.5b-8k-hcattention-query-aware``): 27.1% -> 93.8%, the
  full cache's output on 48 of 48 prompts (against 13 of 48), for 0.085x instead of 0.077x the full
  cache's device bytes. At 4K the query-aware protocol already matched the full cache without it.
  The default stays the paper's (every prompt key quantized); ``local=64`` is the setting to use
  when the question ends a long prompt.
* **Rows per KV head**: a KV head's query heads (GQA) and new tokens share one set of value rows,
  the union of their selections, capped at ``max_selected`` of the prompt (default 1.0: no cap,
  Eq. 4 exactly). A cap makes the transfer of the device path bounded; where the union exceeds it,
  the rows with the highest group-max probability are used and the event is counted
  (``truncated_selections`` in the stats). The rows a call sums (host path) or moves (device path) follow the
  selection, not the prompt: one size per call, the smallest of ``cap, cap / sqrt(2), cap / 2, ...`` (``row_buckets``
  sizes, default 13: down to ``cap / 64``) that holds the call's largest union, so below sqrt(2) times that union
  unless it is smaller than ``cap / 64``; exact either way. The stats count the rows selected
  (``value_rows_per_head_per_call``) and the rows summed or moved (``value_rows_fetched_per_head_per_call``). On the
  host path the size is chosen by the host computation from the dense weights it receives, so the device program
  has no conditional (on a TPU, whose host compiler rejects that conditional, the device program chooses: TPUs run
  conditionals without the host); on the device path the device must know the size of the transfer, so a
  ``lax.switch`` chooses it: on a GPU a host synchronisation per layer and call (``row_buckets=1`` avoids it and
  moves every prompt row).
* **Value fetch timing**: the rows a step needs depend on that step's query, so the transfer cannot
  be issued a step ahead (unlike HeteroCache's/SyncKV's recalls); it is issued as soon as the
  selection is known, after the scores.
* **Budget**: the paper names memory configurations, not token budgets. ``budget`` (a fraction of
  the prompt's KV bytes on the device) picks one: ``>= 0.5`` keeps exact keys (values offloaded);
  below, the finer of the paper's two key quantizations, ``g = D/2`` or ``g = D/4``, whose codes fit
  the budget. Codes are ``g`` bytes (``c <= 256``) against ``2 * D * itemsize`` bytes of K and V,
  so in float32 ``g = D/2`` holds 6.25% (the paper's 25% counts 16-bit codes against 16-bit keys).
  The codebooks (``Hkv * c * D`` floats per layer) and the exact newer tokens come on top and are
  reported by ``cache.stats()``: the device bytes are measured, never assumed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec

from kvjax.artifacts import Artifact, installed_artifact, no_artifact, require_artifact
from kvjax.attention import resolve_implementation
from kvjax.cache import Cache, CacheSpec
from kvjax.host_tier import gather_rows, to_host, weighted_rows_on_host, weighted_union_on_host
from kvjax.kv_quantization import quantize, stored_vector_bytes
from kvjax.methods.base import LayerLocal
from kvjax.pq_codebooks import KIND, code_dtype, codebook_variant, decode_keys, encode_keys
from kvjax.paged import shard_map
from kvjax.selection import top_p_select
from kvjax.sharding import (BY_DEVICE, MODEL, REPLICATED, ROWS_HEADS, OnHost, flatten_heads, is_split,
                            unflatten_heads)
from kvjax.staging import Recording, StagedKV, init_staging, stage_chunk, staged_partition
from kvjax.pallas_kernels.pq_attention import pq_scores

VALUE_PATHS = ("host", "device")
ROW_SIZE_CHOICES = ("auto", "host", "device")
# Named configurations (``hcattention:preset=tuned``), chosen on the dev split: the last 64 prompt tokens kept
# exact, so a question at the prompt's end is not quantized (docs/methods/hcattention.md).
PRESETS: dict[str, dict] = {
    "tuned": {"local": 64},
}


# ------------------------------------------------------------------------------------- selection
def key_bytes_fraction(groups: int | None, centroids: int, head_dim: int, itemsize: int) -> float:
    """Device bytes of a prompt token's key representation over its full K + V bytes (values offloaded)."""
    if not groups:
        return 0.5
    return groups * jnp.dtype(code_dtype(centroids)).itemsize / (2 * head_dim * itemsize)


# ---------------------------------------------------------------------------------------- state
@struct.dataclass
class HCAttentionKV:
    """One layer after compression.

    Attributes:
      codes: ``[B, Hkv, S, g]`` uint8/uint16 codes of the prompt keys (None with exact keys).
      keys: ``[B, Hkv, S, D]`` exact prompt keys (only with ``groups=0``).
      values: ``[B * Hkv, S, D]`` prompt values in ``pinned_host`` memory, (row, head) pairs in the order of
        :func:`kvjax.sharding.flatten_heads` (row by row, head by head on one device), in the cache spec's
        ``kv_dtype``.
      value_scales: ``[B * Hkv, S, 1]`` float32 per-token scales of quantized ``values`` (int8, float8_e4m3fn;
        :mod:`kvjax.kv_quantization`) in ``pinned_host`` memory; None otherwise.
      recent_k, recent_v: ``[B, Hkv, local + room, D]`` exact K/V of the last ``local`` prompt tokens and of
        the tokens after the prompt (device).
      selected: sum over queries of the fraction of the row's prompt tokens selected (float32).
      queries: number of (row, query head, new token) selections made.
      rows: sum over calls and (row, KV head) of the value rows selected (the union of the call's selections, at
        most the cap).
      fetched: sum over calls and (row, KV head) of the value rows that cross (device path) or are weighted on the
        host (host path): the call's transfer size.
      calls: decode calls (a question counts once).
      moved: bytes crossing between host and device (ids and weights out, sums or rows back), summed over calls.
      truncated: (row, KV head, call) whose union of selections exceeded the row cap.
    """

    codes: jax.Array | None
    keys: jax.Array | None
    values: jax.Array
    value_scales: jax.Array | None
    recent_k: jax.Array
    recent_v: jax.Array
    selected: jax.Array
    queries: jax.Array
    rows: jax.Array
    fetched: jax.Array
    calls: jax.Array
    moved: jax.Array
    truncated: jax.Array


# --------------------------------------------------------------------------------------- method
def kernel_scores(q, codebooks, codes, implementation: str, mesh=None):
    """PQ scores ``[B, Hq', S]`` by the Pallas kernel (:func:`kvjax.pallas_kernels.pq_attention.pq_scores`); on a multi-device
    ``mesh`` per device under ``shard_map``: each device scores its rows' and KV heads' codes with their codebooks
    (``q[B, Hq', D]`` KV-head-major, so a head's queries split with it)."""
    def scores(q, codebooks, codes):
        return pq_scores(q, codebooks, codes, implementation=implementation)

    if is_split(mesh):
        scores = shard_map(scores, mesh=mesh, in_specs=(ROWS_HEADS, PartitionSpec(MODEL), ROWS_HEADS),
                           out_specs=ROWS_HEADS, check_vma=False)
    return scores(q, codebooks, codes)


@dataclasses.dataclass(frozen=True)
class HCAttention(LayerLocal):
    """HCAttention (see the module docstring).

    Args:
      budget: fraction of the prompt's KV bytes on the device; picks the key representation (module
        docstring). Give either ``budget`` or ``groups``.
      groups: key groups ``g`` (``D % g == 0``); 0 keeps exact keys (value offloading only); None with
        no budget: ``D // 2`` (the paper's ``g = 64`` at ``D = 128``).
      centroids: codebook size ``c`` per (layer, KV head, group); codes are uint8 up to 256.
      tau: cumulative attention mass kept (Eq. 4; paper 0.9).
      value_path: "host" (weighted sum where the values live) | "device" (selected rows transferred).
      max_selected: cap on the value rows per KV head and call, as a fraction of the prompt (1.0: none).
      row_buckets: transfer sizes a call chooses from: the cap, divided by sqrt(2) ``row_buckets - 1`` times; each
        call sums (host path) or moves (device path) the smallest that holds every (row, KV head)'s union of
        selections (exact; 1: always the cap, every prompt row without a cap).
      row_size_choice: where the host path's row count is picked: "host" (by the host computation, from the dense
        weights: the device program has no conditional), "device" (by a switch of the device program, which then
        sends ids and weights of the chosen rows only) or "auto" (host, except on a TPU; the device path always
        picks on the device).
      renormalize: divide by the selected mass (False: the literal Eq. 5).
      local: last prompt tokens kept exact on the device and always selected (0: every prompt key
        quantized, the paper; module docstring).
      block: key-block size of the prefill attention.
      implementation: PQ scoring, auto | xla | pallas | pallas_interpret (auto: Pallas on TPU/GPU).
    """

    budget: float | None = None
    groups: int | None = None
    centroids: int = 256
    tau: float = 0.9
    value_path: str = "host"
    max_selected: float = 1.0
    row_buckets: int = 13
    row_size_choice: str = "auto"
    renormalize: bool = True
    local: int = 0
    block: int = 256
    implementation: str = "auto"
    name = "hcattention"

    def __post_init__(self):
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, float) or not 0 < self.budget <= 1:
                raise ValueError(f"hcattention budget must be a float fraction of the prompt's KV bytes in (0, 1], "
                                 f"got {self.budget!r} (it picks the key representation; token budgets do not apply)")
            if self.groups is not None:
                raise ValueError(f"give hcattention either budget ({self.budget}) or groups ({self.groups}), not both")
        if self.groups is not None and (isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 0):
            raise ValueError(f"groups must be an int >= 0 (0: exact keys), got {self.groups!r}")
        if not 1 <= self.centroids <= 65536:
            raise ValueError(f"centroids must be in [1, 65536] (uint8 codes up to 256, uint16 above), got {self.centroids}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {self.tau}")
        if self.value_path not in VALUE_PATHS:
            raise ValueError(f"value_path must be one of {VALUE_PATHS}, got {self.value_path!r}")
        if not 0.0 < self.max_selected <= 1.0:
            raise ValueError(f"max_selected must be in (0, 1], got {self.max_selected}")
        if isinstance(self.row_buckets, bool) or not isinstance(self.row_buckets, int) or self.row_buckets < 1:
            raise ValueError(f"row_buckets must be an int >= 1, got {self.row_buckets!r}")
        if self.row_size_choice not in ROW_SIZE_CHOICES:
            raise ValueError(f"row_size_choice must be one of {ROW_SIZE_CHOICES}, got {self.row_size_choice!r}")
        if self.row_size_choice == "host" and self.value_path == "device":
            raise ValueError("row_size_choice='host' needs value_path='host': the device path's transfer is sized "
                             "in the device program")
        if self.block <= 0:
            raise ValueError(f"block must be positive, got {self.block}")
        if isinstance(self.local, bool) or not isinstance(self.local, int) or self.local < 0:
            raise ValueError(f"local must be an int >= 0 (last prompt tokens kept exact), got {self.local!r}")
        resolve_implementation(self.implementation)

    # -- configuration
    def key_groups(self, spec: CacheSpec) -> int:
        """Key groups for ``spec`` (0: exact keys), validated against the head dimension."""
        D = spec.head_dim
        if self.budget is not None:
            itemsize = jnp.dtype(spec.dtype).itemsize
            if self.budget >= 0.5:
                return 0
            for g in (D // 2, D // 4):
                if g >= 1 and key_bytes_fraction(g, self.centroids, D, itemsize) <= self.budget:
                    return g
            smallest = key_bytes_fraction(max(D // 4, 1), self.centroids, D, itemsize)
            raise ValueError(f"hcattention budget {self.budget} is below its smallest configuration "
                             f"(g = D/4 = {D // 4} groups of {self.centroids} centroids: {smallest:.4f} of the KV bytes)")
        g = D // 2 if self.groups is None else self.groups
        if g and D % g:
            raise ValueError(f"groups={g} must divide the head dimension {D}")
        return g

    def row_sizes(self, prompt_slots: int) -> tuple[int, ...]:
        """The value-row transfer sizes of a call, smallest first: the cap divided by sqrt(2) ``row_buckets - 1``
        times (rounded up, at least one row), then the cap. The size a call takes is below sqrt(2) times its
        largest union of selections unless that union is below the smallest size."""
        cap = self.row_cap(prompt_slots)
        return tuple(sorted({max(1, math.ceil(cap / 2 ** (i / 2) - 1e-9)) for i in range(self.row_buckets)}))

    def sizes_on_host(self) -> bool:
        """Whether the host computation picks a call's row count (host path; ``auto``: on every backend but a TPU,
        whose host compiler rejects conditionals and whose device program runs them without the host)."""
        if self.value_path != "host" or self.row_size_choice == "device":
            return False
        return self.row_size_choice == "host" or jax.default_backend() != "tpu"

    def row_cap(self, prompt_slots: int) -> int:
        """Static number of value rows per KV head and call for a prompt of ``prompt_slots``."""
        return min(prompt_slots, max(1, math.ceil(self.max_selected * prompt_slots)))

    def artifact_for(self, spec: CacheSpec, artifact: Any = None) -> Artifact | None:
        """Codebooks ``[L, Hkv, g, c, D // g]`` for quantized keys (given, or shipped as ``g<g>-c<c>``); none for exact keys."""
        g = self.key_groups(spec)
        if not g:
            no_artifact(artifact, f"{self.name} with exact keys (groups=0)")
            return None
        if artifact is None:
            artifact = installed_artifact(KIND, spec.model_id, codebook_variant(g, self.centroids))
        art = require_artifact(artifact, KIND, spec.model_id)
        want = (spec.num_layers, spec.num_kv_heads, g, self.centroids, spec.head_dim // g)
        got = tuple(art.arrays["codebooks"].shape)
        if got != want:
            raise ValueError(f"hcattention codebooks have shape {got}; this method needs [L, Hkv, g, c, D/g] = {want} "
                             f"(groups={g}, centroids={self.centroids}); calibrate with `kvjax calibrate hcattention "
                             f"--groups {g} --centroids {self.centroids}`")
        return art

    # -- protocol
    def recording(self) -> Recording:
        """A plain dense staging (shareable)."""
        return Recording(block=self.block)

    def init_cache(self, spec: CacheSpec, artifact: Any = None) -> Cache:
        """Dense staging; the codebooks travel with the cache as its artifact."""
        if self.local >= spec.prompt_slots:  # checked before any prefill work
            raise ValueError(f"hcattention local={self.local} must be smaller than the prompt ({spec.prompt_slots} slots)")
        art = self.artifact_for(spec, artifact)
        return Cache.create(init_staging(spec, self.recording()), self, spec, artifact=art)

    def prefill_chunk(self, state, q, k, v, ctx):
        """Stage and attend."""
        return stage_chunk(state, q, k, v, ctx)

    def finish_prefill(self, state: StagedKV, ctx) -> HCAttentionKV:
        """Encode the prompt keys (or keep them exact), move the prompt values to host memory."""
        spec = ctx.spec
        P, B, H, D = spec.prompt_slots, spec.batch, spec.num_kv_heads, spec.head_dim
        S = P - self.local  # quantized, offloaded slots; the last `local` prompt slots join the exact newer tokens
        keys, values = state.k[:, :, :S], state.v[:, :, :S]
        if self.key_groups(spec):
            codes, exact = encode_keys(keys, ctx.artifact.arrays["codebooks"][ctx.layer]), None
        else:
            codes, exact = None, keys
        room = (B, H, max(spec.room + self.local, 1), D)
        recent_k = lax.dynamic_update_slice_in_dim(jnp.zeros(room, state.k.dtype), state.k[:, :, S:P], 0, axis=2)
        recent_v = lax.dynamic_update_slice_in_dim(jnp.zeros(room, state.v.dtype), state.v[:, :, S:P], 0, axis=2)
        zero = jnp.zeros((), jnp.float32)
        stored, scales = quantize(values, spec.kv_dtype)
        return HCAttentionKV(
            codes=codes, keys=exact, values=to_host(flatten_heads(stored, spec.mesh)),
            value_scales=None if scales is None else to_host(flatten_heads(scales[..., None], spec.mesh)),
            recent_k=recent_k, recent_v=recent_v,
            selected=zero, queries=zero, rows=zero, fetched=zero, calls=jnp.zeros((), jnp.int32), moved=zero,
            truncated=jnp.zeros((), jnp.int32),
        )

    def prompt_logits(self, state: HCAttentionKV, qg, ctx):
        """Scaled logits ``[B, Hkv, G, T, S]`` of the prompt tokens: PQ lookup (Eq. 3) or exact keys."""
        B, H, G, T, D = qg.shape
        if state.codes is None:
            return jnp.einsum("bhgtd,bhsd->bhgts", qg, state.keys.astype(jnp.float32),
                              precision=lax.Precision.HIGHEST) * D**-0.5
        codebooks = ctx.artifact.arrays["codebooks"][ctx.layer]
        implementation = resolve_implementation(self.implementation)
        if implementation == "xla":
            # Same sum (Eq. 3) in another order: decode the codes to their centroids, one dense product.
            # On XLA:CPU this is 11x faster than the reference's per-group table gather (6 against 69 ms per
            # layer for 4 rows x 14 heads x 4K tokens, g = 32); the decoded keys are a transient of one layer.
            keys = decode_keys(state.codes, codebooks)
            return jnp.einsum("bhgtd,bhsd->bhgts", qg, keys, precision=lax.Precision.HIGHEST) * D**-0.5
        z = kernel_scores(qg.reshape(B, H * G * T, D), codebooks, state.codes, implementation, ctx.mesh)
        return z.reshape(B, H, G, T, -1)

    def decode_attend(self, state: HCAttentionKV, q, k, v, ctx):
        """Append the new tokens exactly, score the prompt approximately, select by top-p, weighted sum of values."""
        B, T, Hq, D = q.shape
        H = state.recent_k.shape[1]
        G = Hq // H
        S = state.values.shape[1]
        n = ctx.start - S  # exact tokens already held: the prompt tail (`local`), then the newer tokens
        rk = lax.dynamic_update_slice_in_dim(state.recent_k, k.transpose(0, 2, 1, 3).astype(state.recent_k.dtype), n, axis=2)
        rv = lax.dynamic_update_slice_in_dim(state.recent_v, v.transpose(0, 2, 1, 3).astype(state.recent_v.dtype), n, axis=2)
        qg = q.astype(jnp.float32).reshape(B, T, H, G, D).transpose(0, 2, 3, 1, 4)  # [B, H, G, T, D]

        real = jnp.arange(S)[None, :] >= ctx.pad[:, None]  # [B, S]
        z_p = jnp.where(real[:, None, None, None], self.prompt_logits(state, qg, ctx), -jnp.inf)
        room = rk.shape[2]
        visible = jnp.arange(room)[None, :] <= n + jnp.arange(T)[:, None]  # [T, room]
        visible = visible[None] & (S + jnp.arange(room)[None, None, :] >= ctx.pad[:, None, None])  # [B, T, room]
        z_r = jnp.einsum("bhgtd,bhrd->bhgtr", qg, rk.astype(jnp.float32), precision=lax.Precision.HIGHEST) * D**-0.5
        z_r = jnp.where(visible[:, None, None], z_r, -jnp.inf)
        m = jnp.maximum(z_p.max(-1), z_r.max(-1))  # finite: the query's own token is visible
        p_p, p_r = jnp.exp(z_p - m[..., None]), jnp.exp(z_r - m[..., None])
        forced = p_r.sum(-1)
        total = p_p.sum(-1) + forced

        cap = self.row_cap(S)
        chosen = top_p_select(p_p, total, forced, self.tau)  # [B, H, G, T, S]
        union = chosen.any(axis=(2, 3))  # [B, H, S]: rows any query of the KV head needs
        in_union = union.sum(-1)
        weights = jnp.where(chosen, p_p, 0.0)
        key = jnp.where(union, (p_p / total[..., None]).max(axis=(2, 3)), -1.0)  # union members first, best first

        sizes = self.row_sizes(S)
        need = jnp.minimum(in_union.max(), cap)  # the cap when a union exceeds it: truncated
        # compare_all: a few compares, where jnp's default search is a while loop, which XLA:GPU cannot record in a
        # CUDA graph (each layer's loop split the step's graph: evals.gpu_schedule)
        which = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), need.astype(jnp.int32),
                                             method="compare_all"), len(sizes) - 1)
        rows_per_head = jnp.asarray(sizes, jnp.float32)[which]
        if cap < S:  # the union's ``cap`` rows of largest group-max probability
            top = lax.top_k(key, cap)[1]
            kept = jnp.zeros((B, H, S), bool).at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], top].set(True)
            weights = jnp.where(kept[:, :, None, None], weights, 0.0)
        if self.sizes_on_host():  # dense weights and the size index out, one f32 sum per query head and token back
            summed = weighted_union_on_host(state.values, flatten_heads(weights.reshape(B, H, G * T, S), ctx.mesh),
                                            sizes, which, state.value_scales)
            out_p = unflatten_heads(summed, B, H, ctx.mesh).reshape(B, H, G, T, D)
            w_sum = weights.sum(-1)
            moved = 4 * B * H * G * T * S + 4 + 4 * B * H * G * T * D
        else:  # the device program picks the size: ids (and weights) of ``R`` rows out

            def sized(R: int):
                """Summed values ``[B, H, G, T, D]`` and their weights' sum over the ``R`` union rows per (row, KV
                head) of largest group-max probability (every prompt row in order when ``R == S``)."""
                if R == S:  # unselected rows weigh 0
                    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, H, S))
                    count, w = jnp.full((B, H), S, jnp.int32), weights
                else:
                    rows = lax.top_k(key, R)[1].astype(jnp.int32)  # [B, H, R]
                    count = jnp.minimum(in_union, R).astype(jnp.int32)
                    w = jnp.take_along_axis(weights, jnp.broadcast_to(rows[:, :, None, None], (B, H, G, T, R)), axis=-1)
                if self.value_path == "host":
                    summed = weighted_rows_on_host(state.values, flatten_heads(rows, ctx.mesh),
                                                   flatten_heads(w.reshape(B, H, G * T, R), ctx.mesh),
                                                   state.value_scales)
                    summed = unflatten_heads(summed, B, H, ctx.mesh).reshape(B, H, G, T, D)
                else:
                    flat_rows, flat_count = flatten_heads(rows, ctx.mesh), flatten_heads(count, ctx.mesh)
                    vals = gather_rows(state.values, flat_rows, flat_count).astype(jnp.float32)
                    if state.value_scales is not None:  # a second transfer: the rows' scales
                        vals = vals * gather_rows(state.value_scales, flat_rows, flat_count)
                    summed = jnp.einsum("bhgtr,bhrd->bhgtd", w, unflatten_heads(vals, B, H, ctx.mesh),
                                        precision=lax.Precision.HIGHEST)
                return summed, w.sum(-1)

            if len(sizes) == 1:
                out_p, w_sum = sized(sizes[0])
            else:
                out_p, w_sum = lax.switch(which, [lambda R=R: sized(R) for R in sizes])
            if self.value_path == "host":
                moved = (4 + 4 * G * T) * B * H * rows_per_head + 4 * B * H * G * T * D
            else:
                moved = (4 + stored_vector_bytes(D, state.values.dtype)) * B * H * rows_per_head
        fetched = B * H * rows_per_head
        out_r = jnp.einsum("bhgtr,bhrd->bhgtd", p_r, rv.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        denom = w_sum + forced if self.renormalize else total
        out = (out_p + out_r) / denom[..., None]
        out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)

        prompt_len = jnp.maximum(S - ctx.pad, 1).astype(jnp.float32)  # [B]
        frac = chosen.sum(-1) / prompt_len[:, None, None, None]
        state = state.replace(
            recent_k=rk, recent_v=rv, selected=state.selected + frac.sum(), queries=state.queries + frac.size,
            rows=state.rows + jnp.minimum(in_union, cap).sum().astype(jnp.float32), fetched=state.fetched + fetched,
            calls=state.calls + 1, moved=state.moved + jnp.asarray(moved, jnp.float32),
            truncated=state.truncated + (in_union > cap).sum().astype(jnp.int32))
        return out, state

    # -- reporting
    def state_partition(self, state, spec: CacheSpec):
        """The staging's specs, then codes / exact keys and the recent tokens by (row, KV head), the host values
        by device block (:func:`kvjax.sharding.flatten_heads`) in ``pinned_host`` memory, counters replicated."""
        if isinstance(state, StagedKV):
            return staged_partition(state)
        return state.replace(
            codes=None if state.codes is None else ROWS_HEADS, keys=None if state.keys is None else ROWS_HEADS,
            values=OnHost(BY_DEVICE), value_scales=None if state.value_scales is None else OnHost(BY_DEVICE),
            recent_k=ROWS_HEADS, recent_v=ROWS_HEADS, selected=REPLICATED,
            queries=REPLICATED, rows=REPLICATED, fetched=REPLICATED, calls=REPLICATED, moved=REPLICATED,
            truncated=REPLICATED)

    def stats(self, cache: Cache) -> dict:
        """Key representation, bytes by kind, selection ratio per layer, value rows per call."""
        if cache.stage != "compressed":
            return {}
        layers = cache.layers
        first = layers[0]
        groups = 0 if first.codes is None else first.codes.shape[-1]
        codebook = 0 if cache.artifact is None else int(cache.artifact.arrays["codebooks"].nbytes)
        ratios = [float(st.selected) / max(float(st.queries), 1.0) for st in layers]
        calls = max(int(first.calls), 1)
        BH = first.recent_k.shape[0] * first.recent_k.shape[1]
        return {
            "key_representation": f"pq g={groups} c={self.centroids}" if groups else "exact",
            "tau": self.tau, "value_path": self.value_path,
            "code_bytes": sum(int(st.codes.nbytes) for st in layers if st.codes is not None),
            "exact_key_bytes": sum(int(st.keys.nbytes) for st in layers if st.keys is not None),
            "codebook_bytes": codebook,
            "host_value_bytes": sum(int(st.values.nbytes) + (0 if st.value_scales is None else int(st.value_scales.nbytes))
                                    for st in layers),
            "host_value_dtype": first.values.dtype.name,
            "selection_ratio_per_layer": [round(r, 5) for r in ratios],
            "selection_ratio": round(sum(ratios) / len(ratios), 5),
            "value_rows_per_head_per_call": round(sum(float(st.rows) for st in layers) / (calls * BH * len(layers)), 2),
            "value_rows_fetched_per_head_per_call": round(
                sum(float(st.fetched) for st in layers) / (calls * BH * len(layers)), 2),
            "bytes_moved_per_call": round(sum(float(st.moved) for st in layers) / calls),
            "truncated_selections": sum(int(st.truncated) for st in layers),
        }

    def bytes_read_per_step(self, cache: Cache) -> int:
        """Device bytes a decode step reads: codes (or exact keys), the codebooks and the newer tokens' K/V."""
        if cache.stage != "compressed":
            return 0
        first = cache.layers[0]
        S = first.values.shape[1]
        newer = max(int(cache.length) - S, 0)
        B, H, _, D = first.recent_k.shape
        per_layer = 2 * B * H * newer * D * first.recent_k.dtype.itemsize
        total = 0
        for st in cache.layers:
            total += per_layer + (int(st.codes.nbytes) if st.codes is not None else int(st.keys.nbytes))
        if cache.artifact is not None:
            total += int(cache.artifact.arrays["codebooks"].nbytes)
        return total
