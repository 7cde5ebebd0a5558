"""A stand-in for the Hugging Face Hub on 127.0.0.1, answering the calls the huggingface_hub client makes
(read from its source: file_download.py, _snapshot_download.py, hf_api.py), so that tests run the real
client over real HTTP without the network.

- GET /api/models/OWNER/NAME[/revision/REV][?blobs=true]: the model's info, its files as `siblings` with
  size, git blob id and LFS sha256 (model_info, repo_info)
- GET /api/models/OWNER/NAME/tree/REV[?recursive=true]: the files and folders (list_repo_tree)
- HEAD and GET /OWNER/NAME/resolve/REV/PATH: a file, with the headers the client requires (X-Repo-Commit,
  ETag, X-Linked-Etag and X-Linked-Size, Content-Length) and Range requests for resuming (206)

Errors are answered as the Hub does: 401 with X-Error-Code RepoNotFound for a repository that is missing or
private (without its token), GatedRepo for a gated one's files. Every request is logged; `cut` drops the
connection partway through a file once, `corrupt` serves a file with one byte changed.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    token: str | None = None  # private: only this token sees it

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def blob_id(self, path: str) -> str:
        return hashlib.sha1(self.files[path][:64]).hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    cut: dict[str, int] = field(default_factory=dict)  # file path: bytes sent before the connection drops
    corrupt: set[str] = field(default_factory=set)

    def __post_init__(self):
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, path: str) -> list[str | None]:
        """The Range header of every GET of a file (None: the whole file)."""
        return [r for m, p, r in self.log if m == "GET" and p.endswith("/" + path) and "/resolve/" in p]


API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?P<sub>/.*)?)?")
RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args) -> None:  # quiet: the hub keeps its own log
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.hub.log.append((self.command, path, self.headers.get("Range")))
        api, resolve = API.fullmatch(path), RESOLVE.fullmatch(path)
        match = api or resolve
        repo = self.hub.repos.get(match["repo"]) if match else None
        if repo is None or (repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}"):
            return self._error(401, "RepoNotFound", "Repository not found")
        if api and api["kind"] == "tree":
            return self._json(_tree(repo, (api["sub"] or "").strip("/"), parse_qs(url.query).get("recursive")))
        if api:
            return self._json(_info(match["repo"], repo))
        if resolve["rev"] not in ("main", repo.commit):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        if repo.gated and not self.headers.get("Authorization"):
            return self._error(401, "GatedRepo", "Access to this model is restricted; log in")
        if resolve["path"] not in repo.files:
            return self._error(404, "EntryNotFound", "Entry not found", repo.commit)
        self._file(repo, resolve["path"], head)

    def _file(self, repo: Repo, path: str, head: bool) -> None:
        data = repo.files[path]
        if path in self.hub.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start = 0
        ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if ranged and not head:
            start = int(ranged[1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{repo.blob_id(path)}"')
        self.send_header("X-Linked-Etag", f'"{repo.sha256(path)}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        cut = self.hub.cut.pop(path, None) if not start else None
        if cut is not None:  # send part of the body, then drop the connection as a failing network would
            self.wfile.write(data[:cut])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(data[start:])

    def _json(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _lfs(repo: Repo, path: str, key: str) -> dict:
    return {key: repo.sha256(path), "size": len(repo.files[path]), "pointerSize": 134}


def _info(name: str, repo: Repo) -> dict:
    siblings = [
        {"rfilename": p, "size": len(d), "blobId": repo.blob_id(p), "lfs": _lfs(repo, p, "sha256")}
        for p, d in sorted(repo.files.items())
    ]
    return {
        "_id": "0" * 24,
        "id": name,
        "modelId": name,
        "sha": repo.commit,
        "private": repo.token is not None,
        "gated": "auto" if repo.gated else False,
        "disabled": False,
        "tags": ["gguf"],
        "siblings": siblings,
    }


def _tree(repo: Repo, under: str, recursive: list[str] | None) -> list[dict]:
    deep = bool(recursive and recursive[0].lower() == "true")
    prefix = under + "/" if under else ""
    entries, folders = [], set()
    for p in sorted(repo.files):
        if not p.startswith(prefix):
            continue
        rest = p[len(prefix) :]
        if "/" in rest and not deep:
            folders.add(prefix + rest.split("/")[0])
            continue
        folders.update(prefix + "/".join(rest.split("/")[: i + 1]) for i in range(rest.count("/")))
        size = len(repo.files[p])
        entries.append({"type": "file", "oid": repo.blob_id(p), "size": size, "path": p, "lfs": _lfs(repo, p, "oid")})
    return [{"type": "directory", "oid": "0" * 40, "path": f} for f in sorted(folders)] + entries
