"""The plan verifier: structure, pairing of messages, and deadlock freedom.

A plan is trusted by nobody: the runtime verifies it before the first instruction. The checks
run in this order, and the first broken rule raises ``PlanError`` naming the rank, the
position, the instruction and the rule:

1. header: world size, stage -> rank map, chunks, microbatches agree with the streams;
2. operands: every instruction's stage lives on its rank, its peer is the neighbouring
   stage's rank, hand-overs stay on the rank and messages leave it; each instruction at most
   once; nothing after WAIT_SENDS;
3. pairing: between each pair of ranks every send has its posted receive and the k-th send
   matches the k-th receive (NCCL matches point-to-point calls in order);
4. order, per rank: the rules in ``_NEEDS`` (a forward after its input, a backward after its
   gradient and its reloaded activation, W after B, a reload after its offload, a wait after
   its post) and ``_FORBIDS`` (no offload after the backward, no fused and split backward of
   one microbatch);
5. completeness: every F, B (or fused backward), W of every stage and microbatch, and the
   stream ends with WAIT_SENDS (handing outputs on, losses and waits on posted receives then
   follow from rules 3 and 4);
6. deadlock freedom: all ranks run abstractly, sends and posts never block, WAIT_RECV blocks
   until the peer has issued the matching send, WAIT_SENDS until every peer has posted the
   matching receives. If no rank can move, the error lists each rank's position and the
   cycle of waits.

The abstract machine is the runtime's contract: sends are asynchronous (they complete once
the receiver has posted), receives are posted without blocking and waited on explicitly.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass

from optpipe.core.errors import PlanError
from optpipe.plan.lower import header_for, raise_schedule
from optpipe.core.problem import Problem
from optpipe.core.schedule import OpKind
from optpipe.plan.program import (HAS_PEER, KIND_OF, NEIGHBOUR, NO_PEER, RECEIVE_OF, RECEIVE_POSTS, RECEIVE_WAITS,
                                  SENDS, WAIT_OF, Instruction, Opcode, Operand, Program)
from optpipe.core.simulate import Timeline, simulate

__all__ = ["Verdict", "verify", "check_against_problem", "predict"]

O = Opcode  # short name for the rule tables
Fact = tuple[Opcode, int, int]  # (opcode, stage, microbatch) that has run on a rank


@dataclass(frozen=True)
class Verdict:
    """What a successful verification saw."""

    instructions: tuple[int, ...]  # per rank
    messages: int  # cross-rank sends, each paired with a posted receive
    waits: int  # times a rank of the abstract run blocked on a peer and was later released


def verify(program: Program) -> Verdict:
    """Raise PlanError at the first broken rule; return what was checked otherwise."""
    _check_header(program)
    for rank, stream in enumerate(program.ranks):
        _check_operands(program, rank, stream)
    pairs = _check_pairing(program)
    for rank, stream in enumerate(program.ranks):
        _check_order(program, rank, stream)
    for rank, stream in enumerate(program.ranks):
        _check_complete(program, rank, stream)
    waits = _check_deadlock(program, pairs)
    return Verdict(tuple(len(s) for s in program.ranks), len(pairs), waits)


# --------------------------------------------------------------------------- 1. header


def _check_header(program: Program) -> None:
    h = program.header
    if h.world_size < 1 or len(program.ranks) != h.world_size:
        raise PlanError(f"header: world size {h.world_size} but the plan has {len(program.ranks)} rank streams; "
                        f"a plan has one stream per rank")
    if h.stages < 1 or h.microbatches < 1 or h.chunks < 1:
        raise PlanError(f"header: expected at least one stage, chunk and microbatch, got {h.stages} stages, "
                        f"{h.chunks} chunks, {h.microbatches} microbatches")
    for stage, rank in enumerate(h.stage_ranks):
        if not 0 <= rank < h.world_size:
            raise PlanError(f"header: stage {stage} is mapped to rank {rank}, but ranks run 0..{h.world_size - 1}")
    for rank in range(h.world_size):
        hosted = h.stages_on(rank)
        if len(hosted) != h.chunks:
            raise PlanError(f"header: rank {rank} hosts stages {list(hosted)}, but the header says {h.chunks} "
                            f"stage(s) per rank (chunks)")


# --------------------------------------------------------------------------- 2. operands

@dataclass(frozen=True)
class _Rank:
    rank: int
    rank_of: tuple[int, ...]
    last: int

    def local(self, stage: int) -> bool:
        return self.rank_of[stage] == self.rank


def _fail(rank: int, position: int, ins: Instruction, rule: str, detail: str) -> PlanError:
    return PlanError(f"rank {rank} position {position}: {ins}: breaks rule '{rule}': {detail}")


def _text(fact: Fact) -> str:
    return f"{fact[0].name} s={fact[1]} mb={fact[2]}"


def _check_instruction(program: Program, c: _Rank, position: int, ins: Instruction) -> None:
    h = program.header
    rank = c.rank
    if not isinstance(ins.opcode, Opcode):
        raise _fail(rank, position, ins, "known opcodes only", f"{ins.opcode!r} is not an opcode")
    if Operand.STAGE not in ins.opcode.spec.operands:
        if (ins.stage, ins.microbatch, ins.peer) != (-1, -1, NO_PEER):
            raise _fail(rank, position, ins, f"{ins.opcode.name} has no operands",
                        "expected stage, microbatch and peer -1")
        return
    s, i = ins.stage, ins.microbatch
    if not 0 <= s < h.stages:
        raise _fail(rank, position, ins, "operands in range", f"stage {s} is not one of 0..{h.stages - 1}")
    if not 0 <= i < h.microbatches:
        raise _fail(rank, position, ins, "operands in range", f"microbatch {i} is not one of 0..{h.microbatches - 1}")
    if not c.local(s):
        raise _fail(rank, position, ins, "an instruction runs on its stage's rank",
                    f"stage {s} lives on rank {c.rank_of[s]}")
    if ins.opcode is O.LOAD_MICROBATCH and s != 0:
        raise _fail(rank, position, ins, "microbatches are loaded by the first stage", f"stage {s} is not stage 0")
    if ins.opcode is O.LOSS and s != c.last:
        raise _fail(rank, position, ins, "the loss belongs to the last stage", f"stage {s} is not stage {c.last}")
    link = NEIGHBOUR.get(ins.opcode)
    expected_peer = NO_PEER
    if link is not None:
        step, crosses = link
        other = s + step
        if not 0 <= other < h.stages:
            raise _fail(rank, position, ins, "messages go to a neighbouring stage",
                        f"stage {s} has no stage {other} to exchange with")
        if crosses and c.local(other):
            raise _fail(rank, position, ins, "messages cross ranks; same-rank neighbours use LOCAL_ hand-overs",
                        f"stage {other} is on this rank too")
        if not crosses and not c.local(other):
            raise _fail(rank, position, ins, "LOCAL_ hand-overs stay on the rank",
                        f"stage {other} lives on rank {c.rank_of[other]}; use a send and a receive")
        if ins.opcode in HAS_PEER:
            expected_peer = c.rank_of[other]
    if ins.peer != expected_peer:
        want = f"peer {expected_peer} (the rank of the neighbouring stage)"
        if expected_peer == NO_PEER:
            want = "no peer (-1)"
        raise _fail(rank, position, ins, "the peer is the neighbouring stage's rank",
                    f"expected {want}, got {ins.peer}")


def _check_operands(program: Program, rank: int, stream: tuple[Instruction, ...]) -> None:
    c = _Rank(rank, program.header.stage_ranks, program.header.stages - 1)
    seen: dict[Fact, int] = {}
    for position, ins in enumerate(stream):
        _check_instruction(program, c, position, ins)
        if position > 0 and stream[position - 1].opcode is O.WAIT_SENDS:
            raise _fail(rank, position, ins, "WAIT_SENDS ends the stream", "nothing may follow it")
        fact = (ins.opcode, ins.stage, ins.microbatch)
        if fact in seen:
            raise _fail(rank, position, ins, "each instruction runs once per step",
                        f"it already ran at position {seen[fact]}")
        seen[fact] = position


# --------------------------------------------------------------------------- 3. pairing

def _wanted_post(send: Instruction) -> Fact:
    """The posted receive that a send pairs with: the receiving stage's, for the same microbatch."""
    return RECEIVE_OF[send.opcode], send.stage + NEIGHBOUR[send.opcode].step, send.microbatch


