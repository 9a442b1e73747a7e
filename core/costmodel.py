"""Derive per-stage costs and memory from a GPT-like model and a device.

Formulas (fp16/bf16 training, no recomputation; Korthikanti et al. 2022 for activations, the
Zero Bubble paper, arXiv 2401.10241 section 2, for the F:B:W split):

- per transformer layer, with s = seq_len, b = micro_batch_size, h = hidden, a = heads:
  forward FLOPs 24·b·s·h² (matmuls) + 4·b·s²·h (attention scores and values);
  backward-input repeats the matmuls (24·b·s·h²) and doubles the attention part (8·b·s²·h);
  backward-weight is the matmuls' weight gradients only (24·b·s·h²).
  Saved activation s·b·(34h + 5·a·s) bytes, of which 32·s·b·h are inputs to weight matmuls and
  stay until W. With ``flash_attention = true`` the attention kernel recomputes its scores in
  the backward, so the 5·a·s term (scores, softmax, dropout mask) is not saved.
- the embedding (first stage) saves nothing worth counting and costs ~nothing; the output layer
  (last stage) costs 2·b·s·h·V FLOPs for each of F, B and W, saves its input (2·s·b·h bytes, kept
  for W) and the fp32 logits for the loss (4·s·b·V bytes).
- time = FLOPs / (peak TFLOPS · MFU); p2p = one activation (2·s·b·h bytes) over the p2p link.
- budget = device memory − 16 bytes per parameter on the busiest device (fp16 weights and
  gradients, fp32 master weights and two Adam moments) − a fixed reserve for workspace.

Layers are split evenly over stages (the first stages take one more when it does not divide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optpipe.core.errors import ProblemError, shown
from optpipe.core.problem import MAX_MILLISECONDS, Costs, Memory, Pipeline
from optpipe.core.tables import check_keys
from optpipe.core.units import MAX_SIZE, format_size, parse_bandwidth, parse_size

__all__ = ["ModelSpec", "HardwareSpec", "HARDWARE_PRESETS", "derive", "layers_per_stage", "stage_figures"]


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch_size: int
    vocab: int
    flash_attention: bool = False


@dataclass(frozen=True)
class HardwareSpec:
    tflops: float  # dense fp16/bf16 peak
    memory: int  # bytes per device
    pcie_bandwidth: float  # bytes/s, host link each way
    p2p_bandwidth: float  # bytes/s between pipeline neighbours
    mfu: float  # model FLOPs utilisation assumed
    reserve: int  # bytes kept back for workspace and fragmentation


HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "A100-80GB": HardwareSpec(312.0, 80 * 2**30, 25e9, 25e9, 0.45, 4 * 2**30),
    "H100-80GB": HardwareSpec(989.0, 80 * 2**30, 50e9, 50e9, 0.40, 4 * 2**30),
    "H200-141GB": HardwareSpec(989.0, 141 * 10**9, 50e9, 50e9, 0.40, 4 * 2**30),
}

_MODEL_KEYS = {"layers", "hidden", "heads", "seq_len", "micro_batch_size", "vocab", "flash_attention"}
_HARDWARE_KEYS = {"preset", "tflops", "memory", "pcie_bandwidth", "p2p_bandwidth", "mfu", "reserve"}


# Far beyond any model trained today; past them a value is a typo, and the FLOP and byte counts
# would overflow into infinite times and sizes.
_MODEL_LIMITS = {"layers": 100_000, "hidden": 2**20, "heads": 2**16, "seq_len": 2**24, "micro_batch_size": 2**16,
                 "vocab": 2**24}
_HARDWARE_LIMITS = {"tflops": 1e6, "mfu": 1.0}  # a million TFLOPS per device; MFU is a fraction


def _int(table: dict, key: str) -> int:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProblemError(f"model.{key}: expected a positive integer, got {shown(value)}")
    if value > _MODEL_LIMITS[key]:
        raise ProblemError(f"model.{key}: {shown(value)} is more than {_MODEL_LIMITS[key]:,}; "
                           f"give the model's real size")
    return value


def _model(table: dict) -> ModelSpec:
    check_keys(table, _MODEL_KEYS, "model")
    flash = table.get("flash_attention", False)
    if not isinstance(flash, bool):
        raise ProblemError(f"model.flash_attention: expected true or false, got {shown(flash)}")
    sizes = (_int(table, key) for key in ("layers", "hidden", "heads", "seq_len", "micro_batch_size", "vocab"))
    spec = ModelSpec(*sizes, flash_attention=flash)
    if spec.hidden % spec.heads:
        raise ProblemError(f"model.heads: {spec.heads} does not divide model.hidden = {spec.hidden}")
    return spec


def _hardware(table: dict) -> HardwareSpec:
    check_keys(table, _HARDWARE_KEYS, "hardware")
    base = None
    if "preset" in table:
        base = HARDWARE_PRESETS.get(table["preset"]) if isinstance(table["preset"], str) else None
        if base is None:
            raise ProblemError(f"hardware.preset: unknown preset {shown(table['preset'])}; known presets: "
                               f"{', '.join(HARDWARE_PRESETS)} (or give tflops, memory and pcie_bandwidth)")
    def number(key: str, fallback):
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ProblemError(f"hardware.{key}: expected a positive number, got {shown(value)}")
            if isinstance(value, int) and value.bit_length() > 64:
                raise ProblemError(f"hardware.{key}: an integer of {value.bit_length()} bits is more than "
                                   f"{_HARDWARE_LIMITS[key]:g}; give a finite positive number")
            if not math.isfinite(value) or value <= 0:
                raise ProblemError(f"hardware.{key}: expected a finite number greater than zero, got {value!r}")
            if value > _HARDWARE_LIMITS[key]:
                raise ProblemError(f"hardware.{key}: {value!r} is more than {_HARDWARE_LIMITS[key]:g}"
                                   + ("; MFU is a fraction of peak, between 0 and 1" if key == "mfu" else
                                      "; give the device's dense fp16/bf16 TFLOPS, such as 989"))
            return float(value)
        if fallback is None:
            raise ProblemError(f"hardware.{key}: missing; give it or a preset ({', '.join(HARDWARE_PRESETS)})")
        return fallback

    tflops = number("tflops", base.tflops if base else None)
    mfu = number("mfu", base.mfu if base else 0.4)
    memory = parse_size(table["memory"], "hardware.memory") if "memory" in table else (base.memory if base else None)
    if memory is None:
        raise ProblemError(f'hardware.memory: missing; give it like "80GiB" or a preset ({", ".join(HARDWARE_PRESETS)})')
    pcie = (parse_bandwidth(table["pcie_bandwidth"], "hardware.pcie_bandwidth") if "pcie_bandwidth" in table
            else (base.pcie_bandwidth if base else None))
    if pcie is None:
        raise ProblemError('hardware.pcie_bandwidth: missing; give it like "25GB/s" or a preset')
    p2p = (parse_bandwidth(table["p2p_bandwidth"], "hardware.p2p_bandwidth") if "p2p_bandwidth" in table
           else (base.p2p_bandwidth if base else pcie))
    reserve = parse_size(table["reserve"], "hardware.reserve") if "reserve" in table else (base.reserve if base else 4 * 2**30)
    return HardwareSpec(tflops, memory, pcie, p2p, mfu, reserve)


def layers_per_stage(layers: int, stages: int) -> tuple[int, ...]:
    if layers < stages:
        raise ProblemError(f"model.layers: {layers} layers cannot fill {stages} stages; "
                           f"use at least one layer per stage (devices x chunks_per_device)")
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if s < extra else 0) for s in range(stages))


@dataclass(frozen=True)
class StageFigures:
    forward_flops: float
    backward_input_flops: float
    backward_weight_flops: float
    activation: int
    weight_activation: int
    parameters: int


def stage_figures(model: ModelSpec, stages: int) -> tuple[StageFigures, ...]:
    s, b, h, a, V = model.seq_len, model.micro_batch_size, model.hidden, model.heads, model.vocab
    out = []
    for stage, layers in enumerate(layers_per_stage(model.layers, stages)):
        matmul = 24 * b * s * h * h
        attention = 4 * b * s * s * h
        f = layers * (matmul + attention)
        bi = layers * (matmul + 2 * attention)
        bw = layers * matmul
        act = layers * s * b * (34 * h + (0 if model.flash_attention else 5 * a * s))
        keep = layers * 32 * s * b * h
        params = layers * (12 * h * h + 13 * h)
        if stage == 0:
            params += V * h + s * h  # token and position embeddings
        if stage == stages - 1:
            head = 2 * b * s * h * V
            f, bi, bw = f + head, bi + head, bw + head
            act += 2 * s * b * h + 4 * s * b * V
            keep += 2 * s * b * h
            params += 2 * h  # final layer norm; the output matrix is tied to the embedding
        out.append(StageFigures(f, bi, bw, act, keep, params))
    return tuple(out)


def derive(model_table: dict, hardware_table: dict, pipeline: Pipeline) -> tuple[Costs, Memory, float]:
    """Costs, memory (with a derived budget) and the host-link bandwidth for ``pipeline``."""
    model, hw = _model(model_table), _hardware(hardware_table)
    figures = stage_figures(model, pipeline.stages)
    rate = hw.tflops * 1e12 * hw.mfu / 1e3  # FLOPs per millisecond
    costs = Costs(
        forward=tuple(round(f.forward_flops / rate, 6) for f in figures),
        backward_input=tuple(round(f.backward_input_flops / rate, 6) for f in figures),
        backward_weight=tuple(round(f.backward_weight_flops / rate, 6) for f in figures),
        p2p=round(2 * model.seq_len * model.micro_batch_size * model.hidden / hw.p2p_bandwidth * 1e3, 6),
    )
    params_per_device = [sum(figures[s].parameters for s in pipeline.stages_on(d)) for d in range(pipeline.devices)]
    budget = hw.memory - 16 * max(params_per_device) - hw.reserve
    if budget <= 0:
        raise ProblemError(
            f"[hardware]: the model's weights, gradients and optimizer state ({16 * max(params_per_device) / 2**30:.1f}GiB "
            f"on the busiest device) leave no room for activations in {hw.memory / 2**30:.0f}GiB; "
            f"use more devices or a larger device"
        )
    memory = Memory(tuple(f.activation for f in figures), tuple(f.weight_activation for f in figures), budget)
    _check_derived(costs, memory)
    return costs, memory, hw.pcie_bandwidth


def _check_derived(costs: Costs, memory: Memory) -> None:
    """Derived numbers obey the same ranges as those written in [costs] and [memory]."""
    for key in ("forward", "backward_input", "backward_weight"):
        for stage, ms in enumerate(getattr(costs, key)):
            if not ms > 0:
                raise ProblemError(f"[model]: stage {stage}'s {key} time rounds to 0 ms on this hardware; "
                                   f"check hardware.tflops and hardware.mfu (or give [costs] directly)")
            if ms > MAX_MILLISECONDS:
                raise ProblemError(f"[model]: stage {stage}'s {key} time is {ms:.3g} ms, more than "
                                   f"{MAX_MILLISECONDS:.0e} ms; check the [model] sizes and hardware.tflops")
    largest = max(memory.activation)
    if largest > MAX_SIZE:
        raise ProblemError(f"[model]: one stage's activation would be {format_size(largest)}, more than 1EiB; "
                           f"check model.seq_len, micro_batch_size and hidden")


@dataclass(frozen=True)
class RecomputeFigures:
    """What recomputation costs and frees per stage (issue 14), from the per-layer terms."""

    stage_input: tuple[int, ...]  # bytes kept between F and a full recompute: 2·s·b·h
    selective_time: tuple[float, ...]  # share of F that selective recompute re-runs: the attention core
    selective_memory: tuple[float, ...]  # share of the activation it frees: the 5·a·s² per layer


def recompute_figures(model_table: dict, pipeline: Pipeline) -> RecomputeFigures:
    """Megatron-style selective recomputation re-runs the attention core (4·b·s²·h FLOPs a layer)
    and frees its scores and softmax (5·a·s²·b bytes a layer; nothing with flash attention,
    which recomputes them already)."""
    model = _model(model_table)
    figures = stage_figures(model, pipeline.stages)
    s, b, h, a = model.seq_len, model.micro_batch_size, model.hidden, model.heads
    inputs, times, frees = [], [], []
    for layers, f in zip(layers_per_stage(model.layers, pipeline.stages), figures):
        inputs.append(min(2 * s * b * h, f.activation))
        times.append(layers * 4 * b * s * s * h / f.forward_flops)
        freed = 0 if model.flash_attention else layers * 5 * a * s * s * b
        frees.append(freed / f.activation)
    return RecomputeFigures(tuple(inputs), tuple(times), tuple(frees))
