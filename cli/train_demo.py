"""The end of ``make demo``: profile the tiny GPT, compile a plan for it, train it on 4 processes.

    python -m optpipe.cli.train_demo [--devices 4] [--microbatches 8] [--steps 5] [--budget SIZE] [--dir DIR]

The budget (default 800KiB, about three of the tiny model's stage activations, where 1F1B needs
four on the first rank) is one the plain schedules miss, so the compiled plan offloads.

Each step is the command a user would type: ``optpipe profile`` writes the problem,
``optpipe compile`` solves it and writes the plan, and ``torchrun --standalone`` starts one
gloo process per rank running ``optpipe.runtime.train`` on that plan.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]


def _run(command: list[str]) -> None:
    print("$ " + " ".join(command[2:] if command[:2] == [sys.executable, "-m"] else command), flush=True)
    done = subprocess.run(command)
    if done.returncode != 0:
        raise SystemExit(done.returncode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m optpipe.cli.train_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="pipeline ranks = local processes (default 4)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget", default="800KiB", help="activation budget per rank (default 800KiB)")
    parser.add_argument("--dir", default=None, help="where to keep the problem and plan (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="optpipe-demo-") as scratch:
        folder = Path(args.dir or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        problem, plan = folder / "tiny.toml", folder / "tiny.opb"
        optpipe = [sys.executable, "-m", "optpipe.cli"]
        _run(optpipe + ["profile", "--model", "tiny", "--devices", str(args.devices), "--microbatches",
                        str(args.microbatches), "--device", "cpu", "--repeats", "3", "--offload", "--budget", args.budget,
                        "-o", str(problem)])
        _run(optpipe + ["compile", str(problem), "--time-limit", "10", "--workers", "1", "-o", str(plan)])
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.devices),
              "-m", "optpipe.runtime.train", "--plan", str(plan), "--model", "tiny", "--steps", str(args.steps),
              "--device", "cpu"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
