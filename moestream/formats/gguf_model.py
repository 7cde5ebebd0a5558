"""A model stored as one GGUF file or as a split set (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf).

Each part of a split set is a GGUF file of its own: `split.no` (0-based), `split.count` and
`split.tensors.count` in every header, the model's metadata in the first part only, and each part's tensors
at offsets within that part. GGUFModel opens every part and shows them as one model: the first part's
metadata, every part's tensors in one table, each TensorInfo naming the part that holds it, so that a read
of a tensor (or of a slice of one) never spans two files. The rest of the engine sees one model.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np

from moestream.errors import ModelFileError
from moestream.formats.gguf_file import GGUFFile, ModelLookups, TensorInfo

# gguf-split's names (and gguf.GGUFWriter's): the prefix, the 1-based part number, the part count
SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
# Keys every part carries with its own value; any other key found in two parts must agree.
PER_PART_KEYS = frozenset({SPLIT_NO})


def part_name(prefix: str, index: int, count: int) -> str:
    """The file name of part `index` (0-based) of `count`, as gguf-split writes it."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def model_in_directory(directory: str) -> str:
    """The one model a directory holds: its only .gguf file, or a part of its only split set."""
    names = sorted(n for n in os.listdir(directory) if n.lower().endswith(".gguf"))
    sets: dict[str, list[str]] = {}
    whole = []
    for name in names:
        m = SPLIT_NAME.fullmatch(name)
        if m:
            sets.setdefault(m["prefix"], []).append(name)
        else:
            whole.append(name)
    models = [*(parts[0] for parts in sets.values()), *whole]
    if len(models) == 1:
        return os.path.join(directory, models[0])
    if not models:
        raise ModelFileError(f"{directory} holds no .gguf file; pass a model file or a directory holding one")
    listed = ", ".join(models[:4]) + (", ..." if len(models) > 4 else "")
    raise ModelFileError(
        f"{directory} holds {len(models)} models ({listed}); pass one of them with -m, or a directory holding one"
    )


def _split_int(f: GGUFFile, key: str) -> int | None:
    value = f.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelFileError(f"{f.path}: {key} must be a whole number, got {value!r}"[:300])
    return value


def model_nbytes(path: str) -> int:
    """Bytes of a model on disk: its file, or every part of a split model (benchmarks record it)."""
    model = GGUFModel(path)
    try:
        return model.file_size
    finally:
        model.close()


