"""Turning a model argument (a directory or a Hub id) into a local checkpoint directory.

specd never downloads weights: a Hub id is accepted only when its snapshot is already in the
local Hugging Face cache, found with `try_to_load_from_cache`, which reads the cache folders and
makes no network request.
"""

from __future__ import annotations

from pathlib import Path


class ModelNotFoundError(ValueError):
    """The model is neither a local checkpoint directory nor in the local Hugging Face cache."""


def _not_found(path_or_id: str, detail: str = "") -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {path_or_id!r} is not a local directory and is not in the local Hugging Face "
        f"cache; specd does not download weights: pass the path of a directory holding "
        f"config.json and *.safetensors" + (f" ({detail})" if detail else ""))


def resolve_model_path(path_or_id: str | Path, *, cache_dir: str | Path | None = None,
                       revision: str | None = None) -> Path:
    """The local directory holding the model's config.json.

    `cache_dir` overrides the Hugging Face cache location (lmdeploy's `download_dir`).
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise _not_found(str(path_or_id), f"directory {path} has no config.json")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        raise _not_found(str(path_or_id)) from None
    try:
        cached = try_to_load_from_cache(str(path_or_id), "config.json", cache_dir=cache_dir,
                                        revision=revision)
    except ValueError:  # not a valid repo id (e.g. an absolute path that does not exist)
        cached = None
    if isinstance(cached, str) and Path(cached).is_file():
        return Path(cached).parent
    raise _not_found(str(path_or_id))
