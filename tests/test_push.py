"""push_checkpoint and the model card, against huggingface_hub's real upload code and a loopback Hub.

The loopback Hub records every request, so the tests assert on what huggingface_hub actually
sent: repo creation, README validation, preupload, the LFS batch call and object PUTs, commits.
It runs with HF_HUB_DISABLE_XET=1 (plain git-LFS; the loopback Hub has no Xet storage), except
the pipeline test, which keeps hf_xet on and has the Hub store every file as a regular blob.
"""

# ruff: noqa: F811  (pytest fixtures imported from _hub_server are redefined as arguments)

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import yaml
from _hub_server import FakeHub, fake_hub, hf_env, set_offline  # noqa: F401 (fixtures)
from huggingface_hub import constants
from huggingface_hub.utils._runtime import is_xet_available

from chordq import InputError, OutputError
from chordq.card import render_card
from chordq.hub import push_checkpoint

TOKEN = "hf_chordqPushToken0123456789abcdef"
REPORT = {
    "passed": True,
    "layers": [
        {
            "layer": 1,
            "experts_checked": 16,
            "sqnr_min_db": 17.48,
            "sqnr_mean_db": 17.81,
            "cos_diff": 1.2e-4,
            "status": "ok",
        },
        {
            "layer": 2,
            "experts_checked": 16,
            "sqnr_min_db": 17.52,
            "sqnr_mean_db": 17.80,
            "cos_diff": 1.3e-4,
            "status": "ok",
        },
    ],
}


@pytest.fixture
def out(converted, tmp_path) -> Path:
    """A private copy of the converted FP8 tiny model with a passing verify report."""
    dst = tmp_path / "tiny-w4a16"
    shutil.copytree(converted["fp8"], dst)
    (dst / "chordq_verify.json").write_text(json.dumps(REPORT))
    return dst


def front_matter(card: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", card, re.DOTALL)
    assert m, card[:200]
    return yaml.safe_load(m.group(1))


def local_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def expected_upload(out: Path) -> dict[str, bytes]:
    return {k: v for k, v in local_files(out).items() if k != "chordq_manifest.json"}


# --------------------------------------------------------------------------------------------
# model card


def test_file_names_agree_with_convert_and_verify():
    import chordq.card
    import chordq.convert
    import chordq.hub
    import chordq.verify

    assert chordq.hub.MANIFEST_NAME == chordq.convert.MANIFEST_NAME == chordq.card._MANIFEST
    assert chordq.hub.VERIFY_NAME == chordq.verify.VERIFY_JSON == chordq.card._VERIFY


def test_card_front_matter_and_body(out):
    card = render_card(out, repo_id="me/tiny-w4a16")
    meta = front_matter(card)
    assert (
        meta["license"] == "other" and meta["license_name"] == "modified-mit"
    )  # from the source README
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert set(meta["tags"]) >= {"compressed-tensors", "int4", "w4a16", "kimi", "chord"}
    assert "base_model" not in meta  # a local source is not a Hub id; the Hub would reject a path
    assert (
        "vllm serve me/tiny-w4a16 --moe-backend humming --tensor-parallel-size 8 --trust-remote-code"
        in card
    )
    assert "humming-kernels" in card and "group size 32" in card and "BF16 scales" in card
    assert "`re:.*shared_experts.*`: the shared experts" in card
    assert "chordq convert ./fp8 -o ./tiny-w4a16 --method mse" in card
    rows = [line for line in card.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert rows == [
        "| 1 | 16 | 17.48 | 17.81 | 1.20e-04 | ok |",
        "| 2 | 16 | 17.52 | 17.80 | 1.30e-04 | ok |",
    ]
    assert card.count("```") % 2 == 0


def test_card_base_model_from_hub_source_and_override(out, converted):
    manifest = json.loads((out / "chordq_manifest.json").read_text())
    manifest["source"] = "moonshotai/Kimi-K2-Instruct-0905"
    manifest["seconds"] = 754.0
    (out / "chordq_manifest.json").write_text(json.dumps(manifest))
    (out / "chordq_verify.json").unlink()
    card = render_card(out)
    meta = front_matter(card)
    assert (
        meta["base_model"] == "moonshotai/Kimi-K2-Instruct-0905"
        and meta["base_model_relation"] == "quantized"
    )
    assert meta["license_name"] == "modified-mit"  # carried by the README convert copied into out
    assert "**Not verified**" in card and "12.6 min" in card
    assert "chordq convert moonshotai/Kimi-K2-Instruct-0905 -o ./tiny-w4a16" in card
    manifest["source"] = "/data/hf/hub/models--moonshotai--Kimi-K2-Thinking/snapshots/" + "ab" * 20
    (out / "chordq_manifest.json").write_text(json.dumps(manifest))
    assert (
        front_matter(render_card(out))["base_model"] == "moonshotai/Kimi-K2-Thinking"
    )  # a cache path
    k25 = front_matter(render_card(converted["k25"], base_model="moonshotai/Kimi-K2.5"))
    assert (
        k25["base_model"] == "moonshotai/Kimi-K2.5" and k25["pipeline_tag"] == "image-text-to-text"
    )


# --------------------------------------------------------------------------------------------
# dry run and refusals (no network)


def test_dry_run_is_offline_and_lists_the_upload(out, hf_env, monkeypatch):
    set_offline(monkeypatch)  # any HTTP request would raise OfflineModeIsEnabled
    (out / "model-00001-of-00003.safetensors.chordq-tmp").write_bytes(b"partial")
    result = push_checkpoint(out, "me/tiny-w4a16", dry_run=True)
    card = (out / "README.md").read_text()
    assert front_matter(card)["library_name"] == "transformers"
    names = [f["path"] for f in result["files"]]
    assert "README.md" in names and "chordq_verify.json" in names and "config.json" in names
    assert "chordq_manifest.json" not in names and not any(n.endswith(".chordq-tmp") for n in names)
    sizes = {f["path"]: f["size"] for f in result["files"]}
    assert (
        sizes["model-00002-of-00003.safetensors"]
        == (out / "model-00002-of-00003.safetensors").stat().st_size
    )
    assert (
        result["bytes"] == sum(sizes.values())
        and result["dry_run"]
        and result["commit_url"] is None
    )


def _break(out: Path, how: str) -> None:
    manifest = out / "chordq_manifest.json"
    if how == "no manifest":
        manifest.unlink()
    elif how == "incomplete":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "complete": False}))
    elif how == "no config":
        (out / "config.json").unlink()
    elif how == "no index":
        (out / "model.safetensors.index.json").unlink()
    elif how == "truncated shard":
        with open(out / "model-00002-of-00003.safetensors", "r+b") as f:
            f.truncate(100)
    elif how == "no verify":
        (out / "chordq_verify.json").unlink()
    elif how == "failed verify":
        (out / "chordq_verify.json").write_text(json.dumps({**REPORT, "passed": False}))


