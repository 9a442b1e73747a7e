"""The public API: one rank of a compiled plan over your own stage modules.

    import torch.distributed as dist
    from optpipe.runtime import PipelineRank

    dist.init_process_group("gloo")                     # or "nccl"; torchrun sets the rank
    pipe = PipelineRank("plan.opb", my_stage_modules, loss_fn, device="cpu")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for inputs, targets in loader:                      # the whole batch; the plan splits it
        optimizer.zero_grad()
        loss = pipe.step(inputs, targets)               # float on the last stage's rank, else None
        pipe.clip_grad_norm_(1.0)                       # the norm over every rank's parameters
        optimizer.step()

``step`` splits the batch along its first dimension into the plan's microbatches and runs
this rank's instruction stream once. Gradients accumulate into ``.grad`` exactly as one
backward of the mean loss over the batch would (each microbatch's loss is scaled by
1/microbatches), so any optimizer, LR scheduler and ``torch.autocast`` work unchanged.
``loss_fn(output, targets)`` must return the mean loss of one microbatch.

``switch_plan`` moves every rank to another plan of the same pipeline at a step boundary
(rank 0 proposes, all agree or all keep the old one); ``improve.OnlineImprover`` uses it.
"""

from __future__ import annotations

import hashlib
import math
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from optpipe.plan.bytecode import decode, encode, read_plan
from optpipe.core.errors import OptpipeError, PlanError
from optpipe.plan.program import Program

from .comm import P2P, collective
from .interpreter import Interpreter, StepResult, check_world
from .model import Batch

__all__ = ["PipelineRank", "clip_grad_norm_", "plan_digest", "stages_of"]

Tensors = torch.Tensor | Sequence[torch.Tensor] | None


def plan_digest(program: Program) -> bytes:
    """sha256 of the plan's bytes: the name ranks agree on when they switch plans."""
    return hashlib.sha256(encode(program)).digest()


