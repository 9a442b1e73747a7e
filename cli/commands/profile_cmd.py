"""optpipe profile: measure a model's stages on this machine and write a problem file.

The runtime (and so torch) is imported only when the command runs, so ``optpipe --help`` and
every other command stay free of torch.
"""

from __future__ import annotations

from rich.table import Table

from optpipe.core.errors import OptpipeError
from optpipe.core.files import write_atomic
from optpipe.core.problem import MAX_DEVICES, MAX_MICROBATCHES, MAX_STAGES, Placement
from optpipe.core.problem_file import dumps_problem
from optpipe.core.units import format_bandwidth, format_size
from optpipe.runtime.workload import WorkloadRequest, load_workload
from optpipe.cli.commands.common import console, float_in, int_in, markup_safe, output_path, size_option


def add_parser(sub) -> None:
    parser = sub.add_parser("profile", help="measure F, B, W times and activation sizes of a model; write a problem")
    parser.add_argument("--model", default="tiny", metavar="MODEL",
                        help="tiny, small (the built-in GPT), or package.module:factory returning an "
                             "optpipe.runtime.workload.Workload (default tiny)")
    parser.add_argument("--devices", type=int_in(1, MAX_DEVICES), required=True, metavar="P", help="pipeline ranks")
    parser.add_argument("--chunks", type=int_in(1, MAX_STAGES), default=1, metavar="V",
                        help="stages per rank (default 1)")
    parser.add_argument("--microbatches", type=int_in(1, MAX_MICROBATCHES), required=True, metavar="M")
    parser.add_argument("--placement", default=None, choices=[p.value for p in Placement],
                        help="stage placement (default interleaved; vshape needs --chunks 2)")
    parser.add_argument("--budget", metavar="SIZE", type=size_option("--budget"),
                        help="memory.budget (default: room for every microbatch's activation)")
    parser.add_argument("--offload", action="store_true", help="measure the host link and enable [offload]")
    parser.add_argument("--p2p", type=float_in(0.0, 1e9, what="number of milliseconds"), default=None, metavar="MS",
                        help="p2p time in ms instead of measuring it between two local processes")
    parser.add_argument("--micro-batch-size", type=int_in(1, 1024), default=None,
                        help="sequences per microbatch (1..1024)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--threads", type=int_in(1, 1024), default=None,
                        help="torch threads while measuring (default: 1 on a CPU, as torchrun gives each rank)")
    parser.add_argument("--repeats", type=int_in(1, 1000), default=5,
                        help="timed runs per stage; the median is kept (default 5)")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    parser.add_argument("--name", default=None, help="problem name (default: from the model and shape)")
    parser.add_argument("-o", "--output", required=True, metavar="PROBLEM.toml", type=output_path("-o"),
                        help="where to write the problem")
    parser.set_defaults(run=run)


def run(args) -> int:
    if args.devices * args.chunks > MAX_STAGES:
        raise OptpipeError(f"--devices x --chunks: {args.devices * args.chunks:,} stages, more than {MAX_STAGES:,}, "
                           f"the most a plan file can hold; use fewer")
    if args.name is not None and (not args.name or len(args.name) > 200 or not args.name.isprintable()):
        raise OptpipeError(f"--name: expected a short printable name, got {markup_safe(repr(args.name[:40]))}")
    placement = Placement(args.placement) if args.placement else Placement.INTERLEAVED
    budget = args.budget

    # Imported when profile runs: each loads torch, which --help and the other commands must not.
    import torch
    from optpipe.runtime.device import DTYPES, select_device
    from optpipe.runtime.profile import profile_problem

    device = select_device(args.device, 0)
    threads = args.threads or (1 if device.type == "cpu" else torch.get_num_threads())
    if threads < 1:
        raise OptpipeError(f"--threads: expected a positive integer, got {threads}")
    torch.set_num_threads(threads)
    stages = args.devices * args.chunks
    workload = load_workload(args.model, WorkloadRequest(stages, args.microbatches, args.seed, args.micro_batch_size))
    label = workload.name if ":" not in args.model else args.model.rsplit(":", 1)[0].rsplit(".", 1)[-1]
    name = args.name or f"{label}-p{args.devices}-v{args.chunks}-m{args.microbatches}"
    with console.status(f"profiling {stages} stages of the {args.model} model on {device}"):
        problem = profile_problem(workload, devices=args.devices, chunks=args.chunks, microbatches=args.microbatches,
                                  placement=placement, budget=budget, offload=args.offload, p2p_ms=args.p2p,
                                  device=device, dtype=DTYPES[args.dtype], seed=args.seed, repeats=args.repeats,
                                  name=name)
    write_atomic(args.output, dumps_problem(problem), "problem file")
    console.print(_table(problem, device))
    console.print(f"wrote {markup_safe(args.output)}")
    return 0


def _table(problem, device) -> Table:
    table = Table(title=f"{markup_safe(problem.name)}: measured on {device}")
    for column in ("stage", "F ms", "B ms", "W ms", "activation", "kept for W"):
        table.add_column(column, justify="right")
    costs, memory = problem.costs, problem.memory
    for s in range(problem.stages):
        table.add_row(str(s), f"{costs.forward[s]:.3f}", f"{costs.backward_input[s]:.3f}",
                      f"{costs.backward_weight[s]:.3f}", format_size(memory.activation[s]),
                      format_size(memory.weight_activation[s]))
    caption = f"p2p {costs.p2p:.3f} ms"
    if problem.offload.enabled:
        caption += (f"; host link {format_bandwidth(problem.offload.d2h_bandwidth)} D2H, "
                    f"{format_bandwidth(problem.offload.h2d_bandwidth)} H2D")
    table.caption = caption
    return table
