"""How long ``import contextfold`` takes in a fresh interpreter, against ``import httpx``.

Each measurement starts a new interpreter and times only the import statement
inside it, so interpreter start-up is left out and nothing is cached in
``sys.modules``. The figure that matters is the median ratio to httpx, one of
contextfold's own dependencies, which holds across machines; the absolute
medians are printed beside it. Also lists which heavy optional packages the
import pulled in (there should be none).

    python benchmarks/bench_import.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

HEAVY = (
    "click",
    "rich",
    "psycopg",
    "matplotlib",
    "langchain",
    "pydantic_ai",
    "agents",
    "openai",
    "anthropic",
    "opentelemetry",
)

_PROBE = """
import json, sys, time
started = time.perf_counter()
import {module}
elapsed = time.perf_counter() - started
print(json.dumps({{"seconds": elapsed, "modules": sorted(m for m in sys.modules if "." not in m)}}))
"""


def measure(module: str) -> tuple[float, list[str]]:
    """Seconds ``import module`` took in a new interpreter, and the top-level modules it loaded."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)], capture_output=True, text=True, check=True
    ).stdout
    data = json.loads(out)
    return float(data["seconds"]), list(data["modules"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh interpreters per module")
    args = parser.parse_args(argv)
    medians: dict[str, float] = {}
    loaded: list[str] = []
    # Alternate the two so that a noisy neighbour slows both alike.
    samples: dict[str, list[float]] = {"contextfold": [], "httpx": []}
    for _ in range(args.runs):
        for module in samples:
            seconds, modules = measure(module)
            samples[module].append(seconds)
            if module == "contextfold":
                loaded = modules
    for module, values in samples.items():
        medians[module] = statistics.median(values)
        print(f"import {module:<12} median {medians[module] * 1000:7.1f} ms over {args.runs} interpreters")
    print(f"ratio contextfold/httpx: {medians['contextfold'] / medians['httpx']:.2f}")
    heavy = [name for name in HEAVY if name in loaded]
    print(f"heavy optional packages imported: {', '.join(heavy) if heavy else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
