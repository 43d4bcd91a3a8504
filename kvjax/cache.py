"""The immutable KV-cache pytree passed into and returned from every jitted model call.

A :class:`Cache` holds one state per layer (whatever pytree its method defines), the number of
cache *slots* written so far, each row's left padding and the method's artifact (calibration
results, codebooks, trained heads: data, never attributes of the hashable method). Slots are the
sequence positions of the padded batch: row ``b`` holds real tokens from slot ``pad[b]`` on, and
its token at slot ``s`` has position ``s - pad[b]``. All rows share the slot counter, so a batch
decodes in lock step.

Static facts are not pytree leaves: the method (its hyper-parameters), the :class:`CacheSpec` the
cache was allocated for, and the ``stage``:

* ``"prefill"``: prompt chunks go to ``method.prefill_chunk`` (the method records, may evict);
* ``"compressed"``: after ``kvjax.decoding.compress`` ran ``method.finish_prefill`` on every layer;
  every later token (a question of any length, a second turn, one decoded token per step) goes to
  ``method.decode_attend``, which appends it uncompressed and attends;
* ``"reconstruction"``: a prefilled cache during a scoring pass over extra tokens before compression (KVzip's
  context reconstruction, :func:`kvjax.methods.kvzip.score_context`, for a method whose ``rereads_context()`` is
  True): ``prefill_chunk`` gets ``ctx.reconstruction`` set, attends the prompt and the pass, and returns its state
  without the pass's tokens;
* ``"rehearsal"``: a compressed cache during a rehearsal of a question, every pass but the last (only
  inside ``kvjax.decoding.prefill``, for a method whose ``question_passes()`` is above 1):
  ``decode_attend`` gets ``ctx.rehearsal`` set and returns its state without the call's tokens.

The model calls :meth:`Cache.attend` and nothing else, so adding a method never touches the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

STAGES = ("prefill", "compressed")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a cache is allocated for (static, hashable).

    Attributes:
      num_layers, num_heads, num_kv_heads, head_dim: the model's attention shape.
      batch: rows.
      prompt_slots: slots of the (left-padded) prompt.
      longest_row: real tokens of the longest prompt row (budgets allocate for it).
      room: slots per head after the prompt (question tokens + generated tokens).
      dtype: name of the K/V dtype ("float32" | "bfloat16").
      kv_dtype: name of the dtype the compressed page pools and the full cache store (None: ``dtype``; "bfloat16",
        or "int8" / "float8_e4m3fn" with per-token scales: :mod:`kvjax.kv_quantization`).
      model_id: identity of the model (:func:`kvjax.artifacts.model_identity`), checked against artifacts.
      mesh: the ``(data, model)`` :class:`jax.sharding.Mesh` the cache is split over (:mod:`kvjax.sharding`),
        or None for one device.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    prompt_slots: int
    longest_row: int
    room: int
    dtype: str = "float32"
    model_id: str = ""
    mesh: Any = None
    kv_dtype: str | None = None

    def __post_init__(self):
        from kvjax.kv_quantization import check_kv_dtype

        object.__setattr__(self, "kv_dtype", check_kv_dtype(self.kv_dtype, self.dtype))
        if self.batch <= 0 or self.prompt_slots <= 0 or self.room < 0:
            raise ValueError(f"need batch > 0, prompt_slots > 0, room >= 0; got {self.batch}, {self.prompt_slots}, {self.room}")
        if not 0 < self.longest_row <= self.prompt_slots:
            raise ValueError(f"longest_row must be in [1, prompt_slots={self.prompt_slots}], got {self.longest_row}")
        if self.mesh is not None:
            from kvjax.sharding import check_mesh

            check_mesh(self.mesh, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, batch=self.batch)

    @classmethod
    def for_model(cls, config, batch: int, prompt_slots: int, room: int, dtype, *, longest_row: int | None = None,
                  mesh=None, kv_dtype=None) -> "CacheSpec":
        """Spec for a model ``config`` (``models.ModelConfig``); ``longest_row`` defaults to ``prompt_slots``,
        ``kv_dtype`` to ``dtype``."""
        from kvjax.artifacts import model_identity

        return cls(
            num_layers=config.num_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, batch=batch, prompt_slots=prompt_slots,
            longest_row=prompt_slots if longest_row is None else longest_row, room=room,
            dtype=jnp.dtype(dtype).name, model_id=model_identity(config), mesh=mesh, kv_dtype=kv_dtype,
        )

    @property
    def total_slots(self) -> int:
        """Slots the cache can ever hold: the prompt plus the room."""
        return self.prompt_slots + self.room


@struct.dataclass
class AttendContext:
    """What a method's attend functions may need besides q, k, v.

    Attributes:
      layer: layer index (static).
      start: int32 scalar, slot of the first query token of this call.
      pad: int32 [B], left-padding slots per row (never attended).
      positions: int32 [B, T], RoPE positions of the query tokens.
      q_pre_rope, k_pre_rope: [B, T, H, D] projections before RoPE (Locret scores these).
      rope_inv_freq: f32 [D/2], the model's RoPE inverse frequencies (methods that move cached keys to
        other positions, :func:`kvjax.rope.shift_rope`), or None.
      artifact: the cache's artifact pytree (or None).
      layers: every layer's state as of this call: layers before ``layer`` already updated by this
        call, later ones as of the previous call (set by :meth:`Cache.attend`; heads that follow
        another layer's heads read it).
      mesh: the cache's device mesh (static; None for one device): kernels run per device under it.
      reconstruction: (static) this call is a scoring pass over the prefilled prompt (stage ``"reconstruction"``):
        the method attends the prompt and the call's tokens and returns its state without them.
      rehearsal: (static) this call is a rehearsal of a question (stage ``"rehearsal"``, every pass but the last): the
        method may change what it holds (recall, re-anchoring) but returns its state without the tokens.
    """

    start: jax.Array
    pad: jax.Array
    positions: jax.Array
    q_pre_rope: jax.Array | None = None
    k_pre_rope: jax.Array | None = None
    rope_inv_freq: jax.Array | None = None
    artifact: Any = None
    layers: tuple | None = None
    layer: int = struct.field(pytree_node=False, default=0)
    mesh: Any = struct.field(pytree_node=False, default=None)
    rehearsal: bool = struct.field(pytree_node=False, default=False)
    reconstruction: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class FinishContext:
    """What ``method.finish_prefill`` may need for one layer: padding, the artifact, the spec, and
    ``layers``: every layer's prefill-stage state (heads chosen by another layer's heads read it)."""

    pad: jax.Array
    artifact: Any = None
    layers: tuple | None = None
    layer: int = struct.field(pytree_node=False, default=0)
    spec: CacheSpec | None = struct.field(pytree_node=False, default=None)


@struct.dataclass
class Cache:
    """Per-layer method states, the shared slot counter, per-row left padding and the artifact."""

    layers: tuple
    length: jax.Array  # int32 [] slots written so far
    pad: jax.Array  # int32 [B] left-padding slots per row
    artifact: Any = None
    method: Any = struct.field(pytree_node=False, default=None)
    spec: CacheSpec | None = struct.field(pytree_node=False, default=None)
    stage: str = struct.field(pytree_node=False, default="prefill")

    @classmethod
    def create(cls, layers: tuple, method, spec: CacheSpec, artifact: Any = None) -> "Cache":
        """A fresh prefill-stage cache: nothing written yet, no padding (set ``pad`` with ``replace``).

        The cache holds its own copy of the artifact's arrays (:func:`own_arrays`): jitted calls donate
        the cache, which would otherwise delete the caller's artifact (e.g. one set of codebooks
        passed to several caches).
        """
        return cls(layers=layers, length=jnp.zeros((), jnp.int32), pad=jnp.zeros((spec.batch,), jnp.int32),
                   artifact=own_arrays(artifact), method=method, spec=spec)

    @property
    def batch_size(self) -> int:
        """Rows in the batch."""
        return int(self.pad.shape[0])

    @property
    def capacity(self) -> int:
        """Slots the cache can ever hold (prompt + room)."""
        return self.spec.total_slots

    def attend(self, q, k, v, ctx: AttendContext):
        """Hand one layer's new ``q[B,T,Hq,D]``, ``k, v[B,T,Hkv,D]`` (post-RoPE) to the method for this stage.

        Returns ``(attention output [B, T, Hq, D], the layer's new state)``.
        """
        state = self.layers[ctx.layer]
        ctx = ctx.replace(artifact=self.artifact, layers=self.layers, mesh=self.spec.mesh if self.spec else None)
        if self.stage in ("prefill", "reconstruction"):
            return self.method.prefill_chunk(state, q, k, v, ctx.replace(reconstruction=self.stage == "reconstruction"))
        return self.method.decode_attend(state, q, k, v, ctx.replace(rehearsal=self.stage == "rehearsal"))

    def device_bytes(self) -> int:
        """Bytes of all device-memory arrays held by the cache (from the arrays' sizes)."""
        return bytes_by_memory_kind(self)[0]

    def host_bytes(self) -> int:
        """Bytes of all host-memory (``pinned_host`` / ``unpinned_host``) arrays held by the cache."""
        return bytes_by_memory_kind(self)[1]

    def stats(self) -> dict:
        """Device and host bytes actually held (artifact included; ``artifact_device_bytes``: its part, weights held
        once per model whatever the batch), the most any one device holds (a mesh splits the cache), slots used, the
        method's own facts."""
        device, host = bytes_by_memory_kind(self)
        return {
            "method": self.method.name,
            "stage": self.stage,
            "device_bytes": device,
            "artifact_device_bytes": bytes_by_memory_kind(self.artifact)[0],
            "device_bytes_per_device": device_bytes_per_device(self),
            "host_bytes": host,
            "length": int(self.length),
            "capacity": self.capacity,
            "kv_bytes_read_per_step": self.method.bytes_read_per_step(self),
            **self.method.stats(self),
        }


def own_arrays(tree):
    """A copy of every array leaf of ``tree`` (a cache is donated to jitted calls; its leaves must be its own)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True) if hasattr(x, "dtype") else x, tree)


def array_bytes(x) -> int:
    """Bytes of one array from its shape and dtype."""
    return int(x.size) * jnp.dtype(x.dtype).itemsize


def memory_kind(x: jax.Array) -> str:
    """The memory kind an array lives in ("device" when the platform does not say)."""
    sharding = getattr(x, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    return kind or "device"


def format_bytes(n: float, digits: int = 1) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.0 GiB`` (``digits`` after the point)."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} GiB"


def bytes_by_memory_kind(tree) -> tuple[int, int]:
    """(device bytes, host bytes) of every array leaf of ``tree``."""
    device = host = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if not hasattr(leaf, "dtype"):
            continue
        if "host" in memory_kind(leaf):
            host += array_bytes(leaf)
        else:
            device += array_bytes(leaf)
    return device, host


def device_bytes_per_device(tree) -> int:
    """The most device-memory bytes of ``tree``'s arrays that any one (addressable) device holds: its shards."""
    held: dict = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        if not hasattr(leaf, "addressable_shards") or "host" in memory_kind(leaf):
            continue
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + array_bytes(shard.data)
    return max(held.values(), default=0)


def new_cache(method, config, batch: int, prompt_slots: int, room: int, dtype, *, longest_row: int | None = None,
              artifact: Any = None, mesh=None, kv_dtype=None) -> Cache:
    """``method.init_cache`` for a model ``config`` (the spec built with :meth:`CacheSpec.for_model`),
    placed on ``mesh`` when given (:func:`kvjax.sharding.place_cache`)."""
    from kvjax.sharding import place_cache

    spec = CacheSpec.for_model(config, batch, prompt_slots, room, dtype, longest_row=longest_row, mesh=mesh,
                               kv_dtype=kv_dtype)
    return place_cache(method.init_cache(spec, artifact))


def unstorable(methods: dict, config, prompt_slots: int, room: int, dtype, *, kv_dtype=None,
               artifacts: dict | None = None) -> dict[str, str]:
    """name -> reason for each of ``methods`` (name -> method) whose cache cannot be built for one row of
    ``prompt_slots`` + ``room`` tokens stored in ``kv_dtype``; checked by shape alone (nothing is allocated)."""
    artifacts = artifacts or {}
    problems = {}
    for name, m in methods.items():
        try:
            jax.eval_shape(lambda m=m, a=artifacts.get(name): new_cache(m, config, 1, prompt_slots, room, dtype,
                                                                        artifact=a, kv_dtype=kv_dtype))
        except ValueError as e:
            problems[name] = str(e)
    return problems
