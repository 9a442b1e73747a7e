"""optpipe check: validate a problem file and show what it describes."""

from __future__ import annotations

from rich.table import Table

from optpipe.core.units import format_bandwidth, format_size
from optpipe.cli.commands.common import add_problem_argument, console, markup_safe, read_problem


def add_parser(sub) -> None:
    parser = sub.add_parser("check", help="validate a problem file and print it as a table")
    add_problem_argument(parser, optional=True)
    parser.set_defaults(run=run)


def _per_stage(values, fmt) -> str:
    if all(v == values[0] for v in values):
        return fmt(values[0])
    return ", ".join(fmt(v) for v in values)


def run(args) -> int:
    problem = read_problem(args)
    pipe, costs, memory, offload = problem.pipeline, problem.costs, problem.memory, problem.offload
    table = Table(title=f"{markup_safe(problem.name)}: valid", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    ms = lambda v: f"{v:g} ms"  # noqa: E731
    table.add_row("devices (p)", str(pipe.devices))
    table.add_row("chunks per device (v)", f"{pipe.chunks_per_device}  ({pipe.stages} stages, {pipe.placement.value})")
    table.add_row("microbatches (m)", str(pipe.microbatches))
    table.add_row("stage -> device", " ".join(str(pipe.device_of(s)) for s in range(pipe.stages)))
    table.add_row("forward", _per_stage(costs.forward, ms))
    table.add_row("backward-input", _per_stage(costs.backward_input, ms))
    table.add_row("backward-weight", _per_stage(costs.backward_weight, ms))
    table.add_row("p2p", ms(costs.p2p))
    table.add_row("activation", _per_stage(memory.activation, format_size))
    table.add_row("weight activation", _per_stage(memory.weight_activation, format_size))
    table.add_row("budget", f"{format_size(memory.budget)} per device "
                            f"({memory.budget / max(memory.activation):.1f} stage activations)")
    if offload.enabled:
        round_trip = [problem.offload_ms(s) + problem.reload_ms(s) for s in range(pipe.stages)]
        k = max(rt / (costs.forward[s] + costs.backward_input[s]) for s, rt in enumerate(round_trip))
        table.add_row("offload", f"D2H {format_bandwidth(offload.d2h_bandwidth)}, H2D {format_bandwidth(offload.h2d_bandwidth)}, "
                                 f"host budget {format_size(offload.host_budget)}")
        table.add_row("round trip / (F+B)", f"k = {k:.2f}" + ("  (offload cannot hide behind compute)" if k > 1 else ""))
    else:
        table.add_row("offload", "disabled")
    if offload.enabled and offload.link_groups:
        table.add_row("shared host links", ", ".join("devices " + "+".join(str(d) for d in group)
                                                    for group in offload.link_groups))
    if problem.recompute.enabled:
        recompute = problem.recompute
        table.add_row("recompute", f"{max(recompute.time_ms):.2f} ms at most, keeps "
                                   f"{format_size(max(recompute.resident))} at most between F and the recompute")
    console.print(table)
    return 0
