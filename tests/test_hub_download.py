"""HubSource against a real huggingface_hub cache layout (offline) and a loopback Hub (online).

Nothing of chordq is mocked: huggingface_hub itself resolves revisions, downloads into the cache,
reads byte ranges and deletes cached files; the tests check what landed on disk and what the
loopback server was asked.
"""

# ruff: noqa: F811  (pytest fixtures imported from _hub_server are redefined as arguments)

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from _hub_server import FakeHub, fake_hub, git_blob_sha1, hf_env, is_lfs, set_offline  # noqa: F401 (fixtures)

from chordq import InputError, convert_checkpoint
from chordq.hub import HubSource, is_hub_id
from chordq.shards import open_checkpoint, read_header

REPO = "moonshotai/Kimi-K2-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def repo_files(src: Path) -> dict[str, bytes]:
    return {
        p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()
    }


def shards(files: dict[str, bytes]) -> list[str]:
    return sorted(f for f in files if f.endswith(".safetensors"))


def build_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    """Lay out ``files`` exactly as huggingface_hub's cache does; returns the snapshot dir.

    models--owner--name/blobs/<etag> (sha256 for LFS files, git sha1 otherwise),
    snapshots/<commit>/<file> -> relative symlink to the blob, refs/main = commit.
    """
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest() if is_lfs(name, len(data)) else git_blob_sha1(data)
        blob = repo_dir / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_is_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("moonshotai/Kimi-K2-Instruct-0905")
    assert not is_hub_id(str(tmp_path))
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not is_hub_id("org/model")  # an existing local path wins
    for s in ("Kimi-K2", "./a/b", "a/b/c", "/abs/path", "a/..", "a--b/c", ""):
        assert not is_hub_id(s), s


# --------------------------------------------------------------------------------------------
# offline, against a cache the test lays out by hand


def test_offline_cache_metadata_fetch_header_delete(tiny, hf_env, monkeypatch):
    files = repo_files(tiny["fp8"])
    first, second = shards(files)[:2]
    cached = {k: v for k, v in files.items() if k != second}  # one shard never downloaded
    snapshot = build_cache(hf_env, REPO, cached)
    set_offline(monkeypatch)

    src = HubSource(REPO)
    assert src.metadata() == snapshot and src.commit == COMMIT
    assert (snapshot / "config.json").is_file() and (
        snapshot / "model.safetensors.index.json"
    ).is_file()

    path = src.fetch(first)
    assert path == snapshot / first and path.read_bytes() == files[first]

    header, size = src.remote_header(first)  # cached shard: read from disk, no network needed
    local = read_header(tiny["fp8"], first)
    assert size == local.size and hashlib.sha256(header).hexdigest() == local.header_sha256

    with pytest.raises(InputError, match="HF_HUB_OFFLINE") as e:
        src.fetch(second)
    assert second in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError, match="HF_HUB_OFFLINE"):
        src.remote_header(second)

    blob = path.resolve()
    assert src.delete(first) == len(files[first])
    assert not path.exists() and not os.path.lexists(path) and not blob.exists()
    assert (snapshot / "config.json").is_file()  # the rest of the snapshot stays
    assert src.delete(first) == 0  # already gone


def test_offline_errors_are_one_line(hf_env, monkeypatch):
    set_offline(monkeypatch)
    with pytest.raises(InputError, match="HF_HUB_OFFLINE") as e:
        HubSource("nobody/nothing").metadata()
    assert str(e.value).startswith("nobody/nothing: ") and "\n" not in str(e.value)
    with pytest.raises(InputError, match="owner/name"):
        HubSource("not-a-repo-id")


def test_offline_snapshot_without_config_is_refused(hf_env, monkeypatch):
    build_cache(hf_env, REPO, {"README.md": b"# only a card\n"})
    set_offline(monkeypatch)
    with pytest.raises(InputError, match="no config.json"):
        HubSource(REPO).metadata()


# --------------------------------------------------------------------------------------------
# online, against the loopback Hub