@dataclass(frozen=True)
class _Pair:
    sender: int
    send_at: int
    receiver: int
    post_at: int
    wait_at: int


def _check_pairing(program: Program) -> list[_Pair]:
    sends: dict[tuple[int, int], list[tuple[int, Instruction]]] = defaultdict(list)
    posts: dict[tuple[int, int], list[tuple[int, Instruction]]] = defaultdict(list)
    waits: list[dict[Fact, int]] = []
    for rank, stream in enumerate(program.ranks):
        mine: dict[Fact, int] = {}
        for position, ins in enumerate(stream):
            if ins.opcode in SENDS:
                sends[(rank, ins.peer)].append((position, ins))
            elif ins.opcode in RECEIVE_POSTS:
                posts[(ins.peer, rank)].append((position, ins))
            elif ins.opcode in RECEIVE_WAITS:
                mine[(ins.opcode, ins.stage, ins.microbatch)] = position
        waits.append(mine)
    pairs = []
    for a, b in sorted(set(sends) | set(posts)):
        out, into = sends.get((a, b), []), posts.get((a, b), [])
        sent = {_wanted_post(send) for _, send in out}
        posted = {(post.opcode, post.stage, post.microbatch): position for position, post in into}
        for position, post in into:
            if (post.opcode, post.stage, post.microbatch) not in sent:
                raise PlanError(f"rank {b} position {position}: {post}: breaks rule 'every receive has its send': "
                                f"rank {a} never sends the matching message to rank {b} "
                                f"(it sends {len(out)} message(s) to rank {b})")
        for position, send in out:
            if _wanted_post(send) not in posted:
                kind, s, i = _wanted_post(send)
                wait = (WAIT_OF[kind], s, i)
                waiting = ""
                if wait in waits[b]:
                    waiting = f"; it waits for it at position {waits[b][wait]} without posting it"
                raise PlanError(f"rank {a} position {position}: {send}: breaks rule 'every send has its receive': "
                                f"rank {b} never posts {_text(_wanted_post(send))} from rank {a}{waiting}")
        for k, ((send_at, send), (post_at, post)) in enumerate(zip(out, into)):
            expected = _wanted_post(send)
            if (post.opcode, post.stage, post.microbatch) != expected:
                raise PlanError(
                    f"rank {b} position {post_at}: {post}: breaks rule 'sends and receives pair up in order between "
                    f"two ranks': it is receive #{k + 1} posted from rank {a}, but send #{k + 1} from rank {a} to "
                    f"rank {b} is {send} at rank {a} position {send_at}, which needs {_text(expected)} "
                    f"(posted here at position {posted[expected]})")
            wait_at = waits[b].get((WAIT_OF[post.opcode], post.stage, post.microbatch), -1)
            pairs.append(_Pair(a, send_at, b, post_at, wait_at))
    return pairs


