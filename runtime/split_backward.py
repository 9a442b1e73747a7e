"""Split backward: B computes only the stage's input gradients, W later the weight gradients.

Works on the autograd graph of any stage module, so linear, layer norm, attention, GELU and
embedding layers need no special code. The idea follows the Zero Bubble paper and PyTorch's
``pipelining/_backward.py``; the code is ours.

B walks the graph once: the *input path* is every node on a path from the outputs to the
stage's inputs. A parameter's *weight branch* is the nodes between it and the input path; the
input-path nodes where weight branches attach are the *intermediates*. B runs autograd towards
the inputs only (retaining the graph) and, through node pre-hooks, keeps the gradient that
reaches each intermediate. W then runs autograd from those intermediates to the parameters,
one group of parameters at a time, so the engine never walks back down the input path: the
work of B and W adds up to one ordinary backward.

A stage whose input needs no gradient (the first, which takes token ids) has no input
gradient to compute, so its B does nothing but keep the output gradient, and its W is the
whole backward (as PyTorch's runtime does). No other stage waits for that B, and W is the op
schedules move into bubbles, so putting all of the stage's backward there costs no time; the
price is that the stage keeps its whole activation until W (its profiled ``weight_activation``
equals its ``activation``).

Gradients accumulate into ``param.grad`` as ordinary training does, so B/W over all
microbatches equals one backward over the whole batch.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge, Node

__all__ = ["StageGrad", "Forward", "WeightWork", "touch_saved_tensors"]


# The autograd engine itself: ``torch.autograd.grad`` and ``backward`` wrap this call with
# argument checks that cost ~50 us each time; B and W call it a dozen times per microbatch
# with arguments that are right by construction. (Private API; torch is pinned to 2.13.)
_ENGINE = torch.autograd.Variable._execution_engine


def _grad_accumulator(t: torch.Tensor) -> Node:
    """The AccumulateGrad node of a leaf (created on demand, then stable while referenced)."""
    return t.view_as(t).grad_fn.next_functions[0][0]


@dataclass
class Forward:
    """What a forward leaves for its backward."""

    output: torch.Tensor
    inputs: list[torch.Tensor]  # the stage input as a leaf, when it needs a gradient; else empty


@dataclass
class _Group:
    """Parameters whose gradients come from the same intermediates."""

    params: list[nn.Parameter]
    accumulators: list[Node]
    intermediates: list[Node]
    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    kept: list[tuple | None] = field(default_factory=list)  # per intermediate, the grads B saw (None: a root)


@dataclass
class WeightWork:
    """What B keeps for W: per parameter group the gradients at its intermediates, or, for a
    stage without an input gradient, the outputs and their gradients for a whole backward."""

    groups: list[_Group]
    branch_nodes: list[Node]  # weight-branch nodes W will run (for the saved-tensor census)
    whole: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def keeps_everything(self) -> bool:
        """W is the whole backward, so it needs every saved tensor."""
        return self.whole is not None

    def nodes(self) -> list[Node]:
        """Every node W runs; its saved tensors are what must survive B."""
        if self.whole is not None:
            return _in_order([o.grad_fn for o in self.whole[0]])
        found = list(self.branch_nodes)
        for group in self.groups:
            found.extend(group.intermediates)
        return found


class StageGrad:
    """Forward and backward passes of one stage module, B and W split or fused.

    Holds the stage's parameters' grad accumulators so that every microbatch's graph uses the
    same nodes and a weight branch can be found by identity.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._accumulators = {_grad_accumulator(p): p for p in self.params}
        self._accumulator_list = list(self._accumulators)
        self._plan: _Plan | None = None

    def forward(self, x: torch.Tensor) -> Forward:
        return Forward(self.module(x), [x] if x.requires_grad else [])

    # ----------------------------------------------------------------- fused

    def backward(self, fwd: Forward, outputs: list[torch.Tensor], grads: list[torch.Tensor | None]
                 ) -> list[torch.Tensor | None]:
        """Fused B and W: input gradients returned, parameter gradients accumulated."""
        for leaf in fwd.inputs:
            leaf.grad = None
        torch.autograd.backward(outputs, grads)
        return [leaf.grad for leaf in fwd.inputs]

    # ----------------------------------------------------------------- B

    def backward_input(self, fwd: Forward, outputs: list[torch.Tensor], grads: list[torch.Tensor | None]
                       ) -> tuple[list[torch.Tensor | None], WeightWork]:
        """Gradients of the stage's inputs only; returns them and what W needs."""
        if not fwd.inputs:
            return [], WeightWork([], [], (list(outputs), list(grads)))
        nodes = _in_order([o.grad_fn for o in outputs])
        plan = self._plan if self._plan is not None and self._plan.matches(nodes) else None
        if plan is None:
            plan = self._plan = _Plan.analyse(nodes, [_grad_accumulator(leaf) for leaf in fwd.inputs],
                                              self._accumulators)
        intermediates = [nodes[k] for k in plan.intermediates]
        kept: dict[Node, tuple] = {}
        handles = [intermediates[j].register_prehook(_keeper(kept, intermediates[j])) for j in plan.hooked]
        try:
            grads = [g if g is not None else torch.ones_like(o) for o, g in zip(outputs, grads)]
            # keep_graph=True (W runs this graph again), accumulate_grad=False (return, do not store)
            dx = list(_ENGINE.run_backward(tuple(outputs), tuple(grads), True, False, tuple(fwd.inputs), True, False))
        finally:
            for handle in handles:
                handle.remove()

        root_grads: dict[Node, dict[int, torch.Tensor]] = defaultdict(dict)
        for o, g in zip(outputs, grads):
            if o.grad_fn is not None:
                root_grads[o.grad_fn][o.output_nr] = g if g is not None else torch.ones_like(o)
        groups = []
        for params, members in plan.groups:
            group = _Group([self.params[k] for k in params], [self._accumulator_list[k] for k in params],
                           [intermediates[j] for j in members])
            for node in group.intermediates:
                if node in kept:
                    captured = dict(enumerate(kept[node]))
                    group.kept.append(kept[node])
                else:  # a root above every input path: its gradient is the output's own
                    captured = root_grads[node]
                    group.kept.append(None)
                for k, g in captured.items():
                    if g is not None:
                        group.edges.append(GradientEdge(node, k))
                        group.grads.append(g)
            if group.edges:
                groups.append(group)
        return dx, WeightWork(groups, [nodes[k] for k in plan.branch])

    # ----------------------------------------------------------------- W

    @staticmethod
    def backward_weight(work: WeightWork) -> None:
        """Parameter gradients from what B kept, accumulated into ``param.grad``."""
        if work.whole is not None:
            torch.autograd.backward(*work.whole)
            return
        for group in work.groups:
            handles = []
            if len(group.intermediates) > 1:
                # Another intermediate of the group may lie below this one on the input path;
                # pin each to what B saw so nothing is counted twice.
                for node, captured in zip(group.intermediates, group.kept):
                    if captured is not None:  # roots have nothing above them to pin against
                        handles.append(node.register_prehook(lambda _grads, c=captured: c))
            try:
                # Only this group's accumulators are targets, so the engine runs the weight
                # branches and never walks back down the input path; AccumulateGrad adds into
                # .grad exactly as an ordinary backward does.
                _ENGINE.run_backward(tuple(group.edges), tuple(group.grads), True, False,
                                     tuple(GradientEdge(a, 0) for a in group.accumulators), True, True)
            finally:
                for handle in handles:
                    handle.remove()


