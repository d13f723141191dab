"""Loading a checkpoint's tokenizer with transformers, quietly and with errors that name the file.

transformers is imported only when a tokenizer is needed, and without its advisory line "PyTorch
was not found. Models won't be available ..." (it prints that on every import without torch,
which is the normal case here: only its tokenizers are used). Start-up cost on a 2-core CPU
without torch: ~2.0 s to import transformers and ~0.3 s to load SmolLM2's tokenizer, against
~0.1 s + 0.2 s for the `tokenizers` library alone; transformers is kept for its exact
encode/decode and chat-template semantics.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

# transformers reads this at each advisory warning; set only while transformers is imported.
_ADVISORY_ENV = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded; the message names the file."""


def import_transformers() -> ModuleType:
    """`import transformers` without its advisory warning about a missing PyTorch (the user's
    own setting of TRANSFORMERS_NO_ADVISORY_WARNINGS is left as it is)."""
    import sys

    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    had = os.environ.get(_ADVISORY_ENV)
    os.environ[_ADVISORY_ENV] = "1"
    try:
        import transformers
    finally:
        if had is None:
            os.environ.pop(_ADVISORY_ENV, None)
        else:
            os.environ[_ADVISORY_ENV] = had
    return transformers


def load_tokenizer(directory: str | Path) -> Any:
    """transformers' AutoTokenizer from `directory` (a checkpoint's tokenizer/).

    TokenizerError naming the file for a JSON file that is not valid JSON (a corrupt or truncated
    tokenizer.json), a missing tokenizer.json, or anything else transformers refuses.
    """
    directory = Path(directory)
    for f in sorted(directory.glob("*.json")):
        try:
            json.loads(f.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{f}: not a UTF-8 text file ({e.reason} at byte {e.start}); the tokenizer file "
                                 "is corrupt: re-run qspec-convert") from None
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{f}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); the "
                                 "tokenizer file is corrupt: re-run qspec-convert") from None
    if not (directory / "tokenizer.json").is_file():
        raise TokenizerError(f"{directory / 'tokenizer.json'}: no such file; the checkpoint's tokenizer is "
                             "incomplete: re-run qspec-convert")
    try:
        return import_transformers().AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the message names the directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TokenizerError(f"{directory}: transformers could not load this tokenizer ({type(e).__name__}: "
                             f"{first[:300]}); re-run qspec-convert") from None
