"""Run a function on N local gloo processes, with a bounded time and every rank's outcome.

``run_local`` is for tests, benchmarks and the profiler: it spawns one process per rank, joins
them into a gloo process group through a file store (no port to pick), calls ``target(rank,
world_size, *args)`` in each, and returns the results in rank order. If a rank fails, the
others are expected to stop on their own with an error (their peer is gone); whoever is still
running ``grace`` seconds later, or when ``timeout`` runs out, is killed. Either way the caller
gets ``LocalRunFailed`` with each rank's outcome and how long the ranks took to stop.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from .errors import PipelineAborted

__all__ = ["run_local", "LocalRunFailed", "RankOutcome"]


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    ok: bool
    result: Any = None
    error: str = ""  # the rank's own message (first line of its exception), or why it was killed
    kind: str = ""  # the exception's class name; "killed" when the parent had to stop it
    seconds: float = 0.0  # from the start of the run to when the rank stopped


class LocalRunFailed(PipelineAborted):
    """At least one rank failed; ``outcomes`` holds every rank's."""

    def __init__(self, message: str, outcomes: list[RankOutcome]):
        super().__init__(message)
        self.outcomes = outcomes


def _worker(rank: int, world_size: int, init_file: str, pg_timeout: float, threads: int,
            target: Callable, args: tuple, results) -> None:
    # torch loads in the rank process only: importing launch stays cheap for the parent that spawns it.
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        value = target(rank, world_size, *args)
        results.put((rank, True, value, "", ""))
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the parent
        code = 1
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        detail = "".join(traceback.format_exception(error))
        results.put((rank, False, detail, message, type(error).__name__))
    finally:
        results.close()
        results.join_thread()
        # Leave without tearing the process group down politely: a peer may be gone, and the
        # sockets closing is exactly what tells the other ranks to stop.
        os._exit(code)


def run_local(world_size: int, target: Callable, args: tuple = (), *, timeout: float = 120.0,
              grace: float = 60.0, pg_timeout: float = 60.0, threads: int = 1) -> list[Any]:
    """``target(rank, world_size, *args)`` on ``world_size`` gloo processes; results in rank order.

    ``target`` must be importable (a module-level function) and its arguments picklable.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="optpipe-run-") as scratch:
        init_file = os.path.join(scratch, "store")
        processes = [context.Process(target=_worker, name=f"optpipe-rank{r}",
                                     args=(r, world_size, init_file, pg_timeout, threads, target, args, results))
                     for r in range(world_size)]
        start = time.monotonic()
        _start_on_loopback(processes)
        outcomes = _collect(results, processes, start, timeout, grace)
        for r, p in enumerate(processes):
            if r not in outcomes:
                p.kill()
                outcomes[r] = RankOutcome(r, False, None, "still running: killed by run_local", "killed",
                                          time.monotonic() - start)
        for p in processes:
            p.join(timeout=10)
        results.close()
    ordered = [outcomes[r] for r in range(world_size)]
    if all(o.ok for o in ordered):
        return [o.result for o in ordered]
    lines = [f"rank {o.rank}: " + ("ok" if o.ok else f"{o.kind}: {o.error.splitlines()[0]}") + f" ({o.seconds:.1f} s)"
             for o in ordered]
    raise LocalRunFailed("a local pipeline run failed:\n  " + "\n  ".join(lines), ordered)


def _start_on_loopback(processes: list) -> None:
    """Start the ranks with gloo on loopback (they inherit the environment), then restore it."""
    env_before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # local ranks talk over loopback
    try:
        for p in processes:
            p.start()
    finally:
        if env_before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = env_before


def _collect(results, processes: list, start: float, timeout: float, grace: float) -> dict[int, RankOutcome]:
    """Every rank's report, until all are in, ``timeout`` runs out, or ``grace`` has passed since one failed."""
    outcomes: dict[int, RankOutcome] = {}
    first_failure: float | None = None
    while len(outcomes) < len(processes):
        now = time.monotonic()
        deadline = start + timeout
        if first_failure is not None:
            deadline = min(deadline, first_failure + grace)
        if now >= deadline:
            break
        try:
            rank, ok, value, message, kind = results.get(timeout=min(0.2, deadline - now))
        except queue_module.Empty:
            for r, p in enumerate(processes):  # a rank that died without reporting (killed, crashed)
                if r not in outcomes and not p.is_alive() and p.exitcode not in (0, None):
                    outcomes[r] = RankOutcome(r, False, None, f"exited with code {p.exitcode} without a report",
                                              "died", time.monotonic() - start)
                    first_failure = first_failure or time.monotonic()
            continue
        elapsed = time.monotonic() - start
        if ok:
            outcomes[rank] = RankOutcome(rank, True, value, seconds=elapsed)
        else:
            outcomes[rank] = RankOutcome(rank, False, None, f"{message}\n{value}", kind, elapsed)
            first_failure = first_failure or time.monotonic()
    return outcomes
