"""The torch runtime: the only part of optpipe that imports torch.

- ``model``: a small GPT (nanoGPT's shape), its split into stages, synthetic data;
- ``split_backward``: B (input gradients) and W (weight gradients) for any stage module;
- ``store``: saved activations per (stage, microbatch), exact byte counts, offload and reload;
- ``comm``: non-blocking point-to-point messages over ``torch.distributed``;
- ``interpreter``: runs one rank's instruction stream of a verified plan;
- ``train``: the ``torchrun`` entry point; ``launch``: N local gloo processes for tests;
- ``profile``: measured costs and sizes as a problem file; ``trace``: measured vs predicted;
- ``demo``: profile, compile and train the tiny model, as ``make demo`` ends.

Nothing is imported here, so ``import optpipe.runtime`` stays cheap until a module is used.
"""

__all__: list[str] = []