def test_metadata_downloads_no_weights(tiny, fake_hub: FakeHub):
    files = repo_files(tiny["fp8"])
    commit = fake_hub.add_repo(REPO, files)
    snapshot = HubSource(REPO).metadata()
    assert (
        snapshot.name == commit
        and snapshot.parent.parent.name == "models--moonshotai--Kimi-K2-tiny"
    )
    got = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    assert got == {f for f in files if not f.endswith(".safetensors")}
    for f in got:
        assert (snapshot / f).read_bytes() == files[f]
    resolved = [r.path for r in fake_hub.calls("GET|HEAD", r"/resolve/")]
    assert resolved and not any(p.endswith(".safetensors") for p in resolved)
    assert fake_hub.calls("GET", rf"^/api/models/{REPO}/revision/main$")  # revision resolved once


def test_remote_header_reads_only_byte_ranges(tiny, fake_hub: FakeHub):
    files = repo_files(tiny["fp8"])
    fake_hub.add_repo(REPO, files)
    src = HubSource(REPO)
    src.metadata()
    for shard in shards(files):
        header, size = src.remote_header(shard)
        local = read_header(tiny["fp8"], shard)
        assert size == len(files[shard]) == local.size
        assert hashlib.sha256(header).hexdigest() == local.header_sha256
        gets = fake_hub.calls("GET", rf"/resolve/.*/{shard}$")
        assert gets and all(
            r.headers.get("range", "").startswith("bytes=") and r.status == 206 for r in gets
        )
    assert not list(Path(os.environ["HF_HUB_CACHE"]).rglob("*.safetensors"))  # nothing downloaded


def test_remote_header_longer_than_the_first_read(fake_hub: FakeHub):
    note = "x" * (1 << 20)  # a 1 MiB metadata string: the header outgrows the first 1 MiB read
    header = (
        b'{"__metadata__":{"note":"%s"},"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
        % note.encode()
    )
    blob = len(header).to_bytes(8, "little") + header + bytes(16)
    fake_hub.add_repo("a/b", {"config.json": b"{}", "model.safetensors": blob})
    got, size = HubSource("a/b").remote_header("model.safetensors")
    assert got == header and size == len(blob)
    ranges = [r.headers["range"] for r in fake_hub.calls("GET", r"/resolve/.*model\.safetensors$")]
    assert ranges == [f"bytes=0-{(1 << 20) - 1}", f"bytes={1 << 20}-{8 + len(header) - 1}"]


def test_fetch_is_pinned_to_the_metadata_commit(tiny, fake_hub: FakeHub):
    files = repo_files(tiny["fp8"])
    fake_hub.add_repo(REPO, files)
    src = HubSource(REPO)
    snapshot = src.metadata()
    # The branch moves mid-conversion: every shard must still come from the pinned commit.
    repo = fake_hub.repos[REPO]
    moved = dict(repo.commits[repo.branches["main"]])
    moved.pop(shards(files)[0])
    repo.commits["f" * 40] = moved
    repo.branches["main"] = "f" * 40
    for shard in shards(files):
        path = src.fetch(shard)
        assert path == snapshot / shard and path.read_bytes() == files[shard]
    assert {
        r.path.split("/resolve/")[1].split("/")[0] for r in fake_hub.calls("GET|HEAD", "/resolve/")
    } == {snapshot.name}
    freed = sum(src.delete(s) for s in shards(files))
    assert freed == sum(len(files[s]) for s in shards(files))
    assert not list(snapshot.glob("*.safetensors")) and (snapshot / "config.json").is_file()
    assert not [
        b for b in (snapshot.parent.parent / "blobs").iterdir() if b.stat().st_size > 100_000
    ]


def test_cached_snapshot_is_a_checkpoint(tiny, fake_hub: FakeHub, tmp_path):
    fake_hub.add_repo(REPO, repo_files(tiny["fp8"]))
    src = HubSource(REPO)
    snapshot = src.metadata()
    for shard in shards(repo_files(tiny["fp8"])):
        src.fetch(shard)
    assert open_checkpoint(snapshot).shards == shards(repo_files(tiny["fp8"]))
    assert convert_checkpoint(snapshot, tmp_path / "out").shards_converted == 3


