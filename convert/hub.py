"""Hugging Face Hub repository ids as conversion sources: `qspec-convert org/name OUT`.

A SRC that is not an existing path but has the form of a repository id (`org/name`, or
`org/name@revision` for a branch, tag or commit) is resolved through `huggingface_hub`:

1. the local cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub): a cached
   snapshot that holds config.json and every weight file is used as it is, with no network;
2. otherwise, unless HF_HUB_OFFLINE is set, the missing files are downloaded into that cache:
   config.json, the tokenizer files `convert.hf` copies, model.safetensors.index.json, then only
   the weight files the index names (or the top-level *.safetensors without one); never
   PyTorch .bin files, other formats or subdirectories.

Errors (unknown or private repository, unknown revision, gated model, no network, nothing
cached offline, no safetensors weights) become one-line `ConversionError`s. Import-light: the
pattern check needs no jax and no huggingface_hub.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from convert.errors import ConversionError

# owner/name[@revision]: Hub names are letters, digits, "-", "_", "." (not leading); a revision
# may contain "/" (branches like refs/pr/1).
REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?")
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TOP_LEVEL_ONLY = ["*/*"]  # ignore patterns: files in subdirectories are never needed


def looks_like_repo_id(src: str | Path) -> bool:
    """Whether `src` is to be resolved on the Hub: no such local path, and `owner/name[@rev]`."""
    text = str(src)
    return not Path(text).exists() and REPO_ID.fullmatch(text) is not None and ".." not in text


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _metadata_patterns() -> list[str]:
    from convert.hf import TOKENIZER_FILES

    return [CONFIG, INDEX, *TOKENIZER_FILES]


def weight_files(snapshot: Path) -> list[str] | None:
    """The weight files `snapshot` needs: those its index names, or None without an index
    (then the top-level *.safetensors)."""
    index = snapshot / INDEX
    if not index.is_file():
        return None
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConversionError(f"{index}: not a valid safetensors index ({e})") from None
    return names


def is_complete(snapshot: Path) -> bool:
    """config.json and every weight file are present (the tokenizer files are optional)."""
    if not (snapshot / CONFIG).is_file():
        return False
    names = weight_files(snapshot)
    if names is None:
        return any(snapshot.glob("*.safetensors"))
    return all((snapshot / n).is_file() for n in names)


def resolve(src: str, progress: bool = True) -> tuple[Path, str]:
    """(local snapshot directory, "owner/name@commit") of the repository id `src`: from the local
    cache when complete there, else downloaded (module docstring). ConversionError otherwise."""
    m = REPO_ID.fullmatch(src)
    if m is None:
        raise ConversionError(f"{src}: not a local path, nor a Hugging Face repository id (owner/name[@revision])")
    repo, rev = m.group("repo"), m.group("rev")
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise ConversionError(f"{src}: no such file or directory (and huggingface_hub, which resolves Hub "
                              "repository ids, is not installed)") from None
    if not progress:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()

    def fetch(patterns: list[str], local_only: bool) -> Path:
        return Path(huggingface_hub.snapshot_download(repo, revision=rev, allow_patterns=patterns,
                                                      ignore_patterns=TOP_LEVEL_ONLY, local_files_only=local_only))

    def label(snapshot: Path) -> str:
        return f"{repo}@{snapshot.name}"  # snapshots/<commit>

    not_cached = (hub_errors.LocalEntryNotFoundError, getattr(hub_errors, "IncompleteSnapshotError", OSError), OSError)
    try:  # 1. the local cache, no network
        snapshot = fetch([*_metadata_patterns(), "*.safetensors"], True)
        if is_complete(snapshot):
            return snapshot, label(snapshot)
    except not_cached:
        pass
    if _offline():
        raise ConversionError(f"{src}: no such local path, and HF_HUB_OFFLINE is set while the Hugging Face cache "
                              f"({huggingface_hub.constants.HF_HUB_CACHE}) does not hold this repository's config.json "
                              "and weights; download it with network access first (or unset HF_HUB_OFFLINE)")
    where = f"{repo}" + (f" (revision {rev})" if rev else "")
    try:  # 2. download: metadata first, then only the weight files it names
        snapshot = fetch(_metadata_patterns(), False)
        if not (snapshot / CONFIG).is_file():
            raise ConversionError(f"{where}: the repository has no config.json (expected a Hugging Face Llama/Mistral "
                                  "model; for a GGUF repository download the .gguf file and convert that file)")
        names = weight_files(snapshot)
        snapshot = fetch([*_metadata_patterns(), *(names if names is not None else ["*.safetensors"])], False)
    except hub_errors.GatedRepoError:
        raise ConversionError(f"{where}: the model is gated: accept its license on huggingface.co and log in "
                              "(`hf auth login` or HF_TOKEN)") from None
    except hub_errors.RepositoryNotFoundError:
        raise ConversionError(f"{where}: no such local path, nor a repository on the Hugging Face Hub (or it is "
                              "private: log in with `hf auth login` or set HF_TOKEN)") from None
    except hub_errors.RevisionNotFoundError:
        raise ConversionError(f"{repo}: no revision {rev!r} on the Hugging Face Hub") from None
    except hub_errors.LocalEntryNotFoundError:
        raise ConversionError(f"{where}: no such local path, the Hugging Face Hub cannot be reached and the model "
                              f"is not in its cache ({huggingface_hub.constants.HF_HUB_CACHE})") from None
    except hub_errors.HfHubHTTPError as e:
        raise ConversionError(f"{where}: download failed: {str(e).splitlines()[0]}") from None
    if not is_complete(snapshot):
        raise ConversionError(f"{where}: the repository has no *.safetensors weights (PyTorch .bin checkpoints are "
                              "not converted: load and re-save it with safetensors)")
    return snapshot, label(snapshot)
