"""The trained default family (models/ in the repository, /opt/specd/models in the image).

Containers start from an empty models volume; `specd install-default-models DIR` copies the family
there (once: a folder that already holds a checkpoint is left alone), so compose and Kubernetes
serve the same trained models the README's main command serves.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specd import settings

# A checkout keeps them beside the package; the image copies them to /opt/specd/models.
CANDIDATES = (Path(__file__).resolve().parents[1] / "models", Path("/opt/specd/models"))


def default_models_dir(configured: str | Path | None = None) -> Path:
    """configured (the --source flag), else SPECD_DEFAULT_MODELS, else the candidates; the first
    folder that holds the family's target."""
    configured = configured or settings.DEFAULT_MODELS.get()
    for path in ([Path(configured)] if configured else []) + list(CANDIDATES):
        if (path / "specd-py-target" / "config.json").is_file():
            return path
    where = configured or ", ".join(str(p) for p in CANDIDATES)
    raise FileNotFoundError(f"no trained default models found (looked in {where}); pass --source or set "
                            f"{settings.DEFAULT_MODELS.name}")


def install_default_models(dest: str | Path, source: str | Path | None = None) -> list[Path]:
    """Copy every checkpoint of the default family missing from dest; returns those copied."""
    src, dest = default_models_dir(source), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for entry in sorted(src.iterdir()):
        target = dest / entry.name
        if target.exists():
            continue
        if entry.is_dir():
            shutil.copytree(entry, target)
        else:
            shutil.copy2(entry, target)
        copied.append(target)
    return copied