# --------------------------------------------------------------------------- 4. order


Need = tuple[tuple[Fact, ...], str]  # one of these facts must have run before; the rule's name

_INPUT = "a forward runs after its input is in place"
_GRADIENT = "a backward runs after its output gradient is in place"
_POSTED = "a receive is waited on after it is posted"
_NOT_AFTER_BACKWARD = "an activation is offloaded before its backward, not after"
_ONE_BACKWARD = "one microbatch's backward is either fused or split, not both"
_RECOMPUTE_BEFORE_BACKWARD = "a recompute brings back what its backward uses, so it comes before the backward"
_KEEP_OFFLOAD_OR_RECOMPUTE = "an activation is kept, offloaded or recomputed: not both offloaded and recomputed"
_BACKWARDS = tuple(op for op, kind in KIND_OF.items() if kind in (OpKind.B, OpKind.BW))  # make the input gradient

# For each opcode: which opcodes of the same stage and microbatch must have run before it on
# the same rank (any one of a group), and the rule that says so.
_NEEDS: dict[Opcode, tuple[tuple[tuple[Opcode, ...], str], ...]] = {
    O.LOSS: (((O.FORWARD,), "the loss follows its forward"),),
    O.SEND_ACTIVATION: (((O.FORWARD,), "an activation is sent after the forward that made it"),),
    O.LOCAL_ACTIVATION: (((O.FORWARD,), "an activation is handed over after the forward that made it"),),
    O.WAIT_RECV_ACTIVATION: (((O.POST_RECV_ACTIVATION,), _POSTED),),
    O.WAIT_RECV_GRADIENT: (((O.POST_RECV_GRADIENT,), _POSTED),),
    O.BACKWARD_INPUT: (((O.FORWARD,), "a backward runs after its forward"),),
    O.BACKWARD: (((O.FORWARD,), "a backward runs after its forward"),),
    O.BACKWARD_WEIGHT: (((O.BACKWARD_INPUT,), "W runs after the B of the same stage and microbatch"),),
    O.SEND_GRADIENT: ((_BACKWARDS, "a gradient is sent after the backward that made it"),),
    O.LOCAL_GRADIENT: ((_BACKWARDS, "a gradient is handed over after the backward that made it"),),
    O.OFFLOAD: (((O.FORWARD,), "an offload moves what its forward saved, so it follows the forward"),),
    O.WAIT_OFFLOAD: (((O.OFFLOAD,), "every wait has its event: WAIT_OFFLOAD after its OFFLOAD"),),
    O.RELOAD: (((O.OFFLOAD,), "every reload comes after its offload"),
               ((O.WAIT_OFFLOAD,), "a reload reads the host copy, complete only after WAIT_OFFLOAD")),
    O.WAIT_RELOAD: (((O.RELOAD,), "every wait has its event: WAIT_RELOAD after its RELOAD"),),
    O.RECOMPUTE: (((O.FORWARD,), "a recompute re-runs its forward, so it follows the forward"),),
}

