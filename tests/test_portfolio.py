"""Two window searches trading incumbents: never worse than the start, always fitting, and no
worse off when the second search fails."""

from __future__ import annotations

import os
import queue
import time
from dataclasses import replace

from optpipe.core.problem import Offload, Recompute
from optpipe.core.simulate import simulate
from optpipe.solvers import lns, portfolio
from optpipe.solvers.compare import compare
from optpipe.solvers.exchange import Peer
from optpipe.solvers.heuristics.gpipe import gpipe
from optpipe.solvers.neighbourhoods import deep_applies

from conftest import uniform_problem

# p = 4, m = 8, a budget of three activations and a 1 ms link: offload decisions are open
OFFLOAD = uniform_problem(4, 8, act=100, keep=50, budget=300, offload=Offload(True, 1e5, 1e5, 10**9),
                          name="portfolio-offload")


def _slowest_fitting(problem):
    return max((e.judged for e in compare(problem) if e.fits), key=lambda j: j.makespan_ms)


def _messages(box: queue.Queue) -> list[tuple]:
    out = []
    while not box.empty():
        out.append(box.get_nowait())
    return out


def test_a_peer_offers_only_what_beats_its_last_offer_and_not_what_it_took():
    schedule = gpipe(OFFLOAD)
    inbox, outbox = queue.Queue(), queue.Queue()
    peer = Peer(inbox, outbox)
    peer.offer((10.0, 40.0), schedule)
    peer.offer((11.0, 30.0), schedule)  # worse: not sent
    peer.offer((9.0, 40.0), schedule)  # better, but within the rate limit: held back ...
    assert [m[1] for m in _messages(outbox)] == [(10.0, 40.0)]
    peer.flush()  # ... until the search ends
    assert [m[1] for m in _messages(outbox)] == [(9.0, 40.0)]
    peer.adopted((5.0, 20.0))
    peer.offer((6.0, 20.0), schedule)  # the other search has better already
    peer.flush()
    assert _messages(outbox) == []


def test_a_peer_takes_the_best_incumbent_and_notes_a_stop():
    schedule = gpipe(OFFLOAD)
    inbox, outbox = queue.Queue(), queue.Queue()
    for message in (("incumbent", (8.0, 1.0), schedule), ("incumbent", (7.0, 1.0), schedule), ("stop",)):
        inbox.put(message)
    peer = Peer(inbox, outbox)
    assert peer.received()[0] == (7.0, 1.0)
    assert peer.stopped
    assert peer.received() is None


def test_two_searches_fit_are_never_worse_and_both_answer(monkeypatch):
    answers = []
    real = portfolio._answer

    def spy(*args):
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setattr(portfolio, "_answer", spy)
    start = _slowest_fitting(OFFLOAD)
    search = portfolio.improve_in_parallel(OFFLOAD, start.schedule, time_limit_s=3.0, seed=1, workers=2)
    again = simulate(OFFLOAD, search.best.schedule)
    assert again.fits
    assert again.makespan == search.best.makespan_ms <= start.timeline.makespan + 1e-9
    assert answers and answers[0] is not None and answers[0][0] == "done"  # the second search answered


def test_a_second_search_that_fails_leaves_the_first_ones_answer_without_waiting(monkeypatch):
    parent = os.getpid()
    real = lns.improve

    def failing_in_the_child(*args, **options):
        if os.getpid() != parent:
            raise RuntimeError("the second search broke")
        return real(*args, **options)

    monkeypatch.setattr(lns, "improve", failing_in_the_child)
    start = _slowest_fitting(OFFLOAD)
    began = time.monotonic()
    search = portfolio.improve_in_parallel(OFFLOAD, start.schedule, time_limit_s=2.0, seed=1, workers=2)
    assert time.monotonic() - began < 2.0 + portfolio._GRACE_S - 1.0  # the failure is reported, not waited out
    assert search.best.fits
    assert search.best.makespan_ms <= start.timeline.makespan + 1e-9


def test_two_searches_only_with_two_cores_time_and_no_recompute():
    assert portfolio.parallel_applies(OFFLOAD, 60.0, 2)
    assert not portfolio.parallel_applies(OFFLOAD, 60.0, 1)
    assert not portfolio.parallel_applies(OFFLOAD, 1.0, 2)
    # a second process's answer costs simulations to send and judge: not where few fit in the time
    assert portfolio.parallel_applies(OFFLOAD, 12.0, 2, simulation_s=0.01)
    assert not portfolio.parallel_applies(OFFLOAD, 12.0, 2, simulation_s=0.4)
    recompute = replace(OFFLOAD, recompute=Recompute(True, (1.0,) * 4, (10,) * 4))
    assert not portfolio.parallel_applies(recompute, 60.0, 2)


def test_a_second_search_that_dies_is_not_waited_for(monkeypatch):
    parent = os.getpid()
    real = lns.improve

    def dying_in_the_child(*args, **options):
        if os.getpid() != parent:
            os._exit(3)  # as a crash or the OOM killer would: no message at all
        return real(*args, **options)

    monkeypatch.setattr(lns, "improve", dying_in_the_child)
    start = _slowest_fitting(OFFLOAD)
    began = time.monotonic()
    search = portfolio.improve_in_parallel(OFFLOAD, start.schedule, time_limit_s=2.0, seed=1, workers=2)
    assert time.monotonic() - began < 2.0 + portfolio._GRACE_S - 1.0
    assert search.best.fits


def test_the_deep_warm_up_search_leaves_the_restarts_to_the_first(monkeypatch, tmp_path):
    parent = os.getpid()
    real = lns.improve

    def noting_restarts(problem, schedule, **options):
        who = "first" if os.getpid() == parent else "second"
        (tmp_path / f"{problem.name}-{who}").write_text(str(len(options.get("restarts", ()))))
        return real(problem, schedule, **options)

    monkeypatch.setattr(lns, "improve", noting_restarts)
    deep = uniform_problem(4, 8, v=2, act=100, keep=50, budget=800, name="deep")  # deep_applies: v = 2, p < 12
    flat = uniform_problem(4, 8, act=100, keep=50, budget=800, name="flat")  # v = 1: it does not
    for problem in (deep, flat):
        start = gpipe(problem)
        others = [e.judged.schedule for e in compare(problem) if e.fits][:2]
        portfolio.improve_in_parallel(problem, start, time_limit_s=1.0, seed=1, workers=2, restarts=others)
    assert deep_applies(deep) and not deep_applies(flat)
    assert (tmp_path / "deep-first").read_text() == (tmp_path / "flat-first").read_text() == "2"
    assert (tmp_path / "deep-second").read_text() == "0"
    assert (tmp_path / "flat-second").read_text() == "2"