@pytest.mark.parametrize(
    "how, needle",
    [
        ("no manifest", "not a chordq output"),
        ("incomplete", "conversion is incomplete"),
        ("no config", "config.json: missing"),
        ("no index", "model.safetensors.index.json: missing"),
        ("truncated shard", "model-00002-of-00003.safetensors: 100 bytes"),
        ("no verify", "--skip-verify"),
        ("failed verify", "verification failed"),
    ],
)
def test_incomplete_or_unverified_output_is_refused(out, hf_env, how, needle):
    _break(out, how)
    before = local_files(out)
    with pytest.raises(OutputError) as e:
        push_checkpoint(out, "me/tiny-w4a16", dry_run=True)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert local_files(out) == before  # refused before the card is written
    if how in ("no verify", "failed verify"):
        result = push_checkpoint(out, "me/tiny-w4a16", dry_run=True, skip_verify=True)
        card = (out / "README.md").read_text()
        assert result["files"] and ("**Not verified**" in card) == (how == "no verify")
        assert ("FAILED" in card) == (how == "failed verify")


def test_argument_errors(out, tmp_path, hf_env):
    with pytest.raises(OutputError, match="no such directory"):
        push_checkpoint(tmp_path / "nope", "me/x", dry_run=True)
    with pytest.raises(InputError, match="owner/name"):
        push_checkpoint(out, "not a repo", dry_run=True)
    with pytest.raises(InputError, match="--create-pr"):
        push_checkpoint(out, "me/x", revision="dev", create_pr=True, dry_run=True)


# --------------------------------------------------------------------------------------------
# real uploads to the loopback Hub


def test_push_uploads_everything_once_with_the_token_only_in_headers(
    out, fake_hub: FakeHub, monkeypatch, capsys, caplog
):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    result = push_checkpoint(out, "me/tiny-w4a16", private=True)
    assert fake_hub.repos["me/tiny-w4a16"].private
    remote = fake_hub.tree("me/tiny-w4a16")
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == expected_upload(out)
    assert front_matter(remote["README.md"].decode())["license"] == "other"
    shard_names = sorted(n for n in remote if n.endswith(".safetensors"))
    (commit,) = fake_hub.commits_made
    assert sorted(commit["lfs_files"]) == shard_names and "config.json" in commit["files"]
    assert len(fake_hub.lfs_puts) == len(set(fake_hub.lfs_puts)) == 3
    assert fake_hub.calls("POST", r"^/api/repos/create$") and fake_hub.calls(
        "POST", r"^/api/validate-yaml$"
    )
    assert fake_hub.calls("POST", r"/info/lfs/objects/batch$") and fake_hub.calls(
        "POST", r"/preupload/main$"
    )
    assert (
        result["commit_url"].endswith(fake_hub.repos["me/tiny-w4a16"].branches["main"])
        and result["pr_url"] is None
    )
    # The token travels in the Authorization header of Hub API calls and nowhere else.
    api_calls = [
        r
        for r in fake_hub.requests
        if r.path.startswith("/api/") and r.path != "/api/agent-harnesses"
    ]
    assert {r.headers.get("authorization") for r in api_calls} == {f"Bearer {TOKEN}"}
    assert {r.headers.get("authorization") for r in fake_hub.requests} == {f"Bearer {TOKEN}", None}
    assert not any(TOKEN in json.dumps(r.query) or TOKEN in r.path for r in fake_hub.requests)
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err + caplog.text + json.dumps(result)
    assert not any(TOKEN.encode() in data for data in local_files(out).values())
    assert not any(TOKEN.encode() in data for data in remote.values())


