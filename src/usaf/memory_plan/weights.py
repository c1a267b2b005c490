"""Bytes of what the engine holds between steps: weights, deltas, routers, optimizer state.

Each function mirrors one structure of the engine, so ``SparseEngine.memory()`` can check it exactly
(``tests/test_memory_plan.py``): 4-bit codes + fp16 scale and zero per group (``QuantizedTensor``), the
resident dequantized base (``ExpertWeight.make_resident``), a sparse delta's fp32 values and its four
int64 index buffers + offsets (``SparseDelta``), ``SparseAdamW``'s state, the score pools of ``usaf
score`` and of RigL's grow step (``ScoreAccumulator``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from usaf.memory_plan.model import ModelFacts
from usaf.memory_plan.source import QuantSettings

FP16 = 2
FP32 = 4
INT64 = 8
# SparseDelta: fp32 value + int64 flat index, expert, row and column per entry (offsets counted apart).
DELTA_BYTES_PER_ENTRY = FP32 + 4 * INT64
# SparseAdamW: fp32 exp_avg + fp32 exp_avg_sq + int32 per-element step count (its state_bytes()).
OPTIMIZER_BYTES_PER_PARAM = 12
# ScoreAccumulator: a pool of pool_factor x candidates (int64 index + fp32 score), plus per expert an
# int64 count and two fp32 halves of the error bound. Between its cuts the pool may hold up to
# (1 + POOL_OVERFLOW) x that many entries (usaf.engine.scores.OVERFLOW).
POOL_BYTES_PER_CANDIDATE = INT64 + FP32
POOL_BYTES_PER_EXPERT = INT64 + 2 * FP32
POOL_FACTOR = 4  # usaf score's --candidates-factor default and collect_scores' pool_factor
POOL_OVERFLOW = 0.5  # usaf.engine.scores.OVERFLOW (tests/test_memory_plan.py checks they agree)
CALIB_SAMPLES = 64  # usaf score's --calib-samples default (tests/test_memory_plan.py checks they agree)
# A frozen layer's forward dequantizes its routed experts in blocks whose fp32 size (gate_up + down) stays
# under these (usaf.engine.grouped.HOST_BLOCK_BYTES / DEVICE_BLOCK_BYTES; tests/test_memory_plan.py checks).
FROZEN_BLOCK_BYTES_HOST = 8 * 2**20
FROZEN_BLOCK_BYTES_DEVICE = 64 * 2**20
# The share of the free memory dequantized experts may take: score's and train's frozen layers, all of usaf eval's
# (usaf.stages.engine_setup.make_resident); the rest is for activations and the loss.
RESIDENT_SHARE = 0.5
DEFAULT_TOP_FRACTION = 0.25  # usaf score's default trainable block (stages.score.DEFAULT_TOP_FRACTION)


MOE_LAYER_LINEAR_TARGETS = ("attention", "shared")  # a dense layer's MLP (the dense target) is in dense layers only


def quantized_bytes(shape: tuple[int, int, int], nbits: int, group_size: int) -> int:
    """codes ``(E, O, packed I)`` uint8 + scale and zero ``(E, O, I / group)`` fp16."""
    # lazy: usaf.quant imports torch; `usaf plan` (and `usaf --help`) stay free of it
    from usaf.quant import effective_group_size, packed_width

    e, o, i = shape
    group = effective_group_size(i, group_size)
    return e * o * packed_width(i, nbits) + 2 * FP16 * e * o * (i // group)


def layer_quantized_bytes(m: ModelFacts, layer: int, quant: QuantSettings) -> int:
    """One MoE layer's two expert tensors, at the group sizes the quantized model records (if known)."""
    s = m.spec
    total = 0
    for name, shape in ((s.gate_up_name(layer), m.gate_up_shape), (s.down_name(layer), m.down_shape)):
        total += quantized_bytes(shape, quant.nbits, quant.effective.get(name, quant.group_size))
    return total


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def delta_entries(shape: tuple[int, int, int], frac: float) -> int:
    """Entries a per-tensor budget gives one tensor (``usaf.engine.engine.budget``)."""
    return max(1, math.floor(frac * numel(shape)))


def target_shapes(m: ModelFacts, targets: Iterable[str] = ("experts",)) -> list[tuple[int, int, int]]:
    """One MoE layer's trainable tensors as ``(E, O, I)``: the fused experts, each linear target ``(1, O, I)``."""
    targets = tuple(targets)
    shapes = [m.gate_up_shape, m.down_shape] if "experts" in targets else []
    for kind in (k for k in targets if k in MOE_LAYER_LINEAR_TARGETS):
        shapes += [(1, o, i) for o, i in m.linear_targets.get(kind, ())]
    return shapes


def dense_layer_shapes(m: ModelFacts, targets: Iterable[str]) -> list[tuple[int, int, int]]:
    """One trainable dense layer's tensors (``--targets dense``): its MLP's linears, and its attention's when asked."""
    kinds = [k for k in ("attention", "dense") if k in tuple(targets)]
    return [(1, o, i) for kind in kinds for o, i in m.linear_targets.get(kind, ())]


