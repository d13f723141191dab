"""Loading a checkpoint's tokenizer (qspec_jax.tokenizer): without torch installed, as after
`make demo`, transformers printed "PyTorch was not found. Models won't be available ..." on every
run of every tool; it must not, while the user's own TRANSFORMERS_NO_ADVISORY_WARNINGS stays."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Runs in a child process: makes torch look absent to transformers (its availability check is
# importlib.util.find_spec), then runs the code given after it.
NO_TORCH = """
import importlib.util, sys
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] == "torch" else _find(name, *a, **k)
"""
WARNING = "PyTorch was not found"


def run_without_torch(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, timeout=300,
                          env={**full, **(env or {})})


def test_the_simulation_shows_the_warning() -> None:
    """The control: a plain `import transformers` without torch prints the warning (else the next
    test could pass without testing anything)."""
    proc = run_without_torch("import transformers")
    assert proc.returncode == 0 and WARNING in proc.stderr, proc.stderr


def test_loading_a_tokenizer_without_torch_is_quiet(tiny_chat_checkpoint: Path) -> None:
    code = (f"from qspec_jax.tokenizer import load_tokenizer\n"
            f"tok = load_tokenizer({str(tiny_chat_checkpoint / 'tokenizer')!r})\n"
            f"import os; print(tok.decode(tok.encode('hello')), os.environ.get('TRANSFORMERS_NO_ADVISORY_WARNINGS'))")
    proc = run_without_torch(code)
    assert proc.returncode == 0, proc.stderr
    assert WARNING not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["hello", "None"]  # the variable is not left set for the user's process


def test_a_users_own_setting_is_kept(tiny_chat_checkpoint: Path) -> None:
    proc = run_without_torch("from qspec_jax.tokenizer import import_transformers; import_transformers(); "
                             "import os; print(os.environ['TRANSFORMERS_NO_ADVISORY_WARNINGS'])",
                             env={"TRANSFORMERS_NO_ADVISORY_WARNINGS": "yes"})
    assert proc.returncode == 0 and proc.stdout.strip() == "yes", proc.stderr


@pytest.mark.slow  # a whole generation in a child process
def test_qspec_generate_without_torch_prints_no_warning(tiny_chat_checkpoint: Path) -> None:
    code = (f"from qspec_jax.cli.generate import main\n"
            f"sys.exit(main([{'--checkpoint'!r}, {str(tiny_chat_checkpoint)!r}, '--prompt', 'hi', "
            f"'--max-new-tokens', '4']))")
    proc = run_without_torch(code, env={"JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert WARNING not in proc.stderr and "transformers" not in proc.stderr, proc.stderr
