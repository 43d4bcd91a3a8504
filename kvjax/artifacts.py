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
import os
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


def frozen_meta(x, digits: int | None = None):
    """A ``meta`` value made hashable: lists, tuples and arrays as tuples, dicts as ``(key, value)`` pairs,
    numpy scalars as Python numbers (floats rounded to ``digits`` when given), recursively."""
    import numpy as np

    if isinstance(x, dict):
        return tuple((k, frozen_meta(v, digits)) for k, v in x.items())
    if isinstance(x, (list, tuple, np.ndarray)):
        return tuple(frozen_meta(v, digits) for v in x)
    if isinstance(x, (float, np.floating)):
        return float(x) if digits is None else round(float(x), digits)
    if isinstance(x, np.integer):
        return int(x)
    return x


def _plain(x):
    """Tuples as lists, recursively (for JSON)."""
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x


def save_artifact(artifact: Artifact, path) -> None:
    """Write ``artifact`` to ``path``; the format follows the suffix.

    * ``.json``: arrays as nested lists with their dtype (small calibration results: head classes,
      clusters; readable and diffable);
    * ``.npz``: ``np.savez_compressed`` with each array under its name and a ``__doc__`` entry, the
      JSON of ``kind``, ``model_id``, ``meta`` and each array's dtype. When ``meta`` has
      ``storage_dtype`` (e.g. ``"float16"``) the floating arrays are stored in it and loaded back in
      their recorded dtype (halves the repository cost of f32 codebooks; the rounding is the
      artifact maker's decision, recorded in ``meta``).

    ``arrays`` must be a dict of arrays (names without ``/``; ``__doc__`` is reserved).
    """
    import numpy as np
    from pathlib import Path

    path = Path(path)
    if path.suffix == ".npz":
        meta = dict(artifact.meta)
        storage = meta.get("storage_dtype")
        arrays, dtypes = {}, {}
        for name, a in artifact.arrays.items():
            if name == "__doc__" or "/" in name:
                raise ValueError(f"artifact array name {name!r} cannot be stored in an .npz file")
            a = np.asarray(a)
            dtypes[name] = str(a.dtype)
            arrays[name] = a.astype(storage) if storage and np.issubdtype(a.dtype, np.floating) else a
        doc = {"kind": artifact.kind, "model_id": artifact.model_id,
               "meta": {k: _plain(v) for k, v in artifact.meta}, "dtypes": dtypes}
        with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a name without it
            np.savez_compressed(f, __doc__=np.asarray(json.dumps(doc)), **arrays)
        return
    if path.suffix != ".json":
        raise ValueError(f"artifact files are .json or .npz, got {path.name!r}")
    arrays = {name: {"dtype": str(np.asarray(a).dtype), "data": np.asarray(a).tolist()} for name, a in artifact.arrays.items()}
    doc = {"kind": artifact.kind, "model_id": artifact.model_id,
           "meta": {k: _plain(v) for k, v in artifact.meta}, "arrays": arrays}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def load_artifact(path) -> Artifact:
    """Read an artifact written by :func:`save_artifact` (``.json`` or ``.npz``; arrays become jax arrays)."""
    import jax.numpy as jnp
    from pathlib import Path

    path = Path(path)
    if path.suffix == ".npz":
        import numpy as np

        with np.load(path, allow_pickle=False) as z:
            if "__doc__" not in z.files:
                raise ValueError(f"{path} is not a kvjax artifact (no __doc__ entry)")
            doc = json.loads(str(z["__doc__"]))
            arrays = {name: jnp.asarray(z[name], doc["dtypes"].get(name, str(z[name].dtype)))
                      for name in z.files if name != "__doc__"}
    else:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        arrays = {name: jnp.asarray(a["data"], a["dtype"]) for name, a in doc["arrays"].items()}
    meta = tuple((k, frozen_meta(v)) for k, v in doc["meta"].items())
    return Artifact(arrays=arrays, kind=doc["kind"], model_id=doc["model_id"], meta=meta)


