"""Where a rank computes and in what precision: ``--device auto|cpu|cuda`` and ``--dtype``.

One rule for every entry point (``python -m optpipe.runtime.train``, ``optpipe train``,
``optpipe profile``, your own job): ``auto`` means CUDA when this machine has it, else the CPU;
``cuda`` on a machine without it is an error rather than a silent CPU run; and rank ``r`` of a
node takes GPU ``r mod count``, as torchrun's ``LOCAL_RANK`` intends.
"""

from __future__ import annotations

import torch

from optpipe.core.errors import OptpipeError

__all__ = ["select_device", "wants_cuda", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def wants_cuda(choice: str) -> bool:
    """Whether ``choice`` runs on CUDA here; raises when it names no device or CUDA is missing."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise OptpipeError("--device cuda: this machine has no CUDA device; use --device cpu")
        return True
    if choice not in ("auto", "cpu"):
        raise OptpipeError(f"--device: expected auto, cpu or cuda, got {choice!r}")
    return False


def select_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """The device for the rank ``local_rank`` of this node; makes a GPU the current one."""
    if not wants_cuda(choice):
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
