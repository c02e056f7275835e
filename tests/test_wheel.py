"""The package as shipped: a lean import, and a wheel that installs and runs in a fresh environment."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parent.parent


def _bench_import() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_import", ROOT / "benchmarks" / "bench_import.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench_import()
HEAVY: tuple[str, ...] = BENCH.HEAVY


def run(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, check=False, cwd="/"
    )


def test_import_contextfold_loads_no_heavy_optional_package() -> None:
    """import contextfold imports none of the CLI, database, plotting, framework or provider packages."""
    code = f"import sys, contextfold; print([m for m in {HEAVY!r} if m in sys.modules])"
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.replace("'", '"')) == []


def test_import_benchmark_reports_the_ratio_to_httpx(capsys: pytest.CaptureFixture[str]) -> None:
    """bench_import prints both medians, their ratio and the heavy packages the import loaded."""
    assert BENCH.main(["--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "import contextfold" in out and "import httpx" in out
    assert "ratio contextfold/httpx:" in out and "heavy optional packages imported:" in out


@dataclass(frozen=True)
class Installed:
    wheel: Path
    sdist: Path
    bin: Path
    bare_import: subprocess.CompletedProcess[str]
    bare_command: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Build the wheel and sdist, install the wheel alone into a new venv, try it, then add the cli extra."""
    dist = tmp_path_factory.mktemp("dist")
    built = run(sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", dist, ROOT)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = dist.glob("contextfold-*.whl")
    (sdist,) = dist.glob("contextfold-*.tar.gz")
    venv = tmp_path_factory.mktemp("venv")
    assert run(sys.executable, "-m", "venv", venv).returncode == 0
    bin = venv / "bin"
    pip = [bin / "python", "-m", "pip", "install", "--quiet"]
    plain = run(*pip, wheel)
    assert plain.returncode == 0, plain.stderr[-3000:]
    bare_import = run(bin / "python", "-c", "import contextfold, sys; print(sorted(sys.modules))")
    bare_command = run(bin / "contextfold", "--help")
    extra = run(*pip, f"{wheel}[cli]")
    assert extra.returncode == 0, extra.stderr[-3000:]
    return Installed(wheel, sdist, bin, bare_import, bare_command)


@pytest.mark.slow
def test_the_wheel_ships_the_package_and_the_sdist_the_sources(installed: Installed) -> None:
    """The wheel holds the package with py.typed and no tests; the sdist holds sources, tests and README."""
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert "contextfold/__init__.py" in names and "contextfold/py.typed" in names
    assert not any(name.startswith("tests/") for name in names)
    with tarfile.open(installed.sdist) as archive:
        members = {Path(*Path(m).parts[1:]).as_posix() for m in archive.getnames()}
    assert {"src/contextfold/__init__.py", "tests/test_cli.py", "README.md", "pyproject.toml"} <= members


@pytest.mark.slow
def test_the_wheel_alone_imports_and_names_the_cli_extra(installed: Installed) -> None:
    """Without the cli extra the wheel imports, and its command prints the install line and exits 1."""
    assert installed.bare_import.returncode == 0, installed.bare_import.stderr
    assert installed.bare_command.returncode == 1
    assert installed.bare_command.stderr.strip().endswith("pip install 'contextfold[cli]'")
    assert "Traceback" not in installed.bare_command.stderr


@pytest.mark.slow
def test_the_wheel_with_the_cli_extra_runs_help_and_a_short_demo(
    installed: Installed, tmp_path: Path
) -> None:
    """With contextfold[cli] from the wheel, --help lists the commands and demo --steps 20 runs."""
    helped = run(installed.bin / "contextfold", "--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("demo", "threads", "inspect", "compact"):
        assert command in helped.stdout
    demo = run(installed.bin / "contextfold", "demo", "--steps", "20", "--db", tmp_path / "d.db")
    assert demo.returncode == 0, demo.stderr
    assert "requests" in demo.stdout and (tmp_path / "d.db").is_file()