def artifact_stem(model_id: str, variant: str = "") -> str:
    """``<model>[-<variant>]``: an artifact file's name without its suffix."""
    model = model_id.split(":")[0] or "model"
    return f"{model}-{variant}" if variant else model


def shipped_artifact_path(kind: str, model_id: str, variant: str = "", *, suffix: str | None = None):
    """Where the artifact shipped with kvjax for ``kind`` and a model lives (may not exist).

    ``kvjax/data/<kind>/<model>[-<variant>]<suffix>``. With ``suffix=None``: the existing ``.json``
    file, else the existing ``.npz`` file (large arrays, e.g. PQ codebooks), else the ``.json`` path.
    """
    from pathlib import Path

    return _in_folder(Path(__file__).parent / "data" / kind, artifact_stem(model_id, variant), suffix)


def user_cache_dir():
    """kvjax's user cache directory: ``$KVJAX_CACHE``, else ``~/.cache/kvjax`` (not created here)."""
    from pathlib import Path

    return Path(os.environ.get("KVJAX_CACHE") or Path.home() / ".cache" / "kvjax")


def user_artifact_path(kind: str, model_id: str, variant: str = "", *, suffix: str | None = None):
    """Where ``kvjax calibrate`` / ``kvjax train-locret --install`` put an artifact made on this machine (may not
    exist): ``<user cache>/artifacts/<kind>/<model>[-<variant>]<suffix>`` (``suffix=None`` as
    :func:`shipped_artifact_path`). Artifacts too large to ship (e.g. 8192-centroid codebooks) live here."""
    return _in_folder(user_cache_dir() / "artifacts" / kind, artifact_stem(model_id, variant), suffix)


def _in_folder(folder, stem: str, suffix: str | None):
    if suffix is not None:
        return folder / f"{stem}{suffix}"
    for ext in (".json", ".npz"):
        if (folder / f"{stem}{ext}").exists():
            return folder / f"{stem}{ext}"
    return folder / f"{stem}.json"


# The command that makes each kind of artifact.
MAKERS = {"heterocache": "kvjax calibrate heterocache", "synckv": "kvjax calibrate synckv",
          "hcattention": "kvjax calibrate hcattention", "locret": "kvjax train-locret --install"}


def installed_artifact(kind: str, model_id: str, variant: str = "") -> Artifact:
    """The artifact installed for ``kind`` and the model ``model_id``: the one shipped with kvjax, else one made on
    this machine (:func:`user_artifact_path`); a clear error naming both places when there is none. The shipped one
    wins, so published figures stay reproducible; pass an artifact explicitly to use another."""
    shipped = shipped_artifact_path(kind, model_id, variant)
    user = user_artifact_path(kind, model_id, variant)
    path = shipped if shipped.exists() else user
    if not path.exists():
        maker = MAKERS.get(kind, f"kvjax calibrate {kind}")
        raise ValueError(f"no {kind} artifact for model {model_id!r} ({shipped.stem}.json|.npz): none ships with kvjax "
                         f"({shipped.parent}) and none was made in {user.parent}; run `{maker} --model <model>` "
                         "(it writes there) or pass the artifact")
    art = load_artifact(path)
    art.check(kind, model_id)
    return art


def no_artifact(artifact, name: str) -> None:
    """Raise when a method that takes no artifact is given one (it would be silently ignored)."""
    if artifact is not None:
        raise ValueError(f"method {name!r} takes no artifact, got one of kind {getattr(artifact, 'kind', type(artifact).__name__)!r}")


__all__ = ["Artifact", "frozen_meta", "model_identity", "require_artifact", "no_artifact", "save_artifact", "load_artifact",
           "artifact_stem", "shipped_artifact_path", "user_cache_dir", "user_artifact_path", "installed_artifact"]
