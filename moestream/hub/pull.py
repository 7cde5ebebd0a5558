"""Fetch a Hub model's GGUF files into the huggingface_hub cache and check them; every failure is one HubError.

Online, the repository's file list (with the sizes and sha256 the Hub reports) says which files the quant
means, and snapshot_download fetches just those: it reuses what the cache holds, resumes a transfer cut
short with a Range request, and checks each file's size. A file fetched now is also checked against the
sha256 the Hub reports; a cached one against the size (a truncated blob is fetched again). Offline
(HF_HUB_OFFLINE=1), or when the Hub cannot be reached, the cached copy is used if it holds the model.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
from dataclasses import dataclass

import huggingface_hub as hh
from huggingface_hub import constants, errors

from moestream.errors import HubError
from moestream.hub import Spec, quant

try:  # the transport errors of the HTTP library the installed huggingface_hub is built on
    from httpx2 import TransportError
except ImportError:  # pragma: no cover - huggingface_hub before httpx2
    from httpx import TransportError

CHUNK = 8 << 20


@dataclass(frozen=True)
class Pulled:
    spec: Spec
    files: list[str]  # paths in the repository, a split model's parts in order
    paths: list[str]  # the same files in the cache
    size: int  # bytes, every part together

    @property
    def tag(self) -> str:
        return quant.split_info(self.files[0]).tag


def storage_folder(repo: str) -> str:
    """The repository's folder in the Hub cache (the client's documented layout)."""
    return os.path.join(constants.HF_HUB_CACHE, "models--" + repo.replace("/", "--"))


def pull(spec: Spec) -> Pulled:
    """The model `spec` names, fetched if it is not cached yet."""
    if constants.is_offline_mode():
        return from_cache(spec, "HF_HUB_OFFLINE=1 is set")
    try:
        info = hh.model_info(spec.repo, files_metadata=True)
    except TransportError as exc:
        return from_cache(spec, f"the Hub at {constants.ENDPOINT} cannot be reached ({_first_line(exc)})")
    except Exception as exc:
        raise _hub_error(exc, spec) from None
    sizes = {s.rfilename: (s.lfs.size if s.lfs else s.size) for s in info.siblings or []}
    sha256 = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if s.lfs}
    files = choose(spec, list(sizes), "")
    snapshot = os.path.join(storage_folder(spec.repo), "snapshots", info.sha or "")
    fresh = [f for f in files if not os.path.exists(os.path.join(snapshot, f))]
    folder = _download(spec, files)
    bad = [f for f in files if os.path.getsize(os.path.join(folder, f)) != sizes[f]]
    for f in bad:  # a cached blob cut short (a full disk, a copy stopped midway): fetch it again
        print(f"note: the cached {f} is not the size the Hub reports; fetching it again", file=sys.stderr)
        _drop(os.path.join(folder, f))
    if bad:
        folder = _download(spec, files)
        fresh += bad
    paths = [os.path.join(folder, f) for f in files]
    for f, path in zip(files, paths, strict=True):
        size = os.path.getsize(path)
        if size != sizes[f]:
            raise HubError(f"{f} from hf:{spec.repo} is {size} bytes, the Hub reports {sizes[f]}; pull it again")
        if f in fresh and f in sha256:
            _check_sha256(spec, f, path, sha256[f])
    return Pulled(spec, files, paths, sum(sizes[f] for f in files))


def choose(spec: Spec, paths: list[str], where: str) -> list[str]:
    """The files of the model the quant names, among `paths` (`where`: " in the cache", or "")."""
    first = quant.find_model(paths, spec.quant)
    if first is None:
        have = quant.quants(paths)
        if not have:
            raise HubError(
                f"hf:{spec.repo} holds no GGUF model file{where}; moestream runs GGUF files (look for a -GGUF repo)"
            )
        raise HubError(f"hf:{spec.repo} has no {spec.quant} GGUF file{where}; it has: {', '.join(have)}")
    files = quant.model_files(paths, first)
    count = quant.split_info(first).count
    if len(files) != count:
        raise HubError(f"hf:{spec.repo} holds {len(files)} of the {count} parts of {first}{where}")
    return files


def from_cache(spec: Spec, why: str) -> Pulled:
    """The model from the cached snapshot of the repository's main branch, without the network."""
    folder = cached_snapshot(spec.repo)
    if folder is None:
        raise HubError(
            f"hf:{spec} is not in the Hub cache ({constants.HF_HUB_CACHE}) and {why}; "
            + (
                f"pull it while online (moestream pull {spec})"
                if "OFFLINE" in why
                else "check the network and pull it "
                "again (HF_HUB_OFFLINE=1 uses only what is cached, without asking the Hub)"
            )
        )
    files = choose(spec, _files_under(folder), " in the cache")
    paths = [os.path.join(folder, f) for f in files]
    missing = [f for f, p in zip(files, paths, strict=True) if not os.path.exists(p)]
    if missing:
        raise HubError(f"hf:{spec}: {missing[0]} is not in the Hub cache and {why}")
    print(f"note: {why}; using the cached hf:{spec}", file=sys.stderr)
    return Pulled(spec, files, paths, sum(os.path.getsize(p) for p in paths))


