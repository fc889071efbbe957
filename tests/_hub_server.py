"""A loopback Hugging Face Hub for the hub tests: just the routes huggingface_hub 2.4.0 calls.

Download side: model info / revision resolution (``/api/models/{repo}[/revision/{rev}]``), the
tree listing (``/api/models/{repo}/tree/{rev}``) and ``/{repo}/resolve/{rev}/{file}`` (HEAD and
GET, with ETag, X-Repo-Commit, Content-Length, and byte ranges).

Upload side: repo and branch creation, README YAML validation, ``preupload``, the git-LFS batch
API with basic single-part transfers (``PUT``), and the ndjson ``commit`` endpoint.

Every request is recorded in ``FakeHub.requests``; every LFS upload in ``FakeHub.lfs_puts``.
Errors carry the Hub's ``X-Error-Code`` headers so huggingface_hub raises its own exception
types. The server listens on 127.0.0.1 only, speaks HTTP/1.0 (one request per connection, so no
handler thread outlives its request) and is stopped by ``stop()``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml
from huggingface_hub import constants
from huggingface_hub.utils import close_session

# Files the Hub stores in LFS (a subset of its default .gitattributes), and its size threshold.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model", ".tiktoken")
LFS_MIN_SIZE = 10 * 1024 * 1024


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE


@dataclasses.dataclass(frozen=True)
class Entry:
    """One file in a commit: content bytes plus the ids the Hub reports for it."""

    data: bytes

    def lfs(self, path: str) -> bool:
        return is_lfs(path, len(self.data))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    def oid(self, path: str) -> str:
        """The git blob id (for an LFS file: of its pointer), as in tree listings."""
        return git_blob_sha1(self.pointer() if self.lfs(path) else self.data)

    def etag(self, path: str) -> str:
        return self.sha256 if self.lfs(path) else git_blob_sha1(self.data)


@dataclasses.dataclass
class Repo:
    repo_id: str
    branches: dict[str, str]  # ref name ("main", "refs/pr/1") -> commit sha
    commits: dict[str, dict[str, Entry]]  # commit sha -> tree
    private: bool = False
    gated: bool = False

    def resolve(self, rev: str) -> str | None:
        if rev in self.branches:
            return self.branches[rev]
        if re.fullmatch(r"[0-9a-f]{40}", rev) and rev in self.commits:
            return rev
        return None


@dataclasses.dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body_size: int
    status: int = 0


class FakeHub:
    """In-memory Hub state plus the HTTP server that serves it."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lfs_store: dict[str, bytes] = {}  # sha256 -> content
        self.requests: list[Request] = []
        self.lfs_puts: list[str] = []  # sha256 of every LFS object PUT, in order
        self.commits_made: list[
            dict
        ] = []  # {"repo", "revision", "summary", "files", "lfs_files", "create_pr"}
        self.fail_commits = 0  # answer the next N commit calls with HTTP 422
        self.regular_only = False  # preupload: say "regular" for every file (no LFS/xet transfer)
        self._lock = threading.Lock()
        self._counter = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- state

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _new_sha(self) -> str:
        self._counter += 1
        return hashlib.sha1(f"fake-commit-{self._counter}".encode()).hexdigest()

    def add_repo(
        self, repo_id: str, files: dict[str, bytes] | None = None, *, gated: bool = False
    ) -> str:
        """Create a repo whose main branch holds ``files``; returns the commit sha."""
        sha = self._new_sha()
        tree = {".gitattributes": Entry(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n")}
        tree.update({p: Entry(d) for p, d in (files or {}).items()})
        for path, e in tree.items():
            if e.lfs(path):
                self.lfs_store[e.sha256] = e.data
        self.repos[repo_id] = Repo(repo_id, {"main": sha}, {sha: tree}, gated=gated)
        return sha

    def tree(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return {p: e.data for p, e in repo.commits[repo.branches[rev]].items()}

    def calls(self, method: str, pattern: str) -> list[Request]:
        """Recorded requests whose method fully matches ``method`` and path matches ``pattern``."""
        return [
            r
            for r in self.requests
            if re.fullmatch(method, r.method) and re.search(pattern, r.path)
        ]

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-hub",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None


class HTTPError(Exception):
    def __init__(
        self, status: int, code: str | None = None, message: str = "", headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.0"
    timeout = 10  # a stalled client cannot keep a handler thread alive

    def log_message(self, format: str, *args) -> None:  # keep test output clean
        pass

    # ---------------------------------------------------------------- plumbing

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict | None = None,
        content_length: int | None = None,
    ):
        self._record.status = status  # before the body: the client may return as soon as it has it
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header(
            "Content-Length", str(len(body) if content_length is None else content_length)
        )
        self.end_headers()
        if self.command != "HEAD" and body:
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading (a ranged read that had enough)

    def _json(self, obj, status: int = 200, headers: dict | None = None):
        self._send(
            status,
            json.dumps(obj).encode(),
            {"Content-Type": "application/json", **(headers or {})},
        )

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        parts = [unquote(p) for p in split.path.split("/")[1:]]
        body = self._body() if self.command in ("POST", "PUT") else b""
        self._record = Request(
            self.command,
            unquote(split.path),
            parse_qs(split.query),
            {k.lower(): v for k, v in self.headers.items()},
            len(body),
        )
        with self.fake._lock:
            self.fake.requests.append(self._record)
        try:
            self._route(parts, parse_qs(split.query), body)
        except HTTPError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._json({"error": e.message}, e.status, headers)

    do_GET = do_HEAD = do_POST = do_PUT = _dispatch

    def _repo(self, owner: str, name: str) -> Repo:
        repo = self.fake.repos.get(f"{owner}/{name}")
        if repo is None:
            raise HTTPError(404, "RepoNotFound", "Repository not found")
        if repo.gated and not self.headers.get("Authorization", "").endswith("hf_gate_ok"):
            raise HTTPError(401, "GatedRepo", "Access to this model is restricted")
        return repo

    def _commit(self, repo: Repo, rev: str) -> str:
        sha = repo.resolve(rev)
        if sha is None:
            raise HTTPError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    # ---------------------------------------------------------------- routes

    def _route(self, parts: list[str], query: dict, body: bytes) -> None:
        m, f = self.command, self.fake
        if m == "POST" and parts[:3] == ["api", "repos", "create"]:
            return self._create_repo(json.loads(body))
        if m == "POST" and parts[:2] == ["api", "validate-yaml"]:
            return self._validate_yaml(json.loads(body))
        if m == "PUT" and parts[0] == "_lfs":
            return self._lfs_put(parts[1], body)
        if m == "POST" and parts[:2] == ["_lfs", "verify"]:
            oid = json.loads(body)["oid"]
            return self._json({}) if oid in f.lfs_store else self._json({"error": "missing"}, 404)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = self._repo(parts[2], parts[3])
            rest = parts[4:]
            if m == "GET" and rest[:1] in ([], ["revision"]):
                rev = "/".join(rest[1:]) if rest else "main"
                return self._model_info(repo, self._commit(repo, rev))
            if m == "GET" and rest[:1] == ["tree"]:
                return self._tree(repo, self._commit(repo, rest[1]))
            if m == "POST" and rest[:1] == ["preupload"]:
                return self._preupload(
                    repo, "/".join(rest[1:]), json.loads(body), "create_pr" in query
                )
            if m == "POST" and rest[:1] == ["commit"]:
                return self._commit_api(repo, "/".join(rest[1:]), body, "create_pr" in query)
            if m == "POST" and rest[:1] == ["branch"]:
                return self._create_branch(repo, "/".join(rest[1:]), json.loads(body or b"{}"))
        if (
            len(parts) >= 3
            and parts[1].endswith(".git")
            and parts[2:] == ["info", "lfs", "objects", "batch"]
        ):
            self._repo(parts[0], parts[1][: -len(".git")])
            return self._lfs_batch(json.loads(body))
        if m in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(self._repo(parts[0], parts[1]), parts[3], "/".join(parts[4:]))
        raise HTTPError(404, None, f"no route for {m} /{'/'.join(parts)}")

    # -- download side

    def _model_info(self, repo: Repo, sha: str) -> None:
        tree = repo.commits[sha]
        self._json(
            {
                "id": repo.repo_id,
                "sha": sha,
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in tree],
            }
        )

    def _tree(self, repo: Repo, sha: str) -> None:
        out = []
        for path, e in sorted(repo.commits[sha].items()):
            item = {"type": "file", "path": path, "size": len(e.data), "oid": e.oid(path)}
            if e.lfs(path):
                item["lfs"] = {
                    "oid": e.sha256,
                    "size": len(e.data),
                    "pointerSize": len(e.pointer()),
                }
            out.append(item)
        self._json(out)

    def _resolve(self, repo: Repo, rev: str, path: str) -> None:
        sha = self._commit(repo, rev)
        entry = repo.commits[sha].get(path)
        if entry is None:
            raise HTTPError(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": sha})
        data, etag = entry.data, entry.etag(path)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if entry.lfs(path):
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(data))
        rng = self.headers.get("Range")
        if rng and self.command == "GET":
            start_s, end_s = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip()).groups()
            start = int(start_s or 0)
            end = min(int(end_s) if end_s else len(data) - 1, len(data) - 1)
            if start >= len(data):
                return self._send(416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(206, data[start : end + 1], headers)
        self._send(200, data, headers, content_length=len(data))

    # -- upload side

    def _create_repo(self, payload: dict) -> None:
        repo_id = (
            f"{payload['organization']}/{payload['name']}"
            if payload.get("organization")
            else payload["name"]
        )
        if repo_id in self.fake.repos:  # the Hub's 409 still carries the url
            msg = "You already created this model repo"
            return self._json(
                {"error": msg, "url": f"{self.fake.url}/{repo_id}"}, 409, {"X-Error-Message": msg}
            )
        self.fake.add_repo(repo_id)
        self.fake.repos[repo_id].private = payload.get("visibility") == "private" or bool(
            payload.get("private")
        )
        self._json({"url": f"{self.fake.url}/{repo_id}", "name": repo_id})

    def _validate_yaml(self, payload: dict) -> None:
        """Like the Hub: the front matter must be a YAML mapping and base_model a model id, not a path."""
        match = re.match(r"^---\n(.*?)\n---\n", payload["content"], re.DOTALL)
        try:
            data = yaml.safe_load(match.group(1)) if match else {}
            if not isinstance(data, dict):
                raise TypeError("metadata is not a mapping")
            base = data.get("base_model") or []
            for value in [base] if isinstance(base, str) else base:
                if not re.fullmatch(r"[\w][\w.-]*(/[\w][\w.-]*)?", str(value)):
                    raise ValueError(
                        f'"base_model" with value "{value}" is not valid. Use a model id from https://hf.co/models.'
                    )
        except (yaml.YAMLError, TypeError, ValueError) as e:
            return self._json({"errors": [{"message": str(e)}], "warnings": []}, 400)
        self._json({"errors": [], "warnings": []})

    def _create_branch(self, repo: Repo, branch: str, payload: dict) -> None:
        if branch in repo.branches:
            raise HTTPError(409, None, "Reference already exists")
        repo.branches[branch] = self._commit(repo, payload.get("startingPoint", "main"))
        self._json({})

    def _preupload(self, repo: Repo, rev: str, payload: dict, create_pr: bool) -> None:
        sha = repo.resolve(rev) if not create_pr else repo.branches["main"]
        if sha is None:
            raise HTTPError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        tree = repo.commits[sha]
        files = []
        for item in payload["files"]:
            path, size = item["path"], item["size"]
            mode = "regular" if self.fake.regular_only or not is_lfs(path, size) else "lfs"
            existing = tree.get(path)
            oid = (
                None
                if existing is None
                else existing.sha256
                if mode == "lfs"
                else git_blob_sha1(existing.data)
            )
            files.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._json({"files": files, "commitOid": sha})

    def _lfs_batch(self, payload: dict) -> None:
        objects = []
        for obj in payload["objects"]:
            item = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.fake.lfs_store:
                item["actions"] = {
                    "upload": {"href": f"{self.fake.url}/_lfs/{obj['oid']}"},
                    "verify": {"href": f"{self.fake.url}/_lfs/verify"},
                }
            objects.append(item)
        self._json(
            {"transfer": "basic", "objects": objects},
            headers={"Content-Type": "application/vnd.git-lfs+json"},
        )

    def _lfs_put(self, oid: str, body: bytes) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            raise HTTPError(400, None, "sha256 mismatch")
        with self.fake._lock:
            self.fake.lfs_store[oid] = body
            self.fake.lfs_puts.append(oid)
        self._send(200)

    def _commit_api(self, repo: Repo, rev: str, body: bytes, create_pr: bool) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = lines[0]["value"]
        if self.fake.fail_commits > 0:
            self.fake.fail_commits -= 1
            raise HTTPError(422, None, "commit failed (injected by the test)")
        base = repo.branches["main"] if create_pr else self._commit(repo, rev)
        tree = dict(repo.commits[base])
        files, lfs_files = [], []
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                tree[value["path"]] = Entry(base64.b64decode(value["content"]))
                files.append(value["path"])
            elif key == "lfsFile":
                data = self.fake.lfs_store.get(value["oid"])
                if data is None:
                    raise HTTPError(
                        400,
                        None,
                        f"LFS object {value['oid']} for {value['path']} was never uploaded",
                    )
                tree[value["path"]] = Entry(data)
                lfs_files.append(value["path"])
            elif key == "deletedFile":
                tree.pop(value["path"], None)
        sha = self.fake._new_sha()
        repo.commits[sha] = tree
        pr_url = None
        if create_pr:
            n = sum(1 for b in repo.branches if b.startswith("refs/pr/")) + 1
            repo.branches[f"refs/pr/{n}"] = sha
            pr_url = f"{self.fake.url}/{repo.repo_id}/discussions/{n}"
        else:
            repo.branches[rev] = sha
        self.fake.commits_made.append(
            {
                "repo": repo.repo_id,
                "revision": rev,
                "summary": header["summary"],
                "files": files,
                "lfs_files": lfs_files,
                "create_pr": create_pr,
            }
        )
        self._json(
            {
                "commitUrl": f"{self.fake.url}/{repo.repo_id}/commit/{sha}",
                "commitOid": sha,
                "pullRequestUrl": pr_url,
            }
        )


# -------------------------------------------------------------------------------------------------
# pytest fixtures shared by test_hub_download.py and test_push.py (import them by name)


@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """huggingface_hub isolated in tmp: cache, home and token file; no token, online, LFS uploads.

    huggingface_hub reads its environment once, at import, into ``huggingface_hub.constants``;
    the fixture sets both the variables and those constants. Returns the cache directory.
    """
    cache, home = tmp_path / "hf-cache", tmp_path / "hf-home"
    values = {
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(home),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,  # plain git-LFS transfers (the fake Hub has no Xet storage)
    }
    for name, value in values.items():
        monkeypatch.setattr(constants, name, value)
        monkeypatch.setenv(name, str(int(value)) if isinstance(value, bool) else value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    close_session()
    yield cache
    close_session()


def set_offline(monkeypatch, offline: bool = True) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")


@pytest.fixture
def fake_hub(hf_env, monkeypatch):
    """A started FakeHub that huggingface_hub talks to (HF_ENDPOINT); stopped after the test."""
    hub = FakeHub().start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(
            constants,
            "HUGGINGFACE_CO_URL_TEMPLATE",
            hub.url + "/{repo_id}/resolve/{revision}/{filename}",
        )
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub
    finally:
        close_session()
        hub.stop()
