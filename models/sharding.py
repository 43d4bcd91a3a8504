"""Tensor-parallel weights on a ``(data, model)`` mesh (:mod:`kvjax.sharding`).

Megatron-style: the fused ``qkv_proj`` and ``gate_up_proj`` are split by output rows (each device
computes its own attention heads and MLP hidden units), ``o_proj`` and ``down_proj`` by input
columns (each device multiplies its share; XLA adds one all-reduce per projection). Norms,
embeddings and the LM head are replicated, so the logits every device samples from are whole.

The fused projections hold q | k | v (and gate | up) one after the other in HF's order; splitting
those rows evenly would hand a device pieces of different projections. :func:`shard_model`
therefore reorders the rows into ``model`` blocks, each q | k | v of a contiguous share of the
heads (gate | up of a share of the hidden units), and builds the model with the same
``tensor_parallel`` block count, which reads that order back (:class:`kvjax.models.llama.Attention`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kvjax.sharding import MODEL, REPLICATED, axis_size, check_mesh, make_mesh, named
from kvjax.models.config import ModelConfig
from kvjax.models.llama import abstract_model
from kvjax.models.weights import param_name

# parameter (last two names of its path) -> partition spec of its array
_COLUMN_PARALLEL = P(MODEL, None)  # weight[out, in] split by output rows
_ROW_PARALLEL = P(None, MODEL)  # weight[out, in] split by input columns
_PARTITIONS = {
    ("qkv_proj", "weight"): _COLUMN_PARALLEL,
    ("qkv_proj", "bias"): P(MODEL),
    ("gate_up_proj", "weight"): _COLUMN_PARALLEL,
    ("o_proj", "weight"): _ROW_PARALLEL,
    ("down_proj", "weight"): _ROW_PARALLEL,
}


def _names(path) -> tuple[str, ...]:
    return tuple(param_name(path).split("."))


def param_partition(params):
    """A pytree like ``params`` of each parameter's partition spec (replicated unless tensor parallel)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _PARTITIONS.get(_names(path)[-2:], REPLICATED), params)


def interleave_rows(x: jax.Array, widths: tuple[int, ...], blocks: int) -> jax.Array:
    """Rows ``[part_0 | part_1 | ...]`` (part ``i`` has ``widths[i]`` rows) -> ``blocks`` blocks of
    ``[part_0 share | part_1 share | ...]``; ``blocks == 1`` returns ``x``."""
    if blocks == 1:
        return x
    parts, start = [], 0
    for w in widths:
        parts.append(x[start:start + w].reshape(blocks, w // blocks, *x.shape[1:]))
        start += w
    return jnp.concatenate(parts, axis=1).reshape(x.shape)


def tensor_parallel_params(params, config: ModelConfig, blocks: int):
    """``params`` in HF's fused row order -> the order of a model built with ``tensor_parallel=blocks``."""
    qkv = (config.num_heads * config.head_dim,) + (config.num_kv_heads * config.head_dim,) * 2
    gate_up = (config.intermediate_size,) * 2

    def reorder(path, x):
        names = _names(path)
        if len(names) >= 2 and names[-2] == "qkv_proj":
            return interleave_rows(x, qkv, blocks)
        if len(names) >= 2 and names[-2] == "gate_up_proj":
            return interleave_rows(x, gate_up, blocks)
        return x

    return jax.tree_util.tree_map_with_path(reorder, params)


def shard_model(model, mesh):
    """``model`` (a ``models.LoadedModel`` on one device) split over ``mesh`` (tensor parallel on ``model``).

    ``mesh``: a :class:`jax.sharding.Mesh` with axes ``(data, model)``, or ``"data=2,model=4"``.
    Returns a new ``LoadedModel`` whose ``mesh`` is set; raises ValueError when the ``model`` axis
    does not divide the heads, KV heads and MLP hidden size.
    """
    if model.mesh is not None:
        raise ValueError("the model is already on a mesh; load it again to use another one")
    mesh = make_mesh(mesh)
    config = model.config
    check_mesh(mesh, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
               intermediate_size=config.intermediate_size)
    blocks = axis_size(mesh, MODEL)
    graphdef, _ = nnx.split(abstract_model(config, model.dtype, tensor_parallel=blocks))
    params = tensor_parallel_params(model.params, config, blocks)
    shardings = jax.tree_util.tree_map(lambda spec: named(mesh, spec), param_partition(params),
                                       is_leaf=lambda x: isinstance(x, P))
    params = jax.device_put(params, shardings)
    return dataclasses.replace(model, graphdef=graphdef, params=params, mesh=mesh)