def cached_snapshot(repo: str) -> str | None:
    """The cached snapshot of the repository's main branch, else its most recent one."""
    storage = storage_folder(repo)
    try:
        with open(os.path.join(storage, "refs", "main"), encoding="utf-8") as f:
            folder = os.path.join(storage, "snapshots", f.read().strip())
        if os.path.isdir(folder):
            return folder
    except OSError:
        pass
    snapshots = glob.glob(os.path.join(glob.escape(storage), "snapshots", "*"))
    return max(snapshots, key=os.path.getmtime) if snapshots else None


def _files_under(folder: str) -> list[str]:
    found = []
    for root, _dirs, names in os.walk(folder):
        rel = os.path.relpath(root, folder)
        found += [n if rel == "." else f"{rel}/{n}".replace(os.sep, "/") for n in names]
    return found


def _download(spec: Spec, files: list[str]) -> str:
    try:  # fnmatch patterns: the names escaped, so that each matches its own file only
        return hh.snapshot_download(spec.repo, allow_patterns=[glob.escape(f) for f in files])
    except Exception as exc:
        raise _hub_error(exc, spec) from None


def _drop(path: str) -> None:
    """Remove a cached file: its blob, then the snapshot's link to it."""
    blob = os.path.realpath(path)
    for p in (blob, path):
        if os.path.lexists(p):
            os.remove(p)


def _check_sha256(spec: Spec, name: str, path: str, expected: str) -> None:
    print(f"checking the sha256 of {name}", file=sys.stderr)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected.lower():
        _drop(path)
        raise HubError(f"{name} from hf:{spec.repo} does not have the sha256 the Hub reports; removed it, pull again")


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")[0].split()) or type(exc).__name__
    return text[:200]


def _hub_error(exc: Exception, spec: Spec) -> HubError:
    """One line for what the client raised: what went wrong and what to do."""
    page = f"{constants.ENDPOINT}/{spec.repo}"
    token = hh.get_token() is not None
    if isinstance(exc, errors.GatedRepoError):
        if token:
            return HubError(f"hf:{spec.repo} is gated and HF_TOKEN's account has no access; ask for it on {page}")
        return HubError(f"hf:{spec.repo} is gated: accept its conditions on {page}, then set HF_TOKEN")
    if isinstance(exc, errors.RepositoryNotFoundError):
        who = "or HF_TOKEN's account cannot see it" if token else "a private one needs HF_TOKEN"
        return HubError(f"hf:{spec.repo}: no such model repository on {constants.ENDPOINT} ({who})")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        if status == 401:
            return HubError(f"the Hub refused the token (HF_TOKEN) for hf:{spec.repo}; check it")
        return HubError(f"the Hub answered {status} for hf:{spec.repo} ({_first_line(exc)}); try again later")
    if isinstance(exc, (TransportError, errors.LocalEntryNotFoundError)):
        return HubError(
            f"cannot reach the Hub at {constants.ENDPOINT} for hf:{spec} ({_first_line(exc)}); check the network, "
            "or set HF_HUB_OFFLINE=1 to use only what is cached"
        )
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return HubError(f"a download from hf:{spec.repo} was cut short ({_first_line(exc)}); pull it again")
    if isinstance(exc, (OSError, ValueError)):
        return HubError(f"fetching hf:{spec} failed: {_first_line(exc)}")
    raise exc