@pytest.mark.parametrize(
    "repo_id, revision, filename, needle",
    [
        ("nobody/nothing", None, None, "no such model on the Hub"),
        ("gated/model", None, None, "gated model"),
        (REPO, "v9", None, "revision 'v9' not found"),
        (
            REPO,
            None,
            "model-00009-of-00009.safetensors",
            "model-00009-of-00009.safetensors not found",
        ),
    ],
)
def test_hub_errors_are_one_line(tiny, fake_hub: FakeHub, repo_id, revision, filename, needle):
    files = repo_files(tiny["fp8"])
    fake_hub.add_repo(REPO, files)
    fake_hub.add_repo("gated/model", {"config.json": b"{}"}, gated=True)
    src = HubSource(repo_id, revision=revision)
    with pytest.raises(InputError) as e:
        src.fetch(filename) if filename else src.metadata()
    msg = str(e.value)
    assert needle in msg and msg.startswith(f"{repo_id}: ") and "\n" not in msg


def test_token_reaches_the_hub_only_in_the_authorization_header(
    tiny, fake_hub: FakeHub, monkeypatch, capsys
):
    token = "hf_chordqDownloadToken0123456789"
    monkeypatch.setenv("HF_TOKEN", token)
    fake_hub.add_repo("gated/model", {"config.json": b"{}"}, gated=True)
    with pytest.raises(InputError, match="gated"):
        HubSource("gated/model").metadata()  # wrong token: still refused, token not echoed
    ok = "hf_gate_ok"
    snapshot = HubSource("gated/model", token=ok).metadata()
    assert (snapshot / "config.json").read_bytes() == b"{}"
    auth = {r.headers.get("authorization") for r in fake_hub.requests}
    assert auth == {f"Bearer {token}", f"Bearer {ok}"}
    out = capsys.readouterr()
    assert token not in out.out + out.err and token not in repr(HubSource("a/b", token=token))
    cache = Path(os.environ["HF_HUB_CACHE"])
    assert not any(token.encode() in p.read_bytes() for p in cache.rglob("*") if p.is_file())


# --------------------------------------------------------------------------------------------
# `chordq convert MODEL_ID` end to end against the loopback Hub


def test_convert_hub_id_streams_and_deletes(tiny, converted, fake_hub: FakeHub, hf_env, tmp_path):
    from chordq import ConvertOptions

    files = repo_files(tiny["fp8"])
    fake_hub.add_repo(REPO, files)
    out = tmp_path / "out"
    result = convert_checkpoint(REPO, out, ConvertOptions(delete_source=True))
    assert result.shards_converted == 3
    # same bytes as converting the local copy
    for shard in shards(files):
        assert (out / shard).read_bytes() == (converted["fp8"] / shard).read_bytes(), shard
    # every shard header was checked with range reads before any shard was downloaded
    paths = [(r.method, r.path, r.headers.get("range")) for r in fake_hub.requests]
    first_full = next(i for i, (m, p, rng) in enumerate(paths) if p.endswith(".safetensors") and m == "GET" and rng is None)
    ranged = {p.rsplit("/", 1)[-1] for m, p, rng in paths[:first_full] if rng}
    assert ranged == set(shards(files))
    # --delete-source left no shard in the cache
    assert not list(hf_env.rglob("*.safetensors"))
    import json

    assert json.loads((out / "chordq_manifest.json").read_text())["source"] == REPO


def test_delete_source_refuses_local_dirs(tiny, tmp_path):
    from chordq import ConvertOptions

    with pytest.raises(InputError, match="only applies to Hub"):
        convert_checkpoint(tiny["fp8"], tmp_path / "o", ConvertOptions(delete_source=True))


def test_verify_against_a_hub_source(tiny, converted, fake_hub: FakeHub, hf_env, tmp_path):
    """`chordq verify OUT --source MODEL_ID`: headers by range reads, shards fetched on first use."""
    import shutil

    from chordq.hub import HubCheckpoint
    from chordq.verify import verify_checkpoint

    fake_hub.add_repo(REPO, repo_files(tiny["fp8"]))
    out = Path(shutil.copytree(converted["fp8"], tmp_path / "out"))
    report = verify_checkpoint(out, source=HubCheckpoint(REPO), experts_per_layer=0)
    assert report.passed, report.failures
    fetched = {p.name for p in hf_env.rglob("*.safetensors")}
    assert fetched == set(shards(repo_files(tiny["fp8"])))
