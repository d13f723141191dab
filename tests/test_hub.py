"""`qspec-convert ORG/NAME OUT`: Hugging Face Hub repository ids, resolved through huggingface_hub.

Offline only: each test builds the Hub cache's layout (models--ORG--NAME/refs, snapshots/<commit>)
in a temporary directory and points HF_HUB_CACHE at it with HF_HUB_OFFLINE=1; the conversion's
worker process (a fresh interpreter) reads that environment.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from convert import cli, convert
from convert.hub import is_complete, looks_like_repo_id, weight_files
from qspec_jax import model as M
from qspec_jax.checkpoint import MANIFEST, load

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, files_from: Path, ref: str = "main", extra: dict[str, bytes] | None = None) -> Path:
    """Lays out `files_from`'s files as the cached snapshot COMMIT of `repo` under `root`, as
    huggingface_hub writes it (blobs + symlinks), with refs/<ref> naming COMMIT."""
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    (base / "refs").mkdir()
    (base / "refs" / ref).write_text(COMMIT)
    files = {p.name: p.read_bytes() for p in files_from.iterdir() if p.is_file()} | (extra or {})
    for i, (name, data) in enumerate(sorted(files.items())):
        blob = base / "blobs" / f"blob{i:04d}"
        blob.write_bytes(data)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(Path("..", "..", "blobs", blob.name) if "/" not in name
                                 else Path("..", "..", "..", "blobs", blob.name))
    return snap


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    rc = cli.main([str(a) for a in args] + ["--no-progress", "--draft-weights", "none"])
    return rc, capsys.readouterr().err


def flat(ckpt: Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in M.params_to_flat(load(ckpt, dtype="float32", tokenizer=False).params).items()}


def test_repo_id_converts_from_the_hub_cache_offline(synthetic_hf_dir: Callable[..., Path], offline_hub: Path,
                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sharded model in the cache converts with no network; the result equals converting the
    same files from a directory, and the manifest names the repository and commit."""
    src = synthetic_hf_dir(seed=3, shards=2)
    hub_cache(offline_hub, "testorg/tiny-llama", src, extra={"pytorch_model.bin": b"not needed",
                                                             "original/consolidated.00.pth": b"not needed"})
    rc, err = run(capsys, "testorg/tiny-llama", tmp_path / "out")
    assert rc == 0, err
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["source"] == f"testorg/tiny-llama@{COMMIT}"
    ref = convert(src, tmp_path / "ref", progress=False)
    got, want = flat(tmp_path / "out"), flat(ref)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_revision_is_resolved_through_its_ref(synthetic_hf_dir: Callable[..., Path], offline_hub: Path,
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub_cache(offline_hub, "testorg/tagged", synthetic_hf_dir(seed=4), ref="v1.0")
    rc, err = run(capsys, "testorg/tagged@v1.0", tmp_path / "out")
    assert rc == 0, err
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["source"] == f"testorg/tagged@{COMMIT}"
    rc, err = run(capsys, "testorg/tagged@v2.0", tmp_path / "out2")  # a revision the cache does not hold
    assert rc == 2 and err.count("\n") == 1 and "HF_HUB_OFFLINE is set" in err, err
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("case", ["unknown", "shard missing", "no config"])
def test_what_the_cache_lacks_is_one_line_offline(case: str, synthetic_hf_dir: Callable[..., Path],
                                                  offline_hub: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    if case != "unknown":
        snap = hub_cache(offline_hub, "testorg/broken", synthetic_hf_dir(shards=2))
        (snap / ("model-00002-of-00002.safetensors" if case == "shard missing" else "config.json")).unlink()
    rc, err = run(capsys, "testorg/" + ("nothere" if case == "unknown" else "broken"), tmp_path / "out")
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("qspec-convert: error: testorg/"), err
    assert "no such local path" in err and "HF_HUB_OFFLINE is set" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_what_is_a_repo_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert looks_like_repo_id("meta-llama/Llama-3.1-8B") and looks_like_repo_id("org/name@refs/pr/1")
    for text in ("model.gguf", "/abs/path", "./org/name", "org/name/extra", "a/../b", "org/"):
        assert not looks_like_repo_id(text), text
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not looks_like_repo_id("org/name")  # an existing local path wins


def test_only_the_indexed_shards_are_weights(synthetic_hf_dir: Callable[..., Path]) -> None:
    """The download asks for the files the index names (not every *.safetensors), and a
    snapshot counts as complete only with all of them and config.json."""
    sharded = synthetic_hf_dir(shards=3)
    assert weight_files(sharded) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert is_complete(sharded)
    (sharded / "model-00003-of-00003.safetensors").unlink()
    assert not is_complete(sharded)
    single = synthetic_hf_dir()
    assert weight_files(single) is None and is_complete(single)
    shutil.move(single / "config.json", single / "config.bak")
    assert not is_complete(single)
