"""Your own model on the command line: ``--model package.module:factory``.

A factory is a function that takes a ``WorkloadRequest`` and returns a ``Workload``: the whole
model split into ``request.stages`` stage modules (in pipeline order), the loss of one
microbatch, and a source of batches::

    def build(request: WorkloadRequest) -> Workload:
        stages = [Embed(...), Blocks(...), Head(...)][: request.stages]   # exactly request.stages pieces
        loader = DataLoader(dataset, batch_size=request.microbatches * 8, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(request.seed))
        return Workload(stages, torch.nn.functional.cross_entropy, loader)

Every rank calls the factory and keeps the stages its plan runs, so the factory must build the
same weights and the same batches on every rank (seed them from ``request.seed``). A batch is
``(inputs, targets)`` for the whole step; the runtime splits it into the plan's microbatches,
so its first dimension must be a multiple of ``request.microbatches``. ``optpipe profile`` and
``python -m optpipe.runtime.train`` take the same factories; ``tiny`` and ``small`` name the
built-in GPT factories (``optpipe.runtime.model:tiny`` and ``:small``).

Nothing here imports torch until a factory is called, except for type names.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from optpipe.core.errors import OptpipeError

from .errors import first_line

__all__ = ["WorkloadRequest", "Workload", "BUILT_IN", "resolve_factory", "load_workload", "batch_stream"]

BUILT_IN = {"tiny": "optpipe.runtime.model:tiny", "small": "optpipe.runtime.model:small"}


@dataclass(frozen=True)
class WorkloadRequest:
    """What a factory is asked to build."""

    stages: int  # split the model into exactly this many stage modules
    microbatches: int  # a batch must split into this many equal microbatches
    seed: int = 0  # the same on every rank: weights and data must not depend on the rank
    micro_batch_size: int | None = None  # rows per microbatch when the user asked for one; else yours


@dataclass
class Workload:
    """What a factory returns."""

    stages: Sequence[Any]  # torch.nn.Module per stage, in pipeline order
    loss_fn: Callable  # loss_fn(last stage output, targets) -> mean loss of one microbatch
    batches: Iterable  # yields (inputs, targets) for whole steps; iterated again when it ends (a new epoch)
    name: str = ""  # for messages and the problem's name
    parameter_names: dict | None = None  # optional: id(parameter) -> its name in the whole model


def resolve_factory(spec: str) -> Callable[[WorkloadRequest], Workload]:
    """``tiny``, ``small`` or ``package.module:function`` -> the function (the current folder is importable)."""
    target = BUILT_IN.get(spec, spec)
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise OptpipeError(f"--model: expected tiny, small or package.module:factory (for example "
                           f"examples.reverse:workload), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own package next to them
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise OptpipeError(f"--model {spec}: cannot import {module_name} ({error}); run from the folder that "
                           f"holds the package or put it on PYTHONPATH") from None
    except Exception as error:  # the user's module failed while importing
        raise OptpipeError(f"--model {spec}: importing {module_name} failed: {type(error).__name__}: "
                           f"{first_line(error)}") from None
    factory = getattr(module, attribute, None)
    if factory is None:
        raise OptpipeError(f"--model {spec}: {module_name} has no {attribute!r}")
    if not callable(factory):
        raise OptpipeError(f"--model {spec}: {module_name}.{attribute} is not a function")
    return factory


def load_workload(spec: str, request: WorkloadRequest) -> Workload:
    """Call the factory named ``spec`` and check what it returns against the request."""
    import torch.nn as nn  # only here: importing workload (as the CLI does) must not load torch

    factory = resolve_factory(spec)
    try:
        workload = factory(request)
    except Exception as error:
        if isinstance(error, OptpipeError):
            raise
        text = first_line(error)
        where = _where(factory)
        raise OptpipeError(f"--model {spec}: the factory failed{where}: {type(error).__name__}: {text}") from error
    if not isinstance(workload, Workload):
        raise OptpipeError(f"--model {spec}: the factory returned a {type(workload).__name__}; it must return "
                           f"optpipe.runtime.workload.Workload(stages, loss_fn, batches)")
    stages = list(workload.stages)
    if len(stages) != request.stages:
        raise OptpipeError(f"--model {spec}: the plan has {request.stages} stages but the factory split the model "
                           f"into {len(stages)}; return exactly request.stages stage modules")
    for s, module in enumerate(stages):
        if not isinstance(module, nn.Module):
            raise OptpipeError(f"--model {spec}: stage {s} is a {type(module).__name__}, not a torch.nn.Module")
    workload.stages = stages
    workload.name = workload.name or spec
    return workload


def batch_stream(batches: Iterable) -> Iterator:
    """The batches again and again: a DataLoader's next epoch starts when one ends."""
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            raise OptpipeError("the workload's batch source yielded no batch; with a DataLoader, check that the "
                               "dataset holds at least one full batch (drop_last=True drops a partial one)")
        if iter(batches) is batches:  # a one-shot iterator: it cannot start again
            raise OptpipeError("the workload's batch source ran out (it is an iterator); return an iterable such "
                               "as a DataLoader, which starts again each epoch, or an endless generator")


def _where(factory) -> str:
    try:
        return f" ({inspect.getsourcefile(factory)})"
    except TypeError:
        return ""