def trained_shapes(m: ModelFacts, layers: Iterable[int], targets: Iterable[str]) -> list[tuple[int, int, int]]:
    """Every trainable tensor of ``layers`` (MoE and dense) as ``(E, O, I)``."""
    targets = tuple(targets)
    moe = set(m.spec.moe_layers)
    per_moe, per_dense = target_shapes(m, targets), dense_layer_shapes(m, targets)
    return [shape for layer in layers for shape in (per_moe if layer in moe else per_dense)]


def shapes_delta_entries(shapes: Iterable[tuple[int, int, int]], frac: float) -> int:
    return sum(delta_entries(shape, frac) for shape in shapes)


def shapes_delta_bytes(shapes: Iterable[tuple[int, int, int]], frac: float) -> int:
    """Values, index buffers and the ``(E + 1)`` int64 offsets of the tensors ``shapes``."""
    shapes = list(shapes)
    return shapes_delta_entries(shapes, frac) * DELTA_BYTES_PER_ENTRY + sum(e + 1 for e, _, _ in shapes) * INT64


def shapes_pool_bytes(shapes: Iterable[tuple[int, int, int]], frac: float) -> int:
    """Score pools of the tensors ``shapes`` at their fullest: ``(1 + POOL_OVERFLOW) x POOL_FACTOR x`` their budget."""
    shapes = list(shapes)
    candidates = math.ceil(shapes_delta_entries(shapes, frac) * POOL_FACTOR * (1 + POOL_OVERFLOW))
    return candidates * POOL_BYTES_PER_CANDIDATE + sum(e for e, _, _ in shapes) * POOL_BYTES_PER_EXPERT


def layer_delta_entries(m: ModelFacts, frac: float, targets: Iterable[str] = ("experts",)) -> int:
    return shapes_delta_entries(target_shapes(m, targets), frac)


def delta_bytes(m: ModelFacts, layers: int, frac: float, targets: Iterable[str] = ("experts",)) -> int:
    """Values, index buffers and the ``(E + 1)`` int64 offsets of every trainable tensor of ``layers`` MoE layers."""
    return shapes_delta_bytes(layers * target_shapes(m, targets), frac)


def pool_bytes(m: ModelFacts, layers: int, frac: float, targets: Iterable[str] = ("experts",)) -> int:
    """Score pools of every trainable tensor of ``layers`` MoE layers at their fullest."""
    return shapes_pool_bytes(layers * target_shapes(m, targets), frac)


def router_params(m: ModelFacts, layers: Iterable[int]) -> int:
    return sum(m.router_numel[layer] for layer in layers)


def other_weight_bytes(m: ModelFacts, trainable: Iterable[int], c: int) -> int:
    """Every non-expert tensor in the compute dtype, except the trainable routers (fp32 masters, apart).

    Routers a family keeps in fp32 (DeepSeek-V3) stay fp32 when frozen.
    """
    trainable = set(trainable)
    frozen_routers = sum(n for layer, n in m.router_numel.items() if layer not in trainable)
    router_bytes = FP32 if m.spec.router.fp32 else c
    rest = m.global_numel + sum(m.layer_numel.values())
    return rest * c + frozen_routers * router_bytes


def resident_bytes(m: ModelFacts, layers: int, c: int) -> int:
    """Dequantized bases of the trainable layers, ``(E, O, I)`` in the compute dtype."""
    return layers * m.expert_params_per_layer * c


def frozen_layer_count(m: ModelFacts, train_from: int) -> int:
    """The MoE layers below the first trainable one: the frozen layers a prefix capture runs."""
    return sum(1 for layer in m.spec.moe_layers if layer < train_from)


def default_layer_count(m: ModelFacts) -> int:
    """``usaf score``'s default: the top quarter of the MoE layers (at least one)."""
    return max(1, math.ceil(DEFAULT_TOP_FRACTION * len(m.spec.moe_layers)))


def frozen_block_bytes(m: ModelFacts, c: int, separate_device: bool) -> tuple[int, int]:
    """``(experts, bytes)`` of one block of a frozen layer's grouped forward at its largest.

    The block's experts are counted by both tensors' fp32 size; one tensor is held at a time (each is dequantized
    right before its GEMM and dropped after: ``usaf.engine.grouped``), in the compute dtype (``c`` bytes an
    element) plus its fp32 dequantization transient while it is made (``ExpertWeight.block``).
    """
    (e, o1, i1), (_, o2, i2) = m.gate_up_shape, m.down_shape
    per_expert = o1 * i1 + o2 * i2  # elements of both tensors
    budget = FROZEN_BLOCK_BYTES_DEVICE if separate_device else FROZEN_BLOCK_BYTES_HOST
    experts = max(1, min(e, budget // (FP32 * per_expert)))
    return experts, experts * max(o1 * i1, o2 * i2) * (c + FP32)
