"""Reading tensors from a safetensors checkpoint directory, lazily.

A checkpoint is either one `model.safetensors` or shards listed by `model.safetensors.index.json`
(its `weight_map` maps tensor name -> shard file). Tensors are read one at a time through
`safetensors.safe_open`, so a drafter that needs only `model.embed_tokens.weight` of a 70B target
never loads the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightsNotFoundError(FileNotFoundError):
    """The directory holds no safetensors weights (or lacks a requested tensor's shard)."""


def weight_map(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for every tensor of the checkpoint."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            mapping = json.load(f)["weight_map"]
        return {name: model_dir / shard for name, shard in mapping.items()}
    files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() else \
        sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsNotFoundError(
            f"no safetensors weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} "
            f"(specd reads only safetensors checkpoints; convert .bin/.pth weights first)")
    mapping: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                mapping[name] = path
    return mapping


def tensor_names(model_dir: str | Path) -> list[str]:
    """All tensor names of the checkpoint, in file order."""
    return list(weight_map(model_dir))


def _by_file(names: Iterable[str], mapping: dict[str, Path]) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name in names:
        grouped.setdefault(mapping[name], []).append(name)
    return grouped


def iter_tensors(model_dir: str | Path, prefix: str | None = None,
                 device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor whose name starts with `prefix` (all when None).

    Each shard is opened once; tensors are materialized one by one as the caller consumes them.
    """
    mapping = weight_map(model_dir)
    names = [n for n in mapping if prefix is None or n.startswith(prefix)]
    for path, file_names in _by_file(names, mapping).items():
        if not path.is_file():
            raise WeightsNotFoundError(
                f"shard {path.name} listed in {INDEX_FILE} is missing from {path.parent}")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in file_names:
                yield name, f.get_tensor(name)


def read_tensor(model_dir: str | Path, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
    """One tensor by its exact name, e.g. `model.embed_tokens.weight`."""
    mapping = weight_map(model_dir)
    if name not in mapping:
        raise KeyError(f"tensor {name!r} is not in the checkpoint at {model_dir}")
    with safe_open(str(mapping[name]), framework="pt", device=str(device)) as f:
        return f.get_tensor(name)


def load_tensors(model_dir: str | Path, names_or_prefix: str | Iterable[str],
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A dict of tensors: every name under a prefix (a str) or exactly the names given.

    Asking for a name the checkpoint lacks raises KeyError naming it.
    """
    if isinstance(names_or_prefix, str):
        return dict(iter_tensors(model_dir, names_or_prefix, device))
    wanted = list(names_or_prefix)
    mapping = weight_map(model_dir)
    missing = [n for n in wanted if n not in mapping]
    if missing:
        raise KeyError(f"tensors {missing} are not in the checkpoint at {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for path, file_names in _by_file(wanted, mapping).items():
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out