@dataclass(frozen=True)
class _Plan:
    """Where a stage's parameter groups attach, as positions in the graph's breadth-first order.

    Every microbatch of a stage builds the same graph, so the analysis is done once and
    reused; ``matches`` checks the shape of a new graph before trusting the positions.
    """

    size: int
    intermediates: tuple[int, ...]  # graph positions
    kinds: tuple[type, ...]  # node type at each of those positions
    hooked: tuple[int, ...]  # indices into ``intermediates`` that B runs (roots are not among them)
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (parameter indices, intermediate indices)
    branch: tuple[int, ...]  # graph positions of weight-branch nodes

    def matches(self, nodes: list[Node]) -> bool:
        return len(nodes) == self.size and all(type(nodes[k]) is t for k, t in zip(self.intermediates, self.kinds))

    @staticmethod
    def analyse(nodes: list[Node], input_nodes: list[Node], accumulators: dict[Node, nn.Parameter]) -> "_Plan":
        position = {node: k for k, node in enumerate(nodes)}
        parents: dict[Node, list[Node]] = defaultdict(list)
        for node in nodes:
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    parents[nxt].append(node)
        input_path = _closure([n for n in input_nodes if n in position], parents, stop=frozenset())
        param_index = {acc: k for k, acc in enumerate(accumulators)}

        members: list[tuple[list[int], set[Node]]] = []  # per group id: (param indices, intermediates)
        alias: list[int] = []  # union-find over group ids
        owner: dict[Node, int] = {}
        branch: list[int] = []

        def find(g: int) -> int:
            while alias[g] != g:
                alias[g] = alias[alias[g]]
                g = alias[g]
            return g

        for acc in accumulators:
            if acc not in position:
                continue  # not used by this forward
            reach = _closure([acc], parents, stop=input_path)
            meets = {n for n in reach if n in input_path}
            for node in reach:
                if node not in input_path and node is not acc:
                    branch.append(position[node])
                    if not parents.get(node):  # a root reached without meeting the input path
                        meets.add(node)
            gid = len(members)
            members.append(([param_index[acc]], meets))
            alias.append(gid)
            for node in meets:
                other = owner.setdefault(node, gid)
                a, b = find(other), find(gid)
                if a != b:
                    alias[b] = a
                    members[a][0].extend(members[b][0])
                    members[a][1].update(members[b][1])

        order: list[Node] = []
        groups = []
        for gid, (params, meets) in enumerate(members):
            if find(gid) != gid or not meets:
                continue
            start = len(order)
            order.extend(sorted(meets, key=position.__getitem__))
            groups.append((tuple(params), tuple(range(start, len(order)))))
        return _Plan(
            size=len(nodes),
            intermediates=tuple(position[n] for n in order),
            kinds=tuple(type(n) for n in order),
            hooked=tuple(j for j, n in enumerate(order) if n in input_path),
            groups=tuple(groups),
            branch=tuple(sorted(set(branch))),
        )


