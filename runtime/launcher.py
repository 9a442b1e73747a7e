"""``optpipe train``: the ranks of a job on this machine, summed up in one line.

torchrun works (and is what multi-node jobs use), but when a rank fails it follows the rank's
own one-line error with a ChildFailedError traceback of its own. This launcher starts one
``python -m optpipe.runtime.train`` process per rank of the plan with the environment torchrun
would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free local port),
passes their output through, and when one fails gives the others ``--timeout`` seconds (plus a
little) to stop on their own before it stops them; then it prints one line and returns the
first failure's exit code. No torch here: the ranks import it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

__all__ = ["launch_local", "free_port"]

_GRACE_S = 5.0  # beyond --timeout, for a rank to print its error and exit


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch_local(train_argv: list[str], nproc: int, timeout_s: float, *, port: int | None = None) -> int:
    """Run ``nproc`` ranks of ``optpipe.runtime.train train_argv`` here; 0 when every rank succeeds."""
    port = port or free_port()
    processes = []
    started = time.monotonic()
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: one thread per rank, not per core
        processes.append(subprocess.Popen([sys.executable, "-m", "optpipe.runtime.train", *train_argv], env=env))
    codes: dict[int, int] = {}
    first_failure: tuple[int, int, float] | None = None  # (rank, code, when)
    try:
        while len(codes) < nproc:
            for rank, process in enumerate(processes):
                if rank not in codes and process.poll() is not None:
                    codes[rank] = process.returncode
                    if process.returncode != 0 and first_failure is None:
                        first_failure = (rank, process.returncode, time.monotonic())
            if first_failure is not None and time.monotonic() - first_failure[2] > timeout_s + _GRACE_S:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        _reap(processes, 10.0)
        print("optpipe train: interrupted", file=sys.stderr, flush=True)
        return 130
    stopped = [rank for rank, process in enumerate(processes) if rank not in codes]
    for rank in stopped:
        processes[rank].kill()
    _reap(processes, 10.0)
    if first_failure is None:
        return 0
    rank, code, _ = first_failure
    others = [r for r in range(nproc) if r != rank and r not in stopped and codes.get(r, 0) != 0]
    parts = [f"optpipe train: rank {rank} {_describe(code)} after {first_failure[2] - started:.1f} s"]
    if code > 0:
        parts[0] += " (its error is above)"
    if others:
        parts.append(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped with it")
    if stopped:
        parts.append(f"rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} did not stop within "
                     f"--timeout and {'were' if len(stopped) > 1 else 'was'} killed")
    print("; ".join(parts), file=sys.stderr, flush=True)
    return code if code > 0 else 1


def _reap(processes, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