# For each opcode: which opcodes of the same stage and microbatch must NOT have run before it.
_FORBIDS: dict[Opcode, tuple[tuple[Opcode, str], ...]] = {
    O.OFFLOAD: ((O.BACKWARD_INPUT, _NOT_AFTER_BACKWARD), (O.BACKWARD, _NOT_AFTER_BACKWARD),
                (O.RECOMPUTE, _KEEP_OFFLOAD_OR_RECOMPUTE)),
    O.RECOMPUTE: ((O.BACKWARD_INPUT, _RECOMPUTE_BEFORE_BACKWARD), (O.BACKWARD, _RECOMPUTE_BEFORE_BACKWARD),
                  (O.OFFLOAD, _KEEP_OFFLOAD_OR_RECOMPUTE)),
    O.BACKWARD_INPUT: ((O.BACKWARD, _ONE_BACKWARD),),
    O.BACKWARD: ((O.BACKWARD_INPUT, _ONE_BACKWARD),),
}


def _needs(c: _Rank, ins: Instruction, done: dict) -> list[Need]:
    """The table's needs, plus those that depend on where the neighbouring stages live."""
    op, s, i = ins.opcode, ins.stage, ins.microbatch
    needs: list[Need] = [(tuple((kind, s, i) for kind in kinds), rule) for kinds, rule in _NEEDS.get(op, ())]
    if op is O.FORWARD:
        if s == 0:
            needs.append((((O.LOAD_MICROBATCH, s, i),), _INPUT))
        elif c.local(s - 1):
            needs.append((((O.LOCAL_ACTIVATION, s - 1, i),), _INPUT))
        else:
            needs.append((((O.WAIT_RECV_ACTIVATION, s, i),), _INPUT))
    elif op is O.RECOMPUTE and s == c.last:
        needs.append((((O.LOSS, s, i),), "the last stage's recompute follows the loss of its first forward"))
    elif op in _BACKWARDS:
        if s == c.last:
            needs.append((((O.LOSS, s, i),), "the last stage's backward runs after the loss"))
        elif c.local(s + 1):
            needs.append((((O.LOCAL_GRADIENT, s + 1, i),), _GRADIENT))
        else:
            needs.append((((O.WAIT_RECV_GRADIENT, s, i),), _GRADIENT))
        if (O.OFFLOAD, s, i) in done:
            needs.append((((O.WAIT_RELOAD, s, i),), "an offloaded activation is reloaded and waited on before its "
                                                    "backward"))
    return needs