class GGUFModel(ModelLookups):
    """One model over one or several GGUF files: the first part's metadata, every part's tensors.

    Reads go to the part that holds the tensor: read_range takes the part's index with the offset (a
    TensorInfo's `part` and `offset`). Every part is checked against the first when opened, and any defect
    of the set (a part missing, extra, out of order, of another model, truncated) is one ModelFileError
    naming the part and what to do.
    """

    def __init__(self, path: str | os.PathLike[str]):
        path = os.fspath(path)
        if os.path.isdir(path):
            path = model_in_directory(path)
        given = GGUFFile(path)
        self.parts: list[GGUFFile] = [given]
        try:
            self.parts = _open_set(given)
            self._check_set()
        except BaseException:
            self.close()
            raise
        first = self.parts[0]
        self.path: str = first.path  # the model's name in messages: the first part
        self.metadata: dict[str, Any] = first.metadata
        self.arch: str = first.arch
        self.tensors: dict[str, TensorInfo] = {}
        for index, part in enumerate(self.parts):
            for name, info in part.tensors.items():
                self.tensors[name] = dataclasses.replace(info, part=index)

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self.parts]

    @property
    def part_sizes(self) -> list[int]:
        return [p.file_size for p in self.parts]

    @property
    def file_size(self) -> int:
        """Bytes of the whole model on disk, every part together."""
        return sum(self.part_sizes)

    def _check_set(self) -> None:
        """Every part after the first belongs to the same model: same counts, same values where both hold a
        key, no tensor twice, and all of them the number of tensors the set says it has."""
        first = self.parts[0]
        seen: dict[str, str] = {}
        for part in self.parts:
            for key, value in part.metadata.items() if part is not first else ():
                if key not in PER_PART_KEYS and key in first.metadata and first.metadata[key] != value:
                    raise ModelFileError(
                        f"{part.path} belongs to another model: its {key} differs from the first part's "
                        f"({first.path}); put the parts of one download together"
                    )
            for name in part.tensors:
                if name in seen:
                    raise ModelFileError(
                        f"{part.path} belongs to another model: tensor {name!r} is also in {seen[name]}; "
                        "put the parts of one download together"
                    )
                seen[name] = part.path
        want = _split_int(first, SPLIT_TENSORS)
        if len(self.parts) > 1 and want != len(seen):
            counts = ", ".join(f"{os.path.basename(p.path)}: {len(p.tensors)}" for p in self.parts)
            raise ModelFileError(
                f"{first.path}: the parts hold {len(seen)} tensors ({counts}) but {SPLIT_TENSORS} says {want}; "
                "a part is from another model or damaged: download the set again"
            )

    def read(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor, from the part that holds it."""
        info = self.tensor(name)
        return self.read_range(info.offset, info.nbytes, info.part)

    def read_range(self, offset: int, nbytes: int, part: int = 0) -> np.ndarray:
        return self.parts[part].read_range(offset, nbytes)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def _open_set(given: GGUFFile) -> list[GGUFFile]:
    """Every part of the set `given` belongs to, in order (just `given` when it is a whole model); the
    parts it opens are closed again if one of them is wrong."""
    count = _split_int(given, SPLIT_COUNT)
    if count is None or count <= 1 and not _split_int(given, SPLIT_NO):
        return [given]
    index = _split_int(given, SPLIT_NO) or 0
    if index >= count:
        raise ModelFileError(
            f"{given.path} says it is part {index + 1} of {count} ({SPLIT_NO} {index}, {SPLIT_COUNT} {count}); "
            "the file is damaged: download it again"
        )
    paths = _part_paths(given.path, index, count)
    parts: list[GGUFFile] = []
    try:
        for i, path in enumerate(paths):
            part = given if i == index else _open_part(path, i, count)
            parts.append(part)
            _check_part(part, i, count)
    except BaseException:
        for part in parts:
            if part is not given:
                part.close()
        raise
    return parts


def _part_paths(path: str, index: int, count: int) -> list[str]:
    """The file names of the set `path` is part `index` of, from its name; an extra part beside them (of the
    same name but another count or number) is an error."""
    directory, name = os.path.split(path)
    m = SPLIT_NAME.fullmatch(name)
    if m is None:
        raise ModelFileError(
            f"{path} is part {index + 1} of {count} of a split model, but its name does not end in "
            "-NNNNN-of-NNNNN.gguf, so the other parts cannot be found; keep the names gguf-split gave the parts"
        )
    if int(m["no"]) != index + 1 or int(m["count"]) != count:
        raise ModelFileError(
            f"{path} says it is part {index + 1} of {count} ({SPLIT_NO} {index}, {SPLIT_COUNT} {count}) but is "
            f"named part {int(m['no'])} of {int(m['count'])}; the parts were renamed or mixed: rename them back"
        )
    prefix = m["prefix"]
    paths = [os.path.join(directory, part_name(prefix, i, count)) for i in range(count)]
    expected = {os.path.basename(p) for p in paths}
    for other in sorted(os.listdir(directory or ".")):
        om = SPLIT_NAME.fullmatch(other)
        if om and om["prefix"] == prefix and other not in expected:
            raise ModelFileError(
                f"{os.path.join(directory, other)} is an extra part: the set of {name} has {count} parts "
                f"({SPLIT_COUNT}); move it out of {directory or '.'}"
            )
    return paths


def _open_part(path: str, index: int, count: int) -> GGUFFile:
    if not os.path.exists(path):
        raise ModelFileError(
            f"part {index + 1} of {count} is missing: {path} does not exist; download it next to the other parts"
        )
    return GGUFFile(path)


def _check_part(part: GGUFFile, index: int, count: int) -> None:
    """Part `index` of `count` says so in its header."""
    no, got = _split_int(part, SPLIT_NO), _split_int(part, SPLIT_COUNT)
    if got is None or no is None:
        raise ModelFileError(
            f"{part.path} has no {SPLIT_NO}/{SPLIT_COUNT} in its header, so it is not a part of this split "
            "model; put the right part in its place"
        )
    if got != count:
        raise ModelFileError(
            f"{part.path} belongs to a set of {got} parts ({SPLIT_COUNT}) but the others say {count}; "
            "put the parts of one download together"
        )
    if no != index:
        raise ModelFileError(
            f"{part.path} is named part {index + 1} but its header says part {no + 1} ({SPLIT_NO} {no}); "
            "the parts are out of order: give each file the name gguf-split gave it"
        )
