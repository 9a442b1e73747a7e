"""`make bench`: run every benchmark in turn (or the ones named on the command line)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from ._common import console

# Cheapest first; each module has run() and saves its own JSON.
ORDER = ("simulator_speed", "heuristics", "torch_interop", "solver_quality", "budget_sweep", "consistency",
         "runtime_overhead", "shared_links", "recompute")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", choices=[[], *ORDER], help="benchmarks to run (default: all)")
    args = parser.parse_args(argv)
    failed = []
    for name in args.names or ORDER:
        module = importlib.import_module(f"benchmarks.{name}")  # each name in ORDER is a module here
        console.rule(f"[bold]{name}")
        start = time.perf_counter()
        try:
            module.run()
        except Exception as error:  # a benchmark that breaks must not hide the others' figures
            console.print(f"[red]{name} failed: {error!r}[/]")
            failed.append(name)
        console.print(f"[dim]{name}: {time.perf_counter() - start:.1f} s[/]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
