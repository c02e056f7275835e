"""Every example in examples/ runs to completion."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


def test_there_are_examples() -> None:
    """The examples folder holds the three usage styles at least."""
    names = {path.stem for path in EXAMPLES}
    assert {"wrap_existing_loop", "driven_loop", "bare_maybe_compact"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path) -> None:
    """The example exits 0 and says what it did."""
    source = path.read_text()
    assert source.startswith('"""') and "Run it:" in source.split('"""')[1]
    done = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
