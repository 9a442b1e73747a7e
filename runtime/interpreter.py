"""The interpreter: runs one rank's instruction stream over that rank's stage modules.

Before anything else it verifies the whole plan (structure, pairing, deadlock freedom) and
checks it against the process group: the world size, this rank's stages. Only then does it
talk to other ranks, first once to learn the shape and dtype of every tensor that crosses a
rank boundary (one forward without gradients, in stage order), then every step straight
through the stream.

Per (stage, microbatch) it keeps the forward's input and output, the gradient that arrived,
the gradient to hand on, and what B kept for W; the activation store holds what autograd
saved and counts its bytes. Gradients accumulate in ``param.grad`` over the microbatches; the
loss of each microbatch is scaled by 1/microbatches, so one step equals one ordinary backward
of the mean loss over the whole batch. The caller zeroes gradients and steps the optimizer.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from optpipe.core.errors import OptpipeError, PlanError
from optpipe.plan.program import POSTS_MESSAGE, Instruction, Opcode, Program
from optpipe.plan.verify import verify

from .comm import ACTIVATION, GRADIENT, P2P, Message, first_line, recv_meta, send_meta
from .errors import PipelineAborted
from .model import Batch
from .split_backward import StageGrad, touch_saved_tensors
from .store import ActivationStore, module_tensors

__all__ = ["Interpreter", "StepResult", "InstructionRecord", "check_plan", "check_world"]

O = Opcode


@dataclass(frozen=True, slots=True)
class InstructionRecord:
    """When one instruction ran on this rank (host clock, nanoseconds since the step began)."""

    opcode: Opcode
    stage: int
    microbatch: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class StepResult:
    loss: float | None  # mean loss over the microbatches; on the rank that holds the last stage
    seconds: float  # wall time of the step on this rank
    peak_activation_bytes: int  # the store's peak of resident activation bytes during the step
    records: tuple[InstructionRecord, ...] = field(default=())  # when tracing
    started_ns: int = 0  # host clock (perf_counter_ns) when the step began; records count from here


def check_world(program: Program, rank: int, world_size: int) -> None:
    """The plan is for this job's world size and ``rank`` is one of its ranks; raises PlanError."""
    header = program.header
    if header.world_size != world_size:
        raise PlanError(
            f"the plan is for {header.world_size} ranks but this job has {world_size}; compile the plan for "
            f"{world_size} devices (pipeline.devices = {world_size}) or launch {header.world_size} processes "
            f"(torchrun --nproc-per-node {header.world_size})"
        )
    if not 0 <= rank < world_size:
        raise PlanError(f"rank {rank} is outside the job's {world_size} ranks")


def check_plan(program: Program, rank: int, world_size: int, stages: dict[int, nn.Module]) -> None:
    """Everything that can be checked without talking to another rank; raises PlanError."""
    header = program.header
    check_world(program, rank, world_size)
    verify(program)
    expected = header.stages_on(rank)
    if tuple(sorted(stages)) != expected:
        raise PlanError(f"rank {rank} runs stages {list(expected)} in this plan but was given stage modules "
                        f"{sorted(stages)}; split the model into {header.stages} stages and pass this rank's")