def _check_order(program: Program, rank: int, stream: tuple[Instruction, ...]) -> None:
    c = _Rank(rank, program.header.stage_ranks, program.header.stages - 1)
    first_at = {(ins.opcode, ins.stage, ins.microbatch): position for position, ins in enumerate(stream)}
    done: dict[Fact, int] = {}
    for position, ins in enumerate(stream):
        s, i = ins.stage, ins.microbatch
        for alternatives, rule in _needs(c, ins, done):
            if not any(a in done for a in alternatives):
                later = [f"{_text(a)} is at position {first_at[a]}" for a in alternatives if a in first_at]
                where = ("; it comes too late: " + ", ".join(later)) if later else "; it is missing from this rank"
                wanted = " or ".join(_text(a) for a in alternatives)
                raise _fail(rank, position, ins, rule, f"needs {wanted} before it{where}")
        for kind, rule in _FORBIDS.get(ins.opcode, ()):
            if (kind, s, i) in done:
                fact = (kind, s, i)
                raise _fail(rank, position, ins, rule, f"{_text(fact)} already ran at position {done[fact]}")
        done[(ins.opcode, s, i)] = position


# --------------------------------------------------------------------------- 5. completeness


def _check_complete(program: Program, rank: int, stream: tuple[Instruction, ...]) -> None:
    h = program.header
    at = {(ins.opcode, ins.stage, ins.microbatch): position for position, ins in enumerate(stream)}
    if not stream or stream[-1].opcode is not O.WAIT_SENDS:
        raise PlanError(f"rank {rank}: breaks rule 'the stream ends with WAIT_SENDS': "
                        f"{'it is empty' if not stream else f'it ends with {stream[-1]}'}")
    for s in h.stages_on(rank):
        for i in range(h.microbatches):
            def missing(opcode: Opcode, rule: str, detail: str = "") -> PlanError:
                return PlanError(f"rank {rank}: {opcode.name} s={s} mb={i} is missing: breaks rule '{rule}'{detail}")

            if (O.FORWARD, s, i) not in at:
                raise missing(O.FORWARD, "every stage runs F for every microbatch")
            split, fused = (O.BACKWARD_INPUT, s, i) in at, (O.BACKWARD, s, i) in at
            if not split and not fused:
                raise missing(O.BACKWARD_INPUT, "every stage runs B (or a fused BACKWARD) for every microbatch")
            if split and (O.BACKWARD_WEIGHT, s, i) not in at:
                raise missing(O.BACKWARD_WEIGHT, "every split backward runs W",
                              f": BACKWARD_INPUT s={s} mb={i} at position {at[(O.BACKWARD_INPUT, s, i)]} has no W")


# --------------------------------------------------------------------------- 6. deadlock


