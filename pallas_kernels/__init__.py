"""Pallas kernels for kvjax (imports jax only).

Each kernel module holds a kernel, its ``pallas_call`` builder(s) (a TPU and a GPU form), a public
jitted op taking ``implementation="pallas" | "pallas_interpret" | "xla"`` and a plain-``jnp``
``*_reference``; the ``backend`` module picks which form a call builds.
"""

from kvjax.pallas_kernels.paged_attention import (
    MASK_VALUE,
    check_block_table,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kvjax.pallas_kernels.pq_attention import pq_lookup_table, pq_scores, pq_scores_reference

__all__ = [
    "MASK_VALUE",
    "check_block_table",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "pq_lookup_table",
    "pq_scores",
    "pq_scores_reference",
]