class Interpreter:
    """One rank of a pipeline plan.

    ``stages`` maps each stage this rank runs to its module; ``loss_fn(output, targets)`` is the
    last stage's loss. ``comm`` is None only for a single-rank plan.
    """

    def __init__(self, program: Program, rank: int, stages: dict[int, nn.Module],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, device: torch.device | str,
                 comm: P2P | None, trace: bool = False):
        world = comm.world_size if comm is not None else 1
        check_plan(program, rank, world, stages)
        self.program = program
        self.header = program.header
        self.rank = rank
        self.device = torch.device(device)
        self.comm = comm
        self.trace = trace
        self.loss_fn = loss_fn
        self.stages = stages
        self.runners = {s: StageGrad(m) for s, m in stages.items()}
        self.code = program.ranks[rank]
        self.last_stage = self.header.stages - 1
        self.microbatches = self.header.microbatches
        self.store = ActivationStore(self.device, exclude=module_tensors(stages.values()))
        self._ops = self._assemble()
        self._in_shape: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._out_shape: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._keep: dict[int, tuple[int, frozenset[int]]] = {}  # stage -> (saved count, positions W needs)
        self._scale = torch.tensor(1.0 / self.microbatches, device=self.device)
        # stage -> (bytes its forward saved, bytes still held after B); a fused backward keeps
        # everything to its end, so there both are the forward's bytes.
        self.activation_bytes: dict[int, tuple[int, int]] = {}
        # (stage, microbatch) pairs whose forward runs again before the backward (RECOMPUTE)
        self._recomputed = frozenset((ins.stage, ins.microbatch) for ins in self.code if ins.opcode is O.RECOMPUTE)

    # ----------------------------------------------------------------- assembly

    def _assemble(self) -> list[tuple[Callable, object, int]]:
        """(handler, operand, position) per step of the loop; adjacent sends and posts become one batch."""
        table = {
            O.LOAD_MICROBATCH: self._load,
            O.LOSS: self._loss,
            O.FORWARD: self._forward,
            O.BACKWARD_INPUT: self._backward_input,
            O.BACKWARD_WEIGHT: self._backward_weight,
            O.BACKWARD: self._backward,
            O.WAIT_RECV_ACTIVATION: self._wait_recv,
            O.WAIT_RECV_GRADIENT: self._wait_recv,
            O.WAIT_SENDS: self._wait_sends,
            O.LOCAL_ACTIVATION: self._local_activation,
            O.LOCAL_GRADIENT: self._local_gradient,
            O.OFFLOAD: self._offload,
            O.WAIT_OFFLOAD: self._wait_offload,
            O.RELOAD: self._reload,
            O.WAIT_RELOAD: self._wait_reload,
            O.RECOMPUTE: self._recompute,
        }
        ops: list[tuple[Callable, object, int]] = []
        run: list[Instruction] = []
        for position, ins in enumerate(self.code):
            if ins.opcode in POSTS_MESSAGE:
                run.append(ins)
                continue
            if run:
                ops.append((self._post, tuple(run), position - len(run)))
                run = []
            ops.append((table[ins.opcode], ins, position))
        if run:
            ops.append((self._post, tuple(run), len(self.code) - len(run)))
        return ops

    # ----------------------------------------------------------------- shapes

    def learn_shapes(self, batch: Batch) -> None:
        """Shape and dtype of every tensor crossing a rank boundary, by one forward without gradients.

        Runs in stage order; each rank only takes part for its own stages and their neighbours,
        with blocking sends, so the chain cannot deadlock.
        """
        rank_of = self.header.stage_ranks
        previous: torch.Tensor | None = None
        for s in range(self.header.stages):
            if rank_of[s] != self.rank:
                previous = None
                continue
            if s == 0:
                x = batch.inputs[0].to(self.device)
            elif rank_of[s - 1] == self.rank and previous is not None:
                x = previous
            else:
                shape, dtype = recv_meta(rank_of[s - 1], self._meta_tag(s), self.device)
                x = torch.zeros(shape, dtype=dtype, device=self.device)
            self._in_shape[s] = (x.shape, x.dtype)
            with torch.no_grad(), self._forward_context():
                try:
                    y = self.stages[s](x)
                except Exception as error:
                    raise self._split_error(s, x, error) from error
            if not isinstance(y, torch.Tensor):
                raise PlanError(f"stage {s}'s module returned a {type(y).__name__}; a stage must return one tensor "
                                f"(the next stage's input, or the last stage's output for the loss)")
            self._out_shape[s] = (y.shape, y.dtype)
            if s < self.last_stage and rank_of[s + 1] != self.rank:
                send_meta(y, rank_of[s + 1], self._meta_tag(s + 1))
            previous = y

    def _split_error(self, stage: int, x: torch.Tensor, error: Exception) -> PlanError:
        """A stage that cannot take its input: the model split does not match the plan."""
        first = first_line(error)
        given = f"a {x.dtype} tensor of shape {tuple(x.shape)}"
        if stage == 0:
            return PlanError(f"stage 0's module fails on one microbatch of the input ({given}): "
                             f"{type(error).__name__}: {first}; check the batch and the first stage module")
        return PlanError(f"stage {stage}'s module fails on the output of stage {stage - 1} ({given}): "
                         f"{type(error).__name__}: {first}; the model split does not match between stages "
                         f"{stage - 1} and {stage}: stage {stage - 1}'s output must be what stage {stage} takes")

    def _forward_context(self):
        """Autocast as the caller set it, but without its weight-cast cache.

        The cache keeps one low-precision copy of each weight for the whole autocast region, and
        that copy is saved for backward like an activation; the store empties a microbatch's
        activations after its backward while later microbatches in the same region would reuse
        the copy. Without the cache each forward casts (and saves) its own copy.
        """
        kind = self.device.type
        if torch.is_autocast_enabled(kind):
            return torch.autocast(kind, dtype=torch.get_autocast_dtype(kind), cache_enabled=False)
        return contextlib.nullcontext()

    def _meta_tag(self, stage: int) -> int:
        return 2 * self.header.stages * self.microbatches + stage  # beyond every message tag

    # ----------------------------------------------------------------- a step

    def step(self, batch: Batch) -> StepResult:
        """Run the stream once: forwards and backwards of every microbatch of ``batch``."""
        if batch.microbatches != self.microbatches:
            raise OptpipeError(f"the batch has {batch.microbatches} microbatches but the plan runs {self.microbatches}")
        if not self._in_shape and not self._out_shape:
            self.learn_shapes(batch)
        self._batch = batch
        self._x: dict = {}  # (stage, mb) -> forward input
        self._fwd: dict = {}  # (stage, mb) -> Forward
        self._root: dict = {}  # (stage, mb) -> loss, on the last stage
        self._dy: dict = {}  # (stage, mb) -> gradient of the stage output
        self._dx: dict = {}  # (stage, mb) -> gradient of the stage input, to hand on
        self._work: dict = {}  # (stage, mb) -> what B kept for W
        self._again: dict = {}  # (stage, mb) -> (forward input, RNG state) of a recomputed forward
        self._recv: dict = {}  # (kind, stage, mb) -> (work, message)
        self._sends: list = []  # (work, message) until WAIT_SENDS
        self._loss_sum = None
        self.store.reset_peak()
        records: list[InstructionRecord] = []
        ops = self._ops
        position = 0
        start = time.perf_counter_ns()
        try:
            if self.trace:
                clock = time.perf_counter_ns
                for handler, operand, position in ops:
                    t0 = clock()
                    handler(operand)
                    t1 = clock()
                    for ins in (operand if type(operand) is tuple else (operand,)):
                        records.append(InstructionRecord(ins.opcode, ins.stage, ins.microbatch, t0 - start, t1 - start))
            else:
                for handler, operand, position in ops:
                    handler(operand)
        except OptpipeError:
            raise
        except Exception as error:
            raise PipelineAborted(f"rank {self.rank}: instruction {position} ({self._describe(position)}) failed: "
                                  f"{type(error).__name__}: {error}") from error
        finally:
            self._batch = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = (time.perf_counter_ns() - start) / 1e9
        loss = None
        if self._loss_sum is not None:
            loss = float(self._loss_sum) / self.microbatches
        leftovers = self.store.live_entries
        if leftovers:
            raise PipelineAborted(f"rank {self.rank}: {leftovers} activations still held after the step; "
                                  f"the plan misses a backward")
        return StepResult(loss, seconds, self.store.peak, tuple(records), start)

    def _describe(self, position: int) -> str:
        return str(self.code[position]) if 0 <= position < len(self.code) else "?"

    # ----------------------------------------------------------------- data in and out

    # The store may empty what a forward saved, so the forward gets its own copy of the caller's data.

    def _load(self, ins: Instruction) -> None:
        tokens = self._batch.inputs[ins.microbatch].to(self.device, non_blocking=True, copy=True)
        self._x[(ins.stage, ins.microbatch)] = tokens

    def _loss(self, ins: Instruction) -> None:
        key = (ins.stage, ins.microbatch)
        targets = self._batch.targets[ins.microbatch].to(self.device, non_blocking=True, copy=True)
        output = self._fwd[key].output
        with self.store.capture(*key):
            try:
                loss = self.loss_fn(output, targets)
            except Exception as error:
                first = first_line(error)
                raise PlanError(f"the loss function fails on the last stage's output (a {output.dtype} tensor of "
                                f"shape {tuple(output.shape)}) and the targets of microbatch {ins.microbatch} (a "
                                f"{targets.dtype} tensor of shape {tuple(targets.shape)}): {type(error).__name__}: "
                                f"{first}") from error
        if loss.dim() != 0:
            raise PlanError(f"the loss function returned a tensor of shape {tuple(loss.shape)}; it must return one "
                            f"number per microbatch (the mean loss of the microbatch, as reduction='mean' gives)")
        self._root[key] = loss
        value = loss.detach()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        if key in self._recomputed:  # the recompute computes the loss again, with its graph
            del self._root[key]
            self._shed(key)

    # ----------------------------------------------------------------- compute

    def _forward(self, ins: Instruction) -> None:
        key = (ins.stage, ins.microbatch)
        x = self._x.pop(key)
        if key in self._recomputed:
            self._again[key] = (x, self._rng_state())
        with self.store.capture(*key), self._forward_context():
            self._fwd[key] = self.runners[ins.stage].forward(x)
        if key in self._recomputed and ins.stage != self.last_stage:
            self._shed(key)

    # ----------------------------------------------------------------- recompute

    def _rng_state(self):
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _shed(self, key) -> None:
        """A recomputed forward keeps only its input: the store releases what it saved (the
        simulator frees all but ``[recompute] resident`` at F's end) and counts the input, which
        the recompute needs, from here until the backward releases it; the graph goes, the
        output stays for the sends. So ``resident`` is the stage input's bytes (the profiler's
        ``input_bytes``, the cost model's stage input), and measured peaks equal the simulator's."""
        self.store.drop(*key)
        self.store.keep(*key, self._again[key][0])
        fwd = self._fwd[key]
        self._fwd[key] = type(fwd)(fwd.output.detach(), [])

    def _recompute(self, ins: Instruction) -> None:
        """Run the forward again from the kept input under the first run's RNG state (dropout
        draws the same mask), so the backward sees exactly what the first forward computed."""
        key = (ins.stage, ins.microbatch)
        x, (cpu, cuda) = self._again.pop(key)
        devices = [self.device] if cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if cuda is not None else "cuda"):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            with self.store.capture(*key), self._forward_context():
                fwd = self.runners[ins.stage].forward(x)
        self._fwd[key] = fwd
        if ins.stage == self.last_stage:
            targets = self._batch.targets[ins.microbatch].to(self.device, non_blocking=True, copy=True)
            with self.store.capture(*key):
                self._root[key] = self.loss_fn(fwd.output, targets)

    def _backward_args(self, key) -> tuple[list, list]:
        root = self._root.pop(key, None)
        if root is not None:
            return [root], [self._scale]
        return [self._fwd[key].output], [self._dy.pop(key)]

    def _backward_input(self, ins: Instruction) -> None:
        key = (ins.stage, ins.microbatch)
        outputs, grads = self._backward_args(key)
        fwd = self._fwd.pop(key)
        dx, work = self.runners[ins.stage].backward_input(fwd, outputs, grads)
        saved = self.store.entry_bytes(*key)
        released = self.store.forget(ins.stage, ins.microbatch, self._weight_needs(ins.stage, ins.microbatch, work))
        self.activation_bytes[ins.stage] = (saved, saved - released)
        self._work[key] = work
        if dx:
            self._dx[key] = dx[0]

    def _weight_needs(self, stage: int, microbatch: int, work) -> frozenset[int]:
        """Positions of the saved tensors W reads; found once per stage by reading them."""
        count = self.store.saved_count(stage, microbatch)
        if work.keeps_everything:
            return frozenset(range(count))
        known = self._keep.get(stage)
        if known is None or known[0] != count:
            with self.store.census() as seen:
                touch_saved_tensors(work.nodes())
            known = self._keep[stage] = (count, frozenset(seen))
        return known[1]

    def _backward_weight(self, ins: Instruction) -> None:
        StageGrad.backward_weight(self._work.pop((ins.stage, ins.microbatch)))
        self.store.drop(ins.stage, ins.microbatch)

    def _backward(self, ins: Instruction) -> None:
        key = (ins.stage, ins.microbatch)
        outputs, grads = self._backward_args(key)
        fwd = self._fwd.pop(key)
        dx = self.runners[ins.stage].backward(fwd, outputs, grads)
        saved = self.store.drop(ins.stage, ins.microbatch)
        self.activation_bytes.setdefault(ins.stage, (saved, saved))
        if dx and dx[0] is not None:
            self._dx[key] = dx[0]

    # ----------------------------------------------------------------- hand-over on this rank

    def _local_activation(self, ins: Instruction) -> None:
        y = self._fwd[(ins.stage, ins.microbatch)].output
        self._x[(ins.stage + 1, ins.microbatch)] = y.detach().requires_grad_(y.is_floating_point())

    def _local_gradient(self, ins: Instruction) -> None:
        self._dy[(ins.stage - 1, ins.microbatch)] = self._dx.pop((ins.stage, ins.microbatch))

    # ----------------------------------------------------------------- communication

    def _post(self, run: tuple[Instruction, ...]) -> None:
        messages = []
        for ins in run:
            s, i = ins.stage, ins.microbatch
            op = ins.opcode
            if op is O.SEND_ACTIVATION:
                tensor = self._fwd[(s, i)].output.detach().contiguous()
                if (tensor.shape, tensor.dtype) != self._out_shape[s]:
                    shape, dtype = self._out_shape[s]
                    raise PlanError(f"stage {s}'s output for microbatch {i} is a {tensor.dtype} tensor of shape "
                                    f"{tuple(tensor.shape)}, but it was {dtype} {tuple(shape)} in the first step; "
                                    f"messages between ranks keep their first shape: give every step the same "
                                    f"microbatch shape (DataLoader(..., drop_last=True)) and the same autocast")
                if self.store.holds(tensor):
                    # The forward also saved its output: an offload could empty that storage while
                    # the send still reads it, so the message gets its own copy.
                    tensor = tensor.clone()
                messages.append(Message(True, ACTIVATION, s + 1, i, ins.peer, tensor))
            elif op is O.SEND_GRADIENT:
                messages.append(Message(True, GRADIENT, s - 1, i, ins.peer, self._dx.pop((s, i)).contiguous()))
            elif op is O.POST_RECV_ACTIVATION:
                shape, dtype = self._in_shape[s]
                buffer = torch.empty(shape, dtype=dtype, device=self.device)
                messages.append(Message(False, ACTIVATION, s, i, ins.peer, buffer))
            else:
                shape, dtype = self._out_shape[s]
                buffer = torch.empty(shape, dtype=dtype, device=self.device)
                messages.append(Message(False, GRADIENT, s, i, ins.peer, buffer))
        works = self.comm.start(messages)
        for message, work in zip(messages, works):
            if message.send:
                self._sends.append((work, message))
            else:
                self._recv[(message.kind, message.stage, message.microbatch)] = (work, message)

    def _wait_recv(self, ins: Instruction) -> None:
        kind = ACTIVATION if ins.opcode is O.WAIT_RECV_ACTIVATION else GRADIENT
        key = (ins.stage, ins.microbatch)
        work, message = self._recv.pop((kind, ins.stage, ins.microbatch))
        self.comm.wait(work, message)
        if kind == ACTIVATION:
            tensor = message.tensor
            self._x[key] = tensor.requires_grad_() if tensor.is_floating_point() else tensor
        else:
            self._dy[key] = message.tensor

    def _wait_sends(self, ins: Instruction) -> None:
        for work, message in self._sends:
            self.comm.wait(work, message)
        self._sends = []

    # ----------------------------------------------------------------- host transfers

    def _offload(self, ins: Instruction) -> None:
        self.store.offload(ins.stage, ins.microbatch)

    def _wait_offload(self, ins: Instruction) -> None:
        self.store.wait_offload(ins.stage, ins.microbatch)

    def _reload(self, ins: Instruction) -> None:
        self.store.reload(ins.stage, ins.microbatch)

    def _wait_reload(self, ins: Instruction) -> None:
        self.store.wait_reload(ins.stage, ins.microbatch)
