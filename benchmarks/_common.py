"""What every benchmark shares: where problems and results live, and how results are saved."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from rich.console import Console

HERE = Path(__file__).resolve().parent
PROBLEMS = HERE / "problems"
RESULTS = HERE / "results"
console = Console(highlight=False)


def instances() -> list[Path]:
    return sorted(PROBLEMS.glob("*.toml"))


def save(name: str, rows: list[dict], **meta) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.node(),
               "python": platform.python_version(), **meta, "rows": rows}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    console.print(f"[dim]saved {path.relative_to(HERE.parent)}[/]")
    return path
