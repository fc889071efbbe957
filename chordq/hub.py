"""The Hugging Face Hub boundary: fetch a source checkpoint, push a converted one.

All network and cache work is huggingface_hub's: its standard cache (``HF_HUB_CACHE``), token
lookup (``token=``, ``HF_TOKEN``, ``hf auth login``), offline mode (``HF_HUB_OFFLINE=1``),
endpoint (``HF_ENDPOINT``), retries and resumable uploads. This module only chooses what to
fetch or send and turns huggingface_hub's exceptions into chordq's one-line errors. The token is
handed to huggingface_hub and nothing else: never printed, logged, returned or written.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import (
    HfApi,
    constants,
    hf_hub_download,
    hf_hub_url,
    scan_cache_dir,
    snapshot_download,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    CacheNotFound,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import get_hf_file_metadata
from huggingface_hub.utils import (
    build_hf_headers,
    filter_repo_objects,
    get_session,
    hf_raise_for_status,
    validate_repo_id,
)
from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

from . import __version__
from .card import render_card
from .errors import InputError, OutputError
from .shards import INDEX_NAME, MAX_HEADER_BYTES
from .writer import TMP_SUFFIX, atomic_write_text

__all__ = [
    "METADATA_PATTERNS",
    "WEIGHT_PATTERNS",
    "HubSource",
    "check_pushable",
    "is_hub_id",
    "push_checkpoint",
]

# The same names as convert.MANIFEST_NAME and verify.VERIFY_JSON; not imported from there, so that
# convert and verify can import this module (tests/test_push.py checks they agree).
MANIFEST_NAME = "chordq_manifest.json"
VERIFY_NAME = "chordq_verify.json"
# What HubSource.metadata() downloads up front: configs, index, tokenizer, remote code, card.
METADATA_PATTERNS = [
    "*.json", "*.py", "*.txt", "*.tiktoken", "*.model", "*.jinja", "README.md", "LICENSE*",
]  # fmt: skip
# Never part of the metadata download: weights (safetensors are fetched shard by shard; pickles never).
WEIGHT_PATTERNS = [
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.pkl",
    "*.gguf",
    "*.h5",
    "*.msgpack",
]
# Left out of a push: chordq's resume state (it holds local paths), partial writes, hidden files.
PUSH_IGNORE = [MANIFEST_NAME, f"*{TMP_SUFFIX}", ".*", "*/.*"]
# First ranged read of a remote shard; a K2 shard header is ~0.5 MB, so this usually suffices.
_FIRST_READ = 1 << 20


def _valid_repo_id(repo_id: str) -> bool:
    if repo_id.count("/") != 1 or any(part in ("", ".", "..") for part in repo_id.split("/")):
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def is_hub_id(source: str) -> bool:
    """True for a string that names a Hub model (``owner/name``) rather than a local path.

    An existing local path always wins, so ``./org/model`` on disk is never sent to the Hub.

    >>> is_hub_id("moonshotai/Kimi-K2-Instruct-0905")
    True
    >>> is_hub_id("/data/Kimi-K2-Instruct")
    False
    """
    return not os.path.exists(source) and _valid_repo_id(source)


# --------------------------------------------------------------------------------------------
# download side


@contextlib.contextmanager
def _input_errors(repo_id: str, revision: str, what: str) -> Iterator[None]:
    """Map huggingface_hub's download errors to one-line InputErrors naming the repo and the fix."""
    try:
        yield
    except GatedRepoError:
        raise InputError(
            f"{repo_id}: gated model; accept its terms on the Hub, then log in (hf auth login or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise InputError(
            f"{repo_id}: no such local directory and no such model on the Hub "
            "(if it is private, log in with hf auth login or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise InputError(
            f"{repo_id}: revision {revision!r} not found on the Hub; check --revision"
        ) from None
    except RemoteEntryNotFoundError:
        raise InputError(
            f"{repo_id}: {what} not found at revision {revision!r}; the repo is incomplete"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if constants.is_offline_mode():
            raise InputError(
                f"{repo_id}: {what} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
                "download it once online or unset HF_HUB_OFFLINE"
            ) from None
        raise InputError(
            f"{repo_id}: cannot reach the Hub and {what} is not cached; check the network or HF_ENDPOINT and rerun"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status == 401:
            raise InputError(
                f"{repo_id}: the Hub rejected the token (HTTP 401); log in again (hf auth login)"
            ) from None
        raise InputError(
            f"{repo_id}: Hub request for {what} failed (HTTP {status}); rerun to retry"
        ) from None
    except httpx2.HTTPError as e:
        raise InputError(
            f"{repo_id}: cannot reach the Hub ({type(e).__name__}); check the network or HF_ENDPOINT and rerun"
        ) from None


def _split_header(prefix: bytes, size: int, where: str) -> int:
    """Validate a safetensors file's 8-byte prefix; returns the header length."""
    if len(prefix) < 8:
        raise InputError(f"{where}: not a safetensors file ({size} bytes)")
    (hlen,) = struct.unpack("<Q", prefix[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise InputError(
            f"{where}: corrupt safetensors header (claims {hlen} bytes, file has {size})"
        )
    return hlen


class HubSource:
    """A model repo on the Hub, fetched file by file into the standard huggingface_hub cache.

    ``metadata()`` pins the revision to one commit, so every later ``fetch`` reads the same
    commit even if the branch moves during a long conversion.

    :param repo_id: ``owner/name``
    :param revision: branch, tag or commit (default: the default branch)
    :param token: passed to huggingface_hub; ``None`` means the usual places (``HF_TOKEN``, login)

    Example::

        src = HubSource("moonshotai/Kimi-K2-Instruct-0905")
        root = src.metadata()                 # config.json, index, tokenizer, *.py; no weights
        header, size = src.remote_header("model-00001-of-000062.safetensors")  # two range reads
        path = src.fetch("model-00001-of-000062.safetensors")  # -> .../snapshots/<commit>/...
        src.delete("model-00001-of-000062.safetensors")          # free the disk (--delete-source)
    """

    def __init__(
        self, repo_id: str, revision: str | None = None, token: str | bool | None = None
    ) -> None:
        if not _valid_repo_id(repo_id):
            raise InputError(
                f"{repo_id}: not a local directory and not a Hub model id (owner/name)"
            )
        self.repo_id = repo_id
        self.revision = revision
        self._token = token  # handed to huggingface_hub only
        self._commit: str | None = None

    def __repr__(self) -> str:  # no token
        return f"HubSource({self.repo_id!r}, revision={self.revision!r}, commit={self._commit!r})"

    @property
    def commit(self) -> str | None:
        """The commit every file is read from, once ``metadata()`` has resolved it."""
        return self._commit

    @property
    def _rev(self) -> str:
        return self._commit or self.revision or constants.DEFAULT_REVISION

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _input_errors(self.repo_id, self.revision or constants.DEFAULT_REVISION, what)

    def metadata(self) -> Path:
        """Download every small non-weight file and return the local snapshot directory.

        That is config.json, ``model.safetensors.index.json``, generation config, tokenizer
        files, remote-code ``*.py``, ``*.txt``/``*.tiktoken``/``*.model``/``*.jinja`` and README.md;
        never ``*.safetensors`` or pickles. Offline, the cached snapshot of the revision is used.
        """
        with self._errors("the model's config and index"):
            path = Path(
                snapshot_download(
                    self.repo_id,
                    revision=self.revision,
                    token=self._token,
                    allow_patterns=METADATA_PATTERNS,
                    ignore_patterns=WEIGHT_PATTERNS,
                    library_name="chordq",
                    library_version=__version__,
                )
            )
        self._commit = path.name
        if not (path / "config.json").is_file():
            where = "in the Hugging Face cache" if constants.is_offline_mode() else "in the repo"
            raise InputError(
                f"{self.repo_id}: no config.json {where} at revision {self._rev}; is it a model repo?"
            )
        return path

    def fetch(self, filename: str) -> Path:
        """Download one file (a shard) into the cache, resuming a partial download; returns its path."""
        with self._errors(filename):
            return Path(
                hf_hub_download(
                    self.repo_id,
                    filename,
                    revision=self._rev,
                    token=self._token,
                    library_name="chordq",
                    library_version=__version__,
                )
            )

    def delete(self, filename: str) -> int:
        """Remove one cached file (for ``--delete-source``); returns the bytes freed.

        Removes the snapshot link and, unless another cached revision still uses it, the blob,
        through huggingface_hub's cache manager (which also handles its shared Xet blob store).
        """
        try:
            cache = scan_cache_dir(constants.HF_HUB_CACHE)
        except CacheNotFound:
            return 0
        files = [
            f
            for repo in cache.repos
            if repo.repo_id == self.repo_id and repo.repo_type == "model"
            for rev in repo.revisions
            if self._commit is None or rev.commit_hash == self._commit
            for f in rev.files
            if f.file_path.relative_to(rev.snapshot_path).as_posix() == filename
        ]
        if not files:
            return 0
        strategy = cache.delete_files(*files)
        strategy.execute()
        return strategy.expected_freed_size

    def remote_header(self, filename: str) -> tuple[bytes, int]:
        """Read a shard's safetensors header without downloading the shard.

        :returns: ``(header, size)``: the header's JSON bytes exactly as stored (so
            ``hashlib.sha256(header)`` equals ``ShardHeader.header_sha256`` of the local file)
            and the shard's size in bytes. A shard already in the cache is read from disk (works
            offline); otherwise at most two HTTP range requests, through huggingface_hub's session.
        """
        cached = try_to_load_from_cache(self.repo_id, filename, revision=self._rev)
        if isinstance(cached, str):
            size = os.path.getsize(cached)
            with open(cached, "rb") as f:
                hlen = _split_header(f.read(8), size, filename)
                return f.read(hlen), size
        with self._errors(filename):
            url = hf_hub_url(self.repo_id, filename, revision=self._rev)
            size = get_hf_file_metadata(url, token=self._token).size
            if size is None:
                raise InputError(
                    f"{self.repo_id}: the Hub did not report the size of {filename}; rerun to retry"
                )
            where = f"{self.repo_id}/{filename}"
            head = self._read_range(url, 0, min(size, _FIRST_READ) - 1) if size >= 8 else b""
            hlen = _split_header(head, size, where)
            if 8 + hlen > len(head):
                head += self._read_range(url, len(head), 8 + hlen - 1)
            if len(head) < 8 + hlen:
                raise InputError(f"{where}: the Hub sent a short header read; rerun to retry")
            return head[8 : 8 + hlen], size

    def _read_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end]`` of a Hub file; stops reading even if the server ignores Range."""
        headers = build_hf_headers(
            token=self._token, library_name="chordq", library_version=__version__
        )
        headers["Range"] = f"bytes={start}-{end}"
        with get_session().stream(
            "GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT
        ) as r:
            if r.status_code >= 400:
                r.read()
                hf_raise_for_status(r)
            skip = start if r.status_code == 200 else 0  # 200: the whole file came back
            want = end - start + 1
            buf = bytearray()
            for chunk in r.iter_bytes():
                if skip:
                    cut = min(skip, len(chunk))
                    chunk, skip = chunk[cut:], skip - cut
                buf += chunk
                if len(buf) >= want:
                    break
        return bytes(buf[:want])


# --------------------------------------------------------------------------------------------
# push side


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise OutputError(
            f"{path}: unreadable {what} (invalid JSON); rerun the command that writes it"
        ) from None
    if not isinstance(obj, dict):
        raise OutputError(
            f"{path}: unreadable {what} (not a JSON object); rerun the command that writes it"
        )
    return obj


def check_pushable(out: str | os.PathLike[str], skip_verify: bool = False) -> dict[str, Any]:
    """Refuse an output that is not a complete (and, unless ``skip_verify``, verified) chordq output.

    Checks: the directory exists; ``chordq_manifest.json`` is there with ``complete: true``;
    ``config.json`` and the index exist; every shard in the manifest has its recorded size;
    ``chordq_verify.json`` exists with ``"passed": true`` (skipped with ``skip_verify``).

    :returns: the manifest
    :raises OutputError: one line naming the file and what to do
    """
    out = Path(out)
    if not out.is_dir():
        raise OutputError(f"{out}: no such directory; convert first (chordq convert SRC -o {out})")
    manifest_path = out / MANIFEST_NAME
    if not manifest_path.is_file():
        raise OutputError(
            f"{out}: no {MANIFEST_NAME}, so not a chordq output; convert first (chordq convert SRC -o {out})"
        )
    manifest = _read_json(manifest_path, "manifest")
    if manifest.get("complete") is not True:
        raise OutputError(
            f"{out}: the conversion is incomplete; rerun the same chordq convert command to finish it"
        )
    for name in ("config.json", INDEX_NAME):
        if not (out / name).is_file():
            raise OutputError(
                f"{out / name}: missing; rerun the same chordq convert command to rewrite it"
            )
    for shard, rec in sorted(manifest.get("shards", {}).items()):
        path = out / shard
        size = path.stat().st_size if path.is_file() else None
        if size != rec.get("output_size"):
            found = "missing" if size is None else f"{size} bytes"
            raise OutputError(
                f"{path}: {found}, the manifest says {rec.get('output_size')} bytes; "
                "rerun the same chordq convert command to rewrite it"
            )
    if skip_verify:
        return manifest
    report_path = out / VERIFY_NAME
    if not report_path.is_file():
        raise OutputError(
            f"{out}: not verified (no {VERIFY_NAME}); run chordq verify {out}, or pass --skip-verify"
        )
    if _read_json(report_path, "verify report").get("passed") is not True:
        raise OutputError(
            f"{report_path}: verification failed; do not publish this output (or pass --skip-verify to push anyway)"
        )
    return manifest


def _upload_files(out: Path) -> list[dict[str, Any]]:
    """What ``upload_folder`` will send: the same filter (huggingface_hub's) over the same listing."""
    rel = {p.relative_to(out).as_posix(): p for p in sorted(out.glob("**/*")) if p.is_file()}
    keep = filter_repo_objects(rel, ignore_patterns=PUSH_IGNORE + DEFAULT_IGNORE_PATTERNS)
    return [{"path": name, "size": rel[name].stat().st_size} for name in keep]


@contextlib.contextmanager
def _push_errors(repo_id: str) -> Iterator[None]:
    """Map huggingface_hub's upload errors to one-line OutputErrors (the token never appears)."""
    resume = "rerun the same command to resume (uploaded files are not sent again)"
    try:
        yield
    except (RepositoryNotFoundError, GatedRepoError):
        raise OutputError(
            f"{repo_id}: the Hub refused access; log in with a token that can write to it (hf auth login or HF_TOKEN)"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status in (401, 403):
            raise OutputError(
                f"{repo_id}: the Hub refused the upload (HTTP {status}); use a token with write access "
                "(hf auth login or HF_TOKEN)"
            ) from None
        detail = (getattr(e, "server_message", None) or "").strip().splitlines()
        detail_text = f": {detail[0]}" if detail else ""
        raise OutputError(
            f"{repo_id}: upload failed (HTTP {status}{detail_text}); {resume}"
        ) from None
    except (httpx2.HTTPError, OfflineModeIsEnabled) as e:
        raise OutputError(
            f"{repo_id}: cannot reach the Hub ({type(e).__name__}); {resume}"
        ) from None
    except (ValueError, RuntimeError) as e:  # e.g. invalid README metadata, an LFS transfer error
        cause = e.__cause__ or e
        text = (
            " ".join(line.strip() for line in str(cause).splitlines() if line.strip())
            or type(cause).__name__
        )
        raise OutputError(f"{repo_id}: upload failed ({text[:300]}); {resume}") from None


def push_checkpoint(
    out: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    dry_run: bool = False,
    skip_verify: bool = False,
    token: str | bool | None = None,
    base_model: str | None = None,
) -> dict[str, Any]:
    """Publish a converted checkpoint to the Hub with a regenerated model card.

    Refuses incomplete or unverified outputs (:func:`check_pushable`), writes ``OUT/README.md``
    from the manifest, config and verify report (:func:`chordq.card.render_card`), creates the
    repo if needed (and the branch, for ``revision``), then uploads with
    ``HfApi.upload_folder``: with hf_xet (a huggingface_hub dependency) that is a streamed,
    multi-commit upload that resumes when rerun; without it, one commit over git-LFS whose
    already-uploaded objects are skipped on a rerun. ``dry_run`` does everything but the network.

    :param out: a chordq output directory
    :param repo_id: ``owner/name`` of the model repo (created if missing)
    :param private: create the repo private (an existing repo keeps its visibility)
    :param revision: branch to push to (created from main if missing), or ``refs/pr/N``
    :param create_pr: open a pull request against the default branch instead of pushing to it
    :param base_model: Hub id for the card's ``base_model`` when the manifest source is a local path
    :returns: ``{"repo_id", "revision", "create_pr", "private", "dry_run", "files": [{"path",
        "size"}], "bytes", "url", "commit_url", "pr_url"}`` (the last three ``None`` on a dry run)
    """
    out = Path(out)
    if not _valid_repo_id(repo_id):
        raise InputError(f"{repo_id}: not a Hub repo id; use owner/name")
    if base_model is not None and not _valid_repo_id(base_model):
        raise InputError(
            f"--base-model {base_model}: must be a Hub model id (owner/name); the Hub rejects paths"
        )
    if create_pr and revision is not None:
        raise InputError(
            "--create-pr opens a pull request against the default branch; drop --revision "
            "(to add to an open pull request, pass --revision refs/pr/N without --create-pr)"
        )
    check_pushable(out, skip_verify)
    atomic_write_text(out / "README.md", render_card(out, repo_id=repo_id, base_model=base_model))
    files = _upload_files(out)
    result: dict[str, Any] = {
        "repo_id": repo_id,
        "revision": revision or constants.DEFAULT_REVISION,
        "create_pr": create_pr,
        "private": private,
        "dry_run": dry_run,
        "files": files,
        "bytes": sum(f["size"] for f in files),
        "url": None,
        "commit_url": None,
        "pr_url": None,
    }
    if dry_run:
        return result
    api = HfApi(token=token, library_name="chordq", library_version=__version__)
    with _push_errors(repo_id):
        url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision is not None:
            try:
                api.repo_info(repo_id, revision=revision)
            except RevisionNotFoundError:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=out,
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message
            or f"Upload {out.name} (chordq {__version__}: W4A16 INT4 g32 experts)",
            ignore_patterns=list(PUSH_IGNORE),
        )
    result.update(url=str(url), commit_url=info.commit_url, pr_url=info.pr_url)
    return result


class HubCheckpoint:
    """A Hub model as a verify/convert source: headers from range reads, each shard downloaded
    into the standard cache the first time one of its tensors is read."""

    def __init__(self, repo_id: str, revision: str | None = None, token: str | None = None) -> None:
        from .shards import open_checkpoint, parse_header

        self.hub = HubSource(repo_id, revision=revision, token=token)
        root = self.hub.metadata()
        self.checkpoint = open_checkpoint(root, header_of=lambda f: parse_header(f, *self.hub.remote_header(f)))
        self._fetched: set[str] = set()

    def read_tensor(self, info: Any) -> Any:
        from .shards import read_tensor

        if info.shard not in self._fetched:
            self.hub.fetch(info.shard)
            self._fetched.add(info.shard)
        return read_tensor(self.checkpoint.root, info)
