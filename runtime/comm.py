"""Point-to-point messages between pipeline ranks over ``torch.distributed``.

Every message is an activation (stage s-1 to s) or a gradient (stage s+1 to s) of one
microbatch; it is tagged by (kind, receiving stage, microbatch) so gloo pairs it by name, and
the plan posts receives in the order the peer sends so NCCL, which pairs by order, agrees.
Sends and receives are non-blocking; runs of them that the plan places side by side go out
as one batch (``batch_isend_irecv``), which NCCL needs when two ranks exchange at once.

A failed wait (the peer died, raised, or timed out) becomes ``PipelineAborted`` naming the
message and the peer, so no rank hangs on a partner that is gone; ``collective`` does the same
for every all-reduce, broadcast and gather the runtime makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import PipelineAborted, first_line

__all__ = ["Message", "P2P", "ACTIVATION", "GRADIENT", "send_meta", "recv_meta", "collective", "first_line"]

ACTIVATION, GRADIENT = 0, 1
_KIND_TEXT = {ACTIVATION: "activation", GRADIENT: "gradient"}

# dtype <-> small integer, for the shape handshake.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)
_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class Message:
    """One tensor to or from ``peer``: ``kind`` of ``stage`` (the receiving stage) for ``microbatch``."""

    send: bool
    kind: int
    stage: int
    microbatch: int
    peer: int
    tensor: torch.Tensor

    def describe(self) -> str:
        what = f"{_KIND_TEXT[self.kind]} of stage {self.stage} microbatch {self.microbatch}"
        return f"sending the {what} to rank {self.peer}" if self.send else f"receiving the {what} from rank {self.peer}"


class P2P:
    """Non-blocking point-to-point for one rank of the default process group."""

    def __init__(self, stages: int, microbatches: int, timeout: timedelta | None = None):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.stages = stages
        self.microbatches = microbatches
        self.timeout = timeout
        self.backend = dist.get_backend()
        self._coalesce = self.backend == "nccl"  # gloo runs a batch op by op anyway

    def tag(self, kind: int, stage: int, microbatch: int) -> int:
        return (kind * self.stages + stage) * self.microbatches + microbatch

    def start(self, messages: list[Message]) -> list[dist.Work]:
        """Post sends and receives; returns one handle per message, in order."""
        try:
            if self._coalesce and len(messages) > 1:
                ops = [dist.P2POp(dist.isend if m.send else dist.irecv, m.tensor, m.peer,
                                  tag=self.tag(m.kind, m.stage, m.microbatch)) for m in messages]
                works = dist.batch_isend_irecv(ops)
                if len(works) != len(messages):  # one handle for the whole coalesced group
                    works = [works[-1]] * len(messages)
                return works
            works = []
            for m in messages:
                tag = self.tag(m.kind, m.stage, m.microbatch)
                if m.send:
                    works.append(dist.isend(m.tensor, m.peer, tag=tag))
                else:
                    works.append(dist.irecv(m.tensor, m.peer, tag=tag))
            return works
        except RuntimeError as error:
            raise self._aborted(messages[0], error) from error

    def wait(self, work: dist.Work, message: Message) -> None:
        try:
            if self.timeout is not None:
                work.wait(self.timeout)
            else:
                work.wait()
        except RuntimeError as error:
            raise self._aborted(message, error) from error

    def _aborted(self, message: Message, error: Exception) -> PipelineAborted:
        first = first_line(error)
        return PipelineAborted(
            f"rank {self.rank}: {message.describe()} failed ({first}); rank {message.peer} has probably stopped "
            f"(look for its own error above), so this rank stops too"
        )


def send_meta(tensor: torch.Tensor, peer: int, tag: int) -> None:
    """Tell ``peer`` the shape and dtype of a tensor it will receive (blocking, once per edge)."""
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise PipelineAborted(f"cannot send a stage output of shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                              f"supported: up to {_MAX_DIMS} dimensions, dtypes {', '.join(map(str, _DTYPES))}")
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    meta[0] = _DTYPES.index(tensor.dtype)
    meta[1] = tensor.dim()
    meta[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    _blocking(dist.send, meta.to(_comm_device(tensor.device)), peer, tag)


def recv_meta(peer: int, tag: int, device: torch.device) -> tuple[torch.Size, torch.dtype]:
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=_comm_device(device))
    _blocking(dist.recv, meta, peer, tag)
    meta = meta.cpu()
    dims = int(meta[1])
    return torch.Size(int(d) for d in meta[2:2 + dims]), _DTYPES[int(meta[0])]


def _comm_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _blocking(call, tensor: torch.Tensor, peer: int, tag: int) -> None:
    try:
        call(tensor, peer, tag=tag)
    except RuntimeError as error:
        raise PipelineAborted(f"rank {dist.get_rank()}: the shape handshake with rank {peer} failed "
                              f"({first_line(error)}); "
                              f"rank {peer} has probably stopped (look for its own error)") from error


def collective(what: str, call, *args, **kwargs):
    """Run a collective (``dist.all_reduce`` and the like); a lost peer or a timeout becomes one line.

    ``what`` names it for the message: "the loss all-reduce failed (...)".
    """
    try:
        return call(*args, **kwargs)
    except (RuntimeError, ValueError) as error:  # DistBackendError and DistNetworkError are RuntimeErrors
        raise PipelineAborted(f"rank {dist.get_rank()}: {what} failed ({first_line(error)}); another rank has "
                              f"probably stopped (look for its own error), so this rank stops too") from error