class PipelineRank:
    """This process's rank of a pipeline plan.

    ``plan``: a plan file (``optpipe compile -o``) or a ``Program``. ``stages``: this rank's stage
    modules, in stage order (a list, one module when the rank runs one stage, or a dict
    ``{stage: module}``); split your model into ``plan.stages`` consecutive pieces and give each
    rank the pieces its plan runs (``pipe.stage_ids`` says which, also before construction via
    ``stages_of(plan, rank)``). The modules are moved to ``device`` (default: where they are). ``rank`` and the world size
    come from ``torch.distributed`` when it is initialised, else the plan must be for one rank.
    ``timeout`` (seconds) bounds every wait on a peer in a step: a rank that is gone becomes an
    error (collectives are bounded by the process group's own timeout, ``init_process_group(timeout=)``).
    """

    def __init__(self, plan: str | Path | Program, stages: nn.Module | Sequence[nn.Module] | Mapping[int, nn.Module],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 device: torch.device | str | None = None, timeout: float = 60.0):
        program = plan if isinstance(plan, Program) else read_plan(plan)
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise OptpipeError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.timeout = timedelta(seconds=timeout)
        check_world(program, self.rank, self.world_size)  # before the modules: the likelier mistake
        modules = _stage_dict(program, self.rank, stages)
        if device is None:  # where the modules are (the first parameter's device), else the CPU
            first = next((p for m in modules.values() for p in m.parameters()), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self.stages: dict[int, nn.Module] = {s: m.to(self.device) for s, m in modules.items()}
        self.loss_fn = loss_fn
        self.trace = False  # record every instruction's time in the next steps (see ``last``)
        self.last: StepResult | None = None  # the last step's result: loss, seconds, peak bytes, records
        self.refused_by: tuple[int, ...] = ()  # the ranks that could not load the last proposed plan
        self.refusal = ""  # and this rank's reason, when it was one of them
        self._interpreter = self._make(program)
        self.digest = plan_digest(program)

    def _make(self, program: Program) -> Interpreter:
        comm = P2P(program.header.stages, program.header.microbatches, self.timeout) if self.world_size > 1 else None
        return Interpreter(program, self.rank, self.stages, self.loss_fn, device=self.device, comm=comm)

    # ----------------------------------------------------------------- what it runs

    @property
    def program(self) -> Program:
        return self._interpreter.program

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.stages))

    @property
    def microbatches(self) -> int:
        return self.program.header.microbatches

    @property
    def holds_loss(self) -> bool:
        """Whether this rank runs the last stage, so ``step`` returns the loss here."""
        return self.program.header.stages - 1 in self.stages

    @property
    def activation_bytes(self) -> dict[int, tuple[int, int]]:
        """Per stage: bytes its forward saved, bytes still held after B (from the steps so far)."""
        return dict(self._interpreter.activation_bytes)

    def parameters(self) -> Iterable[nn.Parameter]:
        """This rank's parameters, for its optimizer (each once, even if two of its stages share one)."""
        seen: set[int] = set()
        for s in self.stage_ids:
            for p in self.stages[s].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    # ----------------------------------------------------------------- a step

    def step(self, inputs: Tensors = None, targets: Tensors = None) -> float | None:
        """One training step over a batch: forwards and backwards of every microbatch in the plan's order.

        ``inputs`` (needed on the rank of the first stage) and ``targets`` (on the rank of the
        last) are either the whole batch, split here along dimension 0 into the plan's
        microbatches, or a sequence with one tensor per microbatch. Every rank may pass both.
        Returns the mean loss on the last stage's rank, None on the others; gradients are added
        to ``.grad`` (zero them before the step, as usual).
        """
        header = self.program.header
        first, last = 0 in self.stages, header.stages - 1 in self.stages
        m = header.microbatches
        xs = _split(inputs, m, "inputs") if first else (None,) * m
        ys = _split(targets, m, "targets") if last else (None,) * m
        if first and xs is None:
            raise OptpipeError(f"rank {self.rank} runs the first stage, so its step needs the inputs")
        if last and ys is None:
            raise OptpipeError(f"rank {self.rank} runs the last stage, so its step needs the targets")
        self._interpreter.trace = self.trace
        self.last = self._interpreter.step(Batch(tuple(xs), tuple(ys)))
        return self.last.loss

    # ----------------------------------------------------------------- changing plans

    def switch_plan(self, candidate: Program | bytes | None) -> bool:
        """Collective, at a step boundary: every rank moves to rank 0's candidate, or none does.

        Rank 0 passes the candidate (a Program or plan bytes; None: no change) and broadcasts its
        hash and bytes; the other ranks' argument is ignored. Each rank checks the plan (hash,
        verification, same ranks, stages and microbatches as now) and the ranks exchange the
        verdicts: if any rank cannot load it, every rank keeps the plan it has. Returns whether
        the plan changed.
        """
        if self.world_size == 1:
            if candidate is None:
                return False
            self._adopt(self._load(candidate if isinstance(candidate, bytes) else encode(candidate),
                                   None))
            return True
        comm_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        data = b""
        if self.rank == 0 and candidate is not None:
            data = candidate if isinstance(candidate, bytes) else encode(candidate)
        size = torch.tensor([len(data)], dtype=torch.int64, device=comm_device)
        collective("the plan-switch broadcast", dist.broadcast, size, 0)
        if int(size.item()) == 0:
            return False
        payload = torch.zeros(32 + int(size.item()), dtype=torch.uint8, device=comm_device)
        if self.rank == 0:
            payload.copy_(torch.frombuffer(bytearray(hashlib.sha256(data).digest() + data), dtype=torch.uint8))
        collective("the plan-switch broadcast", dist.broadcast, payload, 0)
        raw = payload.cpu().numpy().tobytes()
        fresh, reason = None, ""
        try:
            fresh = self._load(raw[32:], raw[:32])
        except OptpipeError as error:
            reason = str(error)
        verdicts = [torch.zeros(1, dtype=torch.int64, device=comm_device) for _ in range(self.world_size)]
        mine = torch.tensor([1 if fresh is not None else 0], dtype=torch.int64, device=comm_device)
        collective("the plan-switch agreement", dist.all_gather, verdicts, mine)
        refused = [r for r, v in enumerate(verdicts) if int(v.item()) == 0]
        self.refused_by = tuple(refused)
        self.refusal = reason
        if refused:
            return False
        self._adopt(fresh)
        return True

    def _load(self, data: bytes, digest: bytes | None) -> Interpreter:
        """An interpreter of the candidate plan, which is one this rank can switch to; raises PlanError."""
        if digest is not None and hashlib.sha256(data).digest() != digest:
            raise PlanError("the plan's bytes do not match the hash rank 0 sent")
        program = decode(data)
        old, new = self.program.header, program.header
        if (new.world_size, new.stage_ranks, new.microbatches) != (old.world_size, old.stage_ranks, old.microbatches):
            raise PlanError(f"the new plan ({new.schedule_name}) has another pipeline: {new.world_size} ranks, "
                            f"stage ranks {list(new.stage_ranks)}, {new.microbatches} microbatches; this one has "
                            f"{old.world_size}, {list(old.stage_ranks)}, {old.microbatches}")
        return self._make(program)  # verifies it and checks it against this rank's stages

    def _adopt(self, fresh: Interpreter) -> None:
        previous = self._interpreter
        # Same stages on the same ranks: the tensors between them keep their shapes.
        fresh._in_shape, fresh._out_shape = previous._in_shape, previous._out_shape
        fresh.activation_bytes.update(previous.activation_bytes)
        self._interpreter = fresh
        self.digest = plan_digest(fresh.program)

    # ----------------------------------------------------------------- gradient clipping

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the parameters of every rank; returns the total norm."""
        return clip_grad_norm_(list(self.parameters()), max_norm, norm_type, device=self.device)


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Clip the gradients of a pipelined model by the norm over all ranks (a collective).

    Torch's own ``clip_grad_norm_`` on one rank sees only that rank's stages; this one adds the
    ranks' shares (sum of squares, or the maximum for ``inf``) first, so every rank scales by the
    same factor and the result equals clipping the whole model in one process.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    device = torch.device(device) if device is not None else (grads[0].device if grads else torch.device("cpu"))
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().float() for g in grads), default=torch.zeros((), device=device))
    else:
        local = sum((g.detach().float().norm(norm_type) ** norm_type for g in grads),
                    torch.zeros((), device=device))
    total = local.reshape(1).to(torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() != "nccl":
            total = total.cpu()
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        collective("the gradient-norm all-reduce", dist.all_reduce, total, op)
    total = total[0] if math.isinf(norm_type) else total[0] ** (1.0 / norm_type)
    coefficient = float(max_norm) / (float(total) + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.detach().mul_(coefficient)
    return total.to(device)


def stages_of(plan: str | Path | Program, rank: int) -> tuple[int, ...]:
    """The stages a plan runs on ``rank``: which pieces of the model that rank must be given."""
    program = plan if isinstance(plan, Program) else read_plan(plan)
    return program.header.stages_on(rank)



def _stage_dict(program: Program, rank: int, stages) -> dict[int, nn.Module]:
    header = program.header
    expected = header.stages_on(rank)
    where = (f"the plan ({header.schedule_name}) has {header.stages} stages over {header.world_size} ranks and runs "
             f"stages {list(expected)} on rank {rank}")
    if isinstance(stages, nn.Module):
        stages = [stages]
    if isinstance(stages, Mapping):
        given = dict(stages)
        if sorted(given) != list(expected):
            raise PlanError(f"{where}, but this rank was given modules for stages {sorted(given)}; split the model "
                            f"into {header.stages} stages and give rank {rank} stages {list(expected)}")
    else:
        given_list = list(stages)
        if len(given_list) != len(expected):
            raise PlanError(f"{where}, but this rank was given {len(given_list)} stage module"
                            f"{'s' if len(given_list) != 1 else ''}; split the model into {header.stages} stages "
                            f"and give rank {rank} the modules of stages {list(expected)}, in that order")
        given = dict(zip(expected, given_list))
    for s, module in given.items():
        if not isinstance(module, nn.Module):
            raise PlanError(f"stage {s}: expected a torch.nn.Module, got {type(module).__name__}")
    return given


def _split(data: Tensors, microbatches: int, what: str) -> tuple[torch.Tensor, ...] | None:
    if data is None:
        return None
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or data.shape[0] == 0 or data.shape[0] % microbatches:
            rows = data.shape[0] if data.dim() else 0
            raise OptpipeError(f"{what}: a batch of {rows} rows does not split into the plan's {microbatches} "
                               f"microbatches; use a batch size that is a multiple of {microbatches} "
                               f"(and DataLoader(..., drop_last=True))")
        return tuple(data.chunk(microbatches))
    parts = tuple(data)
    if len(parts) != microbatches:
        raise OptpipeError(f"{what}: {len(parts)} microbatches given, the plan runs {microbatches}")
    return parts
