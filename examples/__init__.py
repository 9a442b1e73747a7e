"""Examples of optpipe in a training job; ``examples.reverse`` is importable as a model factory."""
