"""Artifacts: calibration results and trained weights that travel with a cache as data.

Head classes, clusters, PQ codebooks and Locret's retaining heads are arrays made offline for one
model. They are an :class:`Artifact` pytree passed to ``init_cache`` (and carried by
:class:`kvjax.cache.Cache` as a pytree field), never attributes of the hashable method object, so
jitted functions take them as arguments and changing them does not recompile.

Every artifact records the identity of the model it was made for (:func:`model_identity`: the
model's name and a hash of its architecture); using it with another model is a clear error.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from flax import struct

IDENTITY_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "rope_theta")


def model_identity(config) -> str:
    """``"<name>:<hash of the architecture>"`` for a ``models.ModelConfig`` (stable across runs)."""
    arch = {f: getattr(config, f, None) for f in IDENTITY_FIELDS}
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{getattr(config, 'name', '') or 'model'}:{digest}"


@struct.dataclass
class Artifact:
    """A method's offline data: ``arrays`` (any pytree of arrays) made for the model ``model_id``.

    ``kind`` names the method that made it (e.g. "heterocache"); ``meta`` holds static facts (a
    tuple of ``(key, value)`` pairs, hashable).
    """

    arrays: Any
    kind: str = struct.field(pytree_node=False, default="")
    model_id: str = struct.field(pytree_node=False, default="")
    meta: tuple = struct.field(pytree_node=False, default=())

    def check(self, kind: str, model_id: str) -> None:
        """Raise ValueError unless this artifact is of ``kind`` and was made for ``model_id``."""
        if self.kind != kind:
            raise ValueError(f"artifact of kind {self.kind!r} given to a {kind!r} method")
        if self.model_id != model_id:
            raise ValueError(
                f"{kind} artifact was made for model {self.model_id!r}, but the cache is for {model_id!r}; "
                "calibrate (or train) it for this model"
            )

    def meta_dict(self) -> dict[str, Any]:
        """``meta`` as a dict."""
        return dict(self.meta)


def require_artifact(artifact, kind: str, model_id: str) -> Artifact:
    """The artifact, checked against ``kind`` and ``model_id``; a clear error when it is missing."""
    if artifact is None:
        raise ValueError(f"method {kind!r} needs an artifact (calibration data or trained weights); none was given")
    if not isinstance(artifact, Artifact):
        raise TypeError(f"expected a kvjax.artifacts.Artifact for {kind!r}, got {type(artifact).__name__}")
    artifact.check(kind, model_id)
    return artifact


def no_artifact(artifact, name: str) -> None:
    """Raise when a method that takes no artifact is given one (it would be silently ignored)."""
    if artifact is not None:
        raise ValueError(f"method {name!r} takes no artifact, got one of kind {getattr(artifact, 'kind', type(artifact).__name__)!r}")


__all__ = ["Artifact", "model_identity", "require_artifact", "no_artifact"]
