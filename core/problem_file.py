"""The problem file: TOML text in, a ``Problem`` out, and back.

``load_problem`` reads the format the README describes and ``dump_problem`` writes one that
loads to an equal object. Every value error names the key it came from and what would be
accepted. ``[model]`` + ``[hardware]`` go to ``costmodel``, which derives the costs.
``default_problem()`` is the built-in 8-device GPT problem (``data/default.toml``).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from optpipe.core.costmodel import derive, recompute_figures
from optpipe.core.errors import BudgetTooSmall, ProblemError
from optpipe.core.errors import shown as _shown
from optpipe.core.files import read_text, write_atomic
from optpipe.core.problem import (MAX_DEVICES, MAX_MICROBATCHES, MAX_MILLISECONDS, MAX_NAME, MAX_STAGES,
                                  MIN_MILLISECONDS, Costs, Memory, Offload, Pipeline, Placement, Problem, Recompute)
from optpipe.core.tables import check_keys, enabled, table_of
from optpipe.core.units import format_bandwidth, format_size, parse_bandwidth, parse_size

__all__ = ["load_problem", "loads_problem", "problem_from_dict", "dump_problem", "dumps_problem",
           "DEFAULT_PROBLEM", "default_problem"]

DEFAULT_PROBLEM = Path(__file__).resolve().parent / "data" / "default.toml"


def default_problem() -> Problem:
    """The problem commands use when none is named: a 7B-parameter GPT on 8 H100s."""
    return loads_problem(DEFAULT_PROBLEM.read_text(), default_name="default")


# --------------------------------------------------------------------------- reading

_TOP_KEYS = {"name", "pipeline", "costs", "memory", "offload", "model", "hardware", "recompute"}
_PIPELINE_KEYS = {"devices", "chunks_per_device", "placement", "microbatches"}
_COST_KEYS = {"forward", "backward_input", "backward_weight", "p2p"}
_MEMORY_KEYS = {"activation", "weight_activation", "budget"}
_RECOMPUTE_KEYS = {"enabled", "mode", "time", "time_ms", "resident", "selective_time", "selective_memory"}
_OFFLOAD_KEYS = {"enabled", "d2h_bandwidth", "h2d_bandwidth", "host_budget", "link_groups"}


def _positive_int(table: dict, key: str, where: str, default: int | None = None, limit: int | None = None,
                  why: str = "") -> int:
    value = table.get(key, default)
    if value is None:
        raise ProblemError(f"{where}.{key}: missing; expected a positive integer")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProblemError(f"{where}.{key}: expected a positive integer, got {_shown(value)}")
    if value <= 0:
        raise ProblemError(f"{where}.{key}: must be greater than zero, got {_shown(value)}")
    if limit is not None and value > limit:
        raise ProblemError(f"{where}.{key}: {_shown(value)} is more than {limit:,}{why}; give at most {limit}")
    return value


def _milliseconds(value: Any, key: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProblemError(f"{key}: expected a number of milliseconds like 18.5, got {_shown(value)}")
    if isinstance(value, int) and abs(value) > MAX_MILLISECONDS:
        value = float("inf") if value > 0 else float("-inf")  # past the limit either way; float() would overflow
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "greater than zero"
        raise ProblemError(f"{key}: must be {bound} (milliseconds), got {_shown(value)}")
    if value > MAX_MILLISECONDS:
        raise ProblemError(f"{key}: {_shown(value)} ms is more than {MAX_MILLISECONDS:.0e} ms (eleven days) for one "
                           f"op; give a finite time in milliseconds such as 18.5")
    if not allow_zero and value < MIN_MILLISECONDS:
        raise ProblemError(f"{key}: {_shown(value)} ms is less than a nanosecond ({MIN_MILLISECONDS:g} ms), below what "
                           f"the simulator resolves; give the time in milliseconds, such as 18.5")
    return float(value)


def _per_stage(value: Any, key: str, stages: int, parse) -> tuple:
    """A scalar applies to every stage; a list gives one value per stage."""
    if isinstance(value, list):
        if len(value) != stages:
            raise ProblemError(
                f"{key}: the list has {len(value)} entries but the pipeline has {stages} stages "
                f"(devices x chunks_per_device); give one value per stage or a single scalar"
            )
        return tuple(parse(item, f"{key}[{index}]") for index, item in enumerate(value))
    return (parse(value, key),) * stages


def _pipeline(data: dict) -> Pipeline:
    table = table_of(data, "pipeline", required=True)
    check_keys(table, _PIPELINE_KEYS, "pipeline")
    plan = ", the most a plan file can hold"
    devices = _positive_int(table, "devices", "pipeline", limit=MAX_DEVICES, why=plan)
    chunks = _positive_int(table, "chunks_per_device", "pipeline", default=1, limit=MAX_STAGES, why=plan)
    microbatches = _positive_int(table, "microbatches", "pipeline", limit=MAX_MICROBATCHES, why=plan)
    if devices * chunks > MAX_STAGES:
        raise ProblemError(f"pipeline: {devices} devices x {chunks} chunks_per_device = {devices * chunks:,} stages, "
                           f"more than {MAX_STAGES:,}{plan}; use fewer devices or chunks")
    raw = table.get("placement", "interleaved")
    try:
        placement = Placement(raw)
    except ValueError:
        options = ", ".join(f'"{p.value}"' for p in Placement)
        raise ProblemError(f"pipeline.placement: expected one of {options}, got {_shown(raw)}") from None
    if placement is Placement.VSHAPE and chunks != 2:
        raise ProblemError(
            f'pipeline.placement: "vshape" needs chunks_per_device = 2, got {chunks}; '
            f'set chunks_per_device = 2 or use placement = "interleaved"'
        )
    return Pipeline(devices, chunks, placement, microbatches)


def _costs(table: dict, stages: int) -> Costs:
    check_keys(table, _COST_KEYS, "costs")
    for key in ("forward", "backward_input", "backward_weight"):
        if key not in table:
            raise ProblemError(f"costs.{key}: missing; expected milliseconds (a number or a list per stage)")
    return Costs(
        forward=_per_stage(table["forward"], "costs.forward", stages, _milliseconds),
        backward_input=_per_stage(table["backward_input"], "costs.backward_input", stages, _milliseconds),
        backward_weight=_per_stage(table["backward_weight"], "costs.backward_weight", stages, _milliseconds),
        p2p=_milliseconds(table.get("p2p", 0.0), "costs.p2p", allow_zero=True),
    )


def _memory(table: dict, stages: int, derived: Memory | None = None) -> Memory:
    check_keys(table, _MEMORY_KEYS, "memory")
    if derived is not None:
        for key in ("activation", "weight_activation"):
            if key in table:
                raise ProblemError(f"memory.{key}: [model] derives the activation sizes, so this key would be ignored; "
                                   f"remove it (only memory.budget may override the model), or give [costs] and "
                                   f"[memory] instead of [model] and [hardware]")
    if derived is None:
        for key in ("activation", "weight_activation", "budget"):
            if key not in table:
                raise ProblemError(f'memory.{key}: missing; expected a size like "1.2GiB"')
        activation = _per_stage(table["activation"], "memory.activation", stages, parse_size)
        weight_activation = _per_stage(table["weight_activation"], "memory.weight_activation", stages, parse_size)
        budget = parse_size(table["budget"], "memory.budget")
    else:
        activation, weight_activation = derived.activation, derived.weight_activation
        budget = parse_size(table["budget"], "memory.budget") if "budget" in table else derived.budget
    for stage, (act, keep) in enumerate(zip(activation, weight_activation)):
        if keep > act:
            raise ProblemError(
                f"memory.weight_activation: stage {stage} keeps {format_size(keep)} for W, more than its "
                f"activation {format_size(act)}; weight_activation is the part of activation still needed after B"
            )
    return Memory(activation, weight_activation, budget)


def _link_groups(value: Any, devices: int) -> tuple[tuple[int, ...], ...]:
    """``[[0, 1], [2, 3]]``: devices that share one host link; each device in at most one group."""
    key = "offload.link_groups"
    if not isinstance(value, list) or not all(isinstance(group, list) for group in value):
        raise ProblemError(f"{key}: expected a list of lists of device numbers like [[0, 1], [2, 3]], got {_shown(value)}")
    seen: dict[int, int] = {}
    groups = []
    for number, group in enumerate(value):
        if len(group) < 2:
            raise ProblemError(f"{key}[{number}]: a group shares one link between at least two devices, "
                               f"got {_shown(group)}; leave a device with a link of its own out of every group")
        for device in group:
            if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < devices:
                raise ProblemError(f"{key}[{number}]: {_shown(device)} is not a device; devices run 0..{devices - 1}")
            if device in seen:
                raise ProblemError(f"{key}[{number}]: device {device} is already in group {seen[device]}; "
                                   f"a device is in at most one link group")
            seen[device] = number
        groups.append(tuple(sorted(group)))
    return tuple(groups)


def _offload(data: dict, devices: int | None = None) -> Offload:
    table = table_of(data, "offload", required=False)
    check_keys(table, _OFFLOAD_KEYS, "offload")
    if not enabled(table, "offload"):
        if table.get("link_groups"):
            raise ProblemError("offload.link_groups: shared host links only matter for transfers, but offload "
                               "is not enabled; set offload.enabled = true with bandwidths, or drop link_groups")
        return Offload()
    for key in ("d2h_bandwidth", "h2d_bandwidth"):
        if key not in table:
            raise ProblemError(
                f'offload.{key}: missing; offload is enabled, so give the host link\'s bandwidth like "24GB/s" '
                f"(or set offload.enabled = false)"
            )
    return Offload(
        enabled=True,
        d2h_bandwidth=parse_bandwidth(table["d2h_bandwidth"], "offload.d2h_bandwidth"),
        h2d_bandwidth=parse_bandwidth(table["h2d_bandwidth"], "offload.h2d_bandwidth"),
        host_budget=parse_size(table.get("host_budget", "1TiB"), "offload.host_budget"),
        link_groups=_link_groups(table["link_groups"], devices if devices is not None else 1 << 30)
        if "link_groups" in table else (),
    )


# A recompute re-runs (part of) the forward; ten forwards' time is already far beyond any real one.
_MAX_RECOMPUTE_SHARE = 10.0


def _fraction(value: Any, key: str, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= upper:
        raise ProblemError(f"{key}: expected a fraction from 0 to {upper:g}, got {_shown(value)}")
    return float(value)


def _recompute(data: dict, costs: Costs, memory: Memory, derived=None) -> Recompute:
    """``[recompute]``: the cost of re-running a stage's forward before its backward.

    ``time`` is a fraction of F (default 1: the whole forward again) and ``time_ms`` gives
    milliseconds instead; ``resident`` is what stays on the device between F and the recompute
    (the stage input; a size, or a list per stage). ``mode = "selective"`` recomputes only the
    cheap part: ``selective_time`` of F, freeing ``selective_memory`` of the activation (and keeping
    the rest). For ``[model]`` problems the cost model supplies what is not given: the stage input
    (2·s·b·h) and the attention core's share of F and of the activation (costmodel.py).
    """
    table = table_of(data, "recompute", required=False)
    check_keys(table, _RECOMPUTE_KEYS, "recompute")
    if not enabled(table, "recompute"):
        return Recompute()
    stages = len(costs.forward)
    mode = table.get("mode", "full")
    if mode not in ("full", "selective"):
        raise ProblemError(f'recompute.mode: expected "full" or "selective", got {_shown(mode)}')
    resident = (_per_stage(table["resident"], "recompute.resident", stages, parse_size)
                if "resident" in table else (derived.stage_input if derived is not None else (0,) * stages))
    for stage, (kept, act) in enumerate(zip(resident, memory.activation)):
        if kept > act:
            raise ProblemError(f"recompute.resident: stage {stage} keeps {format_size(kept)} between F and the "
                               f"recompute, more than its activation {format_size(act)}")
    if mode == "selective":
        for key in ("time", "time_ms"):
            if key in table:
                raise ProblemError(f'recompute.{key}: selective mode takes selective_time (a fraction of F) '
                                   f'instead; drop {key} or set mode = "full"')
        if derived is None and ("selective_time" not in table or "selective_memory" not in table):
            raise ProblemError('recompute.selective_time and recompute.selective_memory: selective mode needs both '
                               '(the fraction of F it re-runs and the fraction of the activation it frees)')
        shares = ((_fraction(table["selective_time"], "recompute.selective_time", 1.0),) * stages
                  if "selective_time" in table else derived.selective_time)
        freed = ((_fraction(table["selective_memory"], "recompute.selective_memory", 1.0),) * stages
                 if "selective_memory" in table else derived.selective_memory)
        time_ms = tuple(share * f for share, f in zip(shares, costs.forward))
        resident = tuple(act - int(share * act) for share, act in zip(freed, memory.activation))
    else:
        for key in ("selective_time", "selective_memory"):
            if key in table:
                raise ProblemError(f'recompute.{key}: only for mode = "selective"')
        if "time" in table and "time_ms" in table:
            raise ProblemError("recompute.time and recompute.time_ms: give one (a fraction of F, or milliseconds)")
        if "time_ms" in table:
            time_ms = _per_stage(table["time_ms"], "recompute.time_ms", stages, _milliseconds)
        else:
            share = _fraction(table.get("time", 1.0), "recompute.time", _MAX_RECOMPUTE_SHARE)
            time_ms = tuple(share * f for f in costs.forward)
    return Recompute(True, tuple(time_ms), tuple(resident))


def problem_from_dict(data: dict, default_name: str = "problem") -> Problem:
    """Build a Problem from the parsed TOML tables."""
    check_keys(data, _TOP_KEYS, "")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ProblemError(f"name: expected a non-empty string, got {_shown(name)}")
    if len(name) > MAX_NAME:
        raise ProblemError(f"name: {len(name):,} characters, more than {MAX_NAME}; give a short name")
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        raise ProblemError(f"name: contains the control character {bad!r}; use printable text, e.g. {'zb-1.5b-p8'!r}")
    pipeline = _pipeline(data)
    model, hardware = data.get("model"), data.get("hardware")
    if model is not None or hardware is not None:
        if model is None or hardware is None:
            missing = "model" if model is None else "hardware"
            raise ProblemError(f"[{missing}]: missing; [model] and [hardware] derive the costs together")
        if "costs" in data:
            raise ProblemError("[costs]: give either [costs] or [model] + [hardware], not both")
        costs, derived_memory, link = derive(table_of(data, "model", True), table_of(data, "hardware", True), pipeline)
        memory = _memory(table_of(data, "memory", required=False), pipeline.stages, derived_memory)
        offload_table = dict(table_of(data, "offload", required=False))
        if offload_table.get("enabled", bool(offload_table)):
            offload_table.setdefault("d2h_bandwidth", link)
            offload_table.setdefault("h2d_bandwidth", link)
        offload = _offload({"offload": offload_table} if offload_table else {}, pipeline.devices)
        recompute = _recompute(data, costs, memory, recompute_figures(table_of(data, "model", True), pipeline))
    else:
        costs = _costs(table_of(data, "costs", required=True), pipeline.stages)
        memory = _memory(table_of(data, "memory", required=True), pipeline.stages)
        offload = _offload(data, pipeline.devices)
        recompute = _recompute(data, costs, memory)
    largest = max(memory.activation)
    if memory.budget < largest:
        raise BudgetTooSmall(
            f"memory.budget: {format_size(memory.budget)} is below one stage's activation "
            f"({format_size(largest)}), so not even one microbatch can run; raise the budget to at least "
            f"{format_size(largest)}"
        )
    return Problem(name, pipeline, costs, memory, offload, recompute)


def loads_problem(text: str, default_name: str = "problem") -> Problem:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ProblemError(f"not valid TOML: {error}") from None
    except RecursionError:
        raise ProblemError("not a problem file: its arrays or tables nest too deeply to read") from None
    except ValueError as error:  # an integer of more than 4,300 digits
        raise ProblemError(f"not a problem file: {str(error).split(';')[0]}") from None
    return problem_from_dict(data, default_name)


def load_problem(path: str | Path) -> Problem:
    path = Path(path)
    text = read_text(path, "problem file", ProblemError, limit=64 << 20)
    try:
        return loads_problem(text, default_name=path.stem)
    except ProblemError as error:
        raise type(error)(f"{path}: {error}") from None


# --------------------------------------------------------------------------- writing


def _scalar_or_list(values: tuple) -> str:
    if all(v == values[0] for v in values):
        return _number(values[0])
    return "[" + ", ".join(_number(v) for v in values) + "]"


def _number(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def dumps_problem(problem: Problem) -> str:
    """TOML text that loads back to an equal Problem (sizes are written in exact bytes)."""
    pipe, costs, memory, offload = problem.pipeline, problem.costs, problem.memory, problem.offload
    lines = [
        f"name = {_quote(problem.name)}",
        "",
        "[pipeline]",
        f"devices = {pipe.devices}",
        f"chunks_per_device = {pipe.chunks_per_device}",
        f'placement = "{pipe.placement.value}"',
        f"microbatches = {pipe.microbatches}",
        "",
        "[costs]  # milliseconds",
        f"forward = {_scalar_or_list(costs.forward)}",
        f"backward_input = {_scalar_or_list(costs.backward_input)}",
        f"backward_weight = {_scalar_or_list(costs.backward_weight)}",
        f"p2p = {_number(costs.p2p)}",
        "",
        "[memory]  # bytes",
        f"activation = {_scalar_or_list(memory.activation)}  # {format_size(max(memory.activation))} max",
        f"weight_activation = {_scalar_or_list(memory.weight_activation)}",
        f"budget = {memory.budget}  # {format_size(memory.budget)}",
    ]
    if offload.enabled:
        lines += [
            "",
            "[offload]  # bytes per second, bytes",
            "enabled = true",
            f"d2h_bandwidth = {_number(offload.d2h_bandwidth)}  # {format_bandwidth(offload.d2h_bandwidth)}",
            f"h2d_bandwidth = {_number(offload.h2d_bandwidth)}  # {format_bandwidth(offload.h2d_bandwidth)}",
            f"host_budget = {offload.host_budget}  # {format_size(offload.host_budget)}",
        ]
        if offload.link_groups:
            groups = ", ".join("[" + ", ".join(str(d) for d in group) + "]" for group in offload.link_groups)
            lines.append(f"link_groups = [{groups}]  # devices that share one host link")
    recompute = problem.recompute
    if recompute.enabled:
        lines += [
            "",
            "[recompute]  # milliseconds, bytes",
            "enabled = true",
            f"time_ms = {_scalar_or_list(recompute.time_ms)}",
            f"resident = {_scalar_or_list(recompute.resident)}",
        ]
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def dump_problem(problem: Problem, path: str | Path) -> None:
    write_atomic(path, dumps_problem(problem), "problem file")