def _check_deadlock(program: Program, pairs: list[_Pair]) -> int:
    """Run every rank abstractly; return how often a rank blocked, or raise with the cycle of waits.

    A worklist, not sweeps over all ranks: a blocked rank sleeps on the peer and position it
    waits for and wakes when that peer gets past it, so the run is near-linear in instructions
    (sweeping took one pass per rank of a backward chain: quadratic, hours at 65,534 ranks).
    """
    ranks = program.ranks
    # recv_needs[rank][position of a WAIT_RECV] = (sender, position of the matching send)
    recv_needs: list[dict[int, tuple[int, int]]] = [dict() for _ in ranks]
    send_needs: list[dict[int, int]] = [dict() for _ in ranks]  # per sender: receiver -> last post position
    for pair in pairs:
        if pair.wait_at >= 0:
            recv_needs[pair.receiver][pair.wait_at] = (pair.sender, pair.send_at)
        previous = send_needs[pair.sender].get(pair.receiver, -1)
        send_needs[pair.sender][pair.receiver] = max(previous, pair.post_at)
    pc = [0] * len(ranks)

    def blocker(rank: int) -> tuple[int, int] | None:
        position = pc[rank]
        if ranks[rank][position].opcode is O.WAIT_SENDS:
            for other, post_at in sorted(send_needs[rank].items()):
                if pc[other] <= post_at:
                    return other, post_at
            return None
        need = recv_needs[rank].get(position)
        if need is not None and pc[need[0]] <= need[1]:
            return need
        return None

    sleeping: dict[int, list[tuple[int, int]]] = defaultdict(list)  # peer -> heap of (position, rank)
    ready = deque(range(len(ranks)))
    waits = 0
    while ready:
        rank = ready.popleft()
        stream = ranks[rank]
        while pc[rank] < len(stream):
            need = blocker(rank)
            if need is not None:
                heapq.heappush(sleeping[need[0]], (need[1], rank))
                break
            pc[rank] += 1
        queue = sleeping.get(rank)
        while queue and queue[0][0] < pc[rank]:  # the peers this rank's progress releases
            ready.append(heapq.heappop(queue)[1])
            waits += 1
    if all(pc[r] == len(s) for r, s in enumerate(ranks)):
        return waits
    raise PlanError(_describe_deadlock(ranks, pc, blocker))


_SHOWN_RANKS = 16  # in a deadlock report; the cycle of waits follows in full


def _describe_deadlock(ranks, pc, blocker) -> str:
    lines = ["deadlock: no rank can proceed; each rank's position:"]
    shown = 0
    for rank, stream in enumerate(ranks):
        if shown == _SHOWN_RANKS:
            lines.append(f"  ... and {len(ranks) - rank} more ranks")
            break
        shown += 1
        if pc[rank] == len(stream):
            lines.append(f"  rank {rank}: finished ({len(stream)} instructions)")
            continue
        other, position = blocker(rank)
        lines.append(f"  rank {rank} at position {pc[rank]}: {ranks[rank][pc[rank]]}  "
                     f"(waits for rank {other} to run position {position}: {ranks[other][position]})")
    # Once messages pair up, a blocked rank waits only on an unfinished one (a finished rank has
    # sent and posted everything), so following the waits from any blocked rank closes a cycle.
    rank = next(r for r, s in enumerate(ranks) if pc[r] < len(s))
    seen: dict[int, int] = {}
    path: list[int] = []
    while rank not in seen:
        seen[rank] = len(path)
        path.append(rank)
        rank = blocker(rank)[0]
    loop = path[seen[rank]:]
    steps = [f"rank {r} (position {pc[r]}: {ranks[r][pc[r]]})" for r in loop]
    lines.append("cycle of waits: " + " -> ".join(steps + [f"rank {loop[0]}"]))
    lines.append("each rank in the cycle waits for a message that the next one sends only after its own wait; "
                 "move the send before the wait, or post and wait on the receives in the order the peer sends")
    return "\n".join(lines)


# --------------------------------------------------------------------------- with a problem


def check_against_problem(program: Program, problem: Problem) -> None:
    """The plan was compiled for this problem (by hash) and agrees with its shape."""
    expected = header_for(problem, program.header.schedule_name)
    h = program.header
    if h.problem_hash != expected.problem_hash:
        raise PlanError(f"the plan was compiled for a different problem: its problem hash is "
                        f"{h.problem_hash.hex()[:16]}..., {problem.name!r} hashes to "
                        f"{expected.problem_hash.hex()[:16]}...; "
                        f"recompile the plan for this problem, or pass the problem it was compiled for")
    if (h.world_size, h.stage_ranks, h.chunks, h.microbatches) != (
            expected.world_size, expected.stage_ranks, expected.chunks, expected.microbatches):
        raise PlanError(f"the plan's shape ({h.world_size} ranks, stage -> rank {list(h.stage_ranks)}, "
                        f"{h.microbatches} microbatches) differs from problem {problem.name!r}")


def predict(program: Program, problem: Problem) -> Timeline:
    """Time and memory of a verified plan on its problem, by the simulator."""
    check_against_problem(program, problem)
    return simulate(problem, raise_schedule(program))
