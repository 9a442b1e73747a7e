"""The torch runtime: the only part of optpipe that imports torch.

The public API (see README, "Use it in your training job"):

- ``PipelineRank``: one rank of a compiled plan over your own stage modules; ``step(inputs,
  targets)`` runs a training step, gradients land in ``.grad``; ``switch_plan`` changes plans;
- ``clip_grad_norm_``: gradient clipping by the norm over every rank's parameters;
- ``OnlineImprover``: measure op times, re-solve in the background, switch to a faster plan;
- ``Workload``, ``WorkloadRequest``: what a ``--model package.module:factory`` returns and gets;
- ``select_device``: the device for ``--device auto|cpu|cuda`` and a local rank, as ``optpipe train`` picks it.

The modules behind it:

- ``device``: ``select_device`` and the ``--dtype`` names, one rule for every entry point;
- ``model``: a small GPT (nanoGPT's shape), its split into stages, synthetic data, and the
  built-in factories ``tiny`` and ``small``;
- ``split_backward``: B (input gradients) and W (weight gradients) for any stage module;
- ``store``: saved activations per (stage, microbatch), exact byte counts, offload and reload;
- ``comm``: non-blocking point-to-point messages and guarded collectives over ``torch.distributed``;
- ``interpreter``: runs one rank's instruction stream of a verified plan; ``pipeline``: the API over it;
- ``train``: the ``torchrun`` entry point; ``launch``: N local gloo processes for tests;
  ``launcher``: ``optpipe train``, the ranks of a job on this machine, summed up in one line;
- ``profile``: measured costs and sizes as a problem file; ``trace``: measured vs predicted;
- ``improve``: online improvement; ``workload``: model factories; ``options``: the training options;

Nothing is imported until a name is used, so ``import optpipe.runtime`` stays cheap.
"""

from __future__ import annotations

import importlib

__all__ = ["PipelineRank", "clip_grad_norm_", "stages_of", "OnlineImprover", "Workload", "WorkloadRequest",
           "select_device"]

_WHERE = {"PipelineRank": "pipeline", "clip_grad_norm_": "pipeline", "stages_of": "pipeline",
          "OnlineImprover": "improve", "Workload": "workload", "WorkloadRequest": "workload",
          "select_device": "device"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