def _in_order(roots: list[Node]) -> list[Node]:
    """The graph's nodes breadth-first from the roots: the same order for the same graph shape."""
    seen = dict.fromkeys(r for r in roots if r is not None)
    queue = deque(seen)
    while queue:
        for nxt, _ in queue.popleft().next_functions:
            if nxt is not None and nxt not in seen:
                seen[nxt] = None
                queue.append(nxt)
    return list(seen)


def _keeper(kept: dict, node: Node):
    def hook(grad_outputs):
        kept[node] = tuple(grad_outputs)

    return hook


def _closure(starts: list[Node], parents: dict, stop: frozenset | set) -> set[Node]:
    """Nodes reachable upwards (towards the outputs) from ``starts``; ``stop`` nodes end a walk."""
    found = set(starts)
    queue = deque(starts)
    while queue:
        node = queue.popleft()
        if node in stop and node not in starts:
            continue
        for up in parents.get(node, ()):
            if up not in found:
                found.add(up)
                queue.append(up)
    return found


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def touch_saved_tensors(nodes: list[Node]) -> None:
    """Read every tensor each node saved, which runs the unpack hook once per saved tensor.

    With a recording hook in place this names the saved tensors a set of nodes depends on.
    """
    for node in nodes:
        kind = type(node)
        names = _SAVED_NAMES.get(kind)
        if names is None:
            names = tuple(n for n in dir(node) if n.startswith("_saved_"))
            _SAVED_NAMES[kind] = names
        for name in names:
            getattr(node, name)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            node.saved_tensors  # a custom autograd.Function's ctx.save_for_backward
