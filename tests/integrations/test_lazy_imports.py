"""The frameworks are optional: importing contextfold imports none of them."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("langchain", "langchain_core", "langgraph", "pydantic_ai", "agents", "openai", "anthropic")


def test_importing_contextfold_imports_no_framework() -> None:
    """`import contextfold` (and its integrations package) leaves every framework unimported."""
    code = (
        "import sys, contextfold, contextfold.integrations; "
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