def test_interrupted_push_resumes_without_reuploading(out, fake_hub: FakeHub):
    fake_hub.fail_commits = 1  # the objects arrive, then the commit fails (like a crash before it)
    with pytest.raises(OutputError, match="rerun the same command to resume") as e:
        push_checkpoint(out, "me/tiny-w4a16")
    assert "\n" not in str(e.value) and fake_hub.tree("me/tiny-w4a16").keys() == {".gitattributes"}
    uploaded = list(fake_hub.lfs_puts)
    assert len(uploaded) == 3

    push_checkpoint(out, "me/tiny-w4a16")
    assert fake_hub.lfs_puts == uploaded  # nothing sent twice: the LFS batch said the objects exist
    assert {
        k: v for k, v in fake_hub.tree("me/tiny-w4a16").items() if k != ".gitattributes"
    } == expected_upload(out)
    assert len(fake_hub.commits_made) == 1

    push_checkpoint(out, "me/tiny-w4a16")  # nothing changed: no upload, no commit
    assert fake_hub.lfs_puts == uploaded and len(fake_hub.commits_made) == 1


def test_push_to_branch_and_pull_request(out, fake_hub: FakeHub):
    push_checkpoint(out, "me/tiny-w4a16", revision="w4a16-g32", commit_message="chordq w4a16")
    repo = fake_hub.repos["me/tiny-w4a16"]
    assert "w4a16-g32" in repo.branches and fake_hub.tree("me/tiny-w4a16").keys() == {
        ".gitattributes"
    }
    assert (
        fake_hub.tree("me/tiny-w4a16", "w4a16-g32")["config.json"]
        == (out / "config.json").read_bytes()
    )
    assert fake_hub.commits_made[-1]["summary"] == "chordq w4a16"

    result = push_checkpoint(out, "me/other", create_pr=True)
    assert result["pr_url"].endswith("/me/other/discussions/1")
    assert fake_hub.tree("me/other", "refs/pr/1")["README.md"] == (out / "README.md").read_bytes()
    assert fake_hub.tree("me/other").keys() == {".gitattributes"}  # main untouched


def test_pipelined_upload_with_xet_enabled(out, fake_hub: FakeHub, monkeypatch):
    """The code path users get (hf_xet installed): upload_folder's streamed multi-commit pipeline.

    The loopback Hub has no Xet storage, so it answers preupload with "regular" for every file;
    the pipeline's batching, commit and resume-by-skipping-unchanged-files logic is real.
    """
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    assert is_xet_available()  # so upload_folder takes its pipelined path, as for users
    fake_hub.regular_only = True
    push_checkpoint(out, "me/tiny-w4a16")
    assert {
        k: v for k, v in fake_hub.tree("me/tiny-w4a16").items() if k != ".gitattributes"
    } == expected_upload(out)
    assert (
        not fake_hub.calls("POST", r"/info/lfs/objects/batch$") and len(fake_hub.commits_made) == 1
    )

    (out / "chordq_verify.json").write_text(json.dumps({**REPORT, "layers": REPORT["layers"][:1]}))
    push_checkpoint(out, "me/tiny-w4a16")  # only the report and the card changed
    assert sorted(fake_hub.commits_made[-1]["files"]) == ["README.md", "chordq_verify.json"]


def test_base_model_must_be_a_hub_id(out, hf_env):
    """The Hub rejects a path as base_model (the loopback Hub's validate-yaml does too)."""
    with pytest.raises(InputError, match="--base-model"):
        push_checkpoint(out, "me/tiny-w4a16", base_model=str(out), dry_run=True)
    push_checkpoint(out, "me/tiny-w4a16", base_model="moonshotai/Kimi-K2-Instruct", dry_run=True)
    assert (
        front_matter((out / "README.md").read_text())["base_model"] == "moonshotai/Kimi-K2-Instruct"
    )
