"""What the Hub cache holds: every GGUF model in every cached repository, for `moestream list`.

Reads the client's cache layout ($HF_HUB_CACHE/models--OWNER--NAME/snapshots/COMMIT/...) without the
network; a file whose download never finished has no entry in a snapshot, so it is not listed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moestream.hub import quant


@dataclass(frozen=True)
class CachedModel:
    repo: str
    tag: str
    files: list[str]  # paths in the repository, in part order
    parts: int  # how many parts the names say the model has
    size: int
    folder: str  # the snapshot holding the files


def cached_models(cache: str) -> list[CachedModel]:
    """The GGUF models under `cache`, by repository and path; the same model in two snapshots once."""
    found: dict[tuple[str, tuple[str, ...]], CachedModel] = {}
    for entry in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        if not entry.startswith("models--"):
            continue
        repo = entry[len("models--") :].replace("--", "/", 1)
        snapshots = os.path.join(cache, entry, "snapshots")
        folders = [os.path.join(snapshots, c) for c in os.listdir(snapshots)] if os.path.isdir(snapshots) else []
        for folder in sorted(folders, key=os.path.getmtime, reverse=True):  # the newest first, kept on a tie
            for model in _models_in(repo, folder):
                found.setdefault((repo, tuple(model.files)), model)
    return sorted(found.values(), key=lambda m: (m.repo.lower(), m.files))


def _models_in(repo: str, folder: str) -> list[CachedModel]:
    paths = []
    for root, _dirs, names in os.walk(folder):
        rel = os.path.relpath(root, folder).replace(os.sep, "/")
        paths += [n if rel == "." else f"{rel}/{n}" for n in names if quant.is_model(n)]
    models = []
    for path in sorted(paths):
        info = quant.split_info(path)
        if info.index != 1:
            continue
        files = quant.model_files(paths, path)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
        models.append(CachedModel(repo, info.tag, files, info.count, size, folder))
    return models
