"""Peak memory of each stage, component by component, for one choice of settings.

A stage's peak is the sum of its components: what it holds for the whole run (weights, deltas,
optimizer state) plus what exists at its busiest moment (one microbatch's saved activations and the
loss's working memory, near the end of a training forward). Each component says where it lives: on the
device, or in host memory; on a CPU target everything is host memory.

Placements (where the 4-bit experts of every layer live; everything else is the same):

* ``device``: all on the device (``--no-stream-experts``).
* ``stream``: all in pinned host memory; a layer's experts are copied to a two-layer device buffer when a
  forward reaches it (one in use, one in flight). Training steps that read their prefix from the cache
  never run the frozen layers, so only prefix capture and score/eval forwards stream
  (``usaf.engine.streaming``, ``--stream-experts``).
* ``host``: a CPU target, where device and host memory are one.
"""

from __future__ import annotations

from dataclasses import dataclass

from usaf.memory_plan import activations as act
from usaf.memory_plan import weights as w
from usaf.memory_plan.model import ModelFacts
from usaf.memory_plan.source import QuantSettings
from usaf.memory_plan.target import Target
from usaf.settings.eval import EvalConfig
from usaf.settings.train import company_size

PLACEMENTS = {
    "device": "every 4-bit expert on the device",
    "stream": "4-bit experts in pinned host memory, frozen layers' streamed per layer into a 2-layer device buffer "
    "(--stream-experts)",
    "host": "everything in RAM (CPU)",
}
STREAM_BUFFER_LAYERS = 2
EVAL_MICROBATCH = EvalConfig.model_fields["microbatch"].default  # the plan's eval command leaves it at its default
# usaf quantize holds one MoE layer's source experts several times over at its peak: the per-expert tensors
# read from disk, the stacked gate and up halves and the fused gate_up (about 2.3 copies by construction,
# families/convert.py), plus slices and allocator slack. Measured above the command's fixed cost: 3.6-3.9 layers
# of a bf16 source (docs/BENCHMARKS.md, "Peak RSS versus layer count"), 2.8 of an fp32 one (bench_plan.py).
QUANTIZE_LAYER_COPIES = {2: 4, 4: 3}  # bytes per source weight -> copies of the layer
# hqq's solver on one fp32 expert slice keeps a handful of slice-sized temporaries (assumed, not measured).
QUANTIZE_SLICE_COPIES = 8


@dataclass(frozen=True)
class Settings:
    """One candidate: which layers train, how big a microbatch, where the experts live, the prefix cache."""

    layers: tuple[int, ...]  # trainable MoE layers (a top block: every MoE layer from the first up)
    microbatch: int
    grad_accum: int
    seq_len: int
    frac: float
    placement: str
    targets: tuple[str, ...] = ("experts",)  # --targets: the weights that carry deltas
    prefix_ram: int = 0  # bytes of cached prefix states kept in RAM (train's --prefix-cache-gib)
    prefix_disk: int = 0  # bytes spilled to the run's memory-mapped file
    frozen_resident: bool = False  # the frozen MoE layers' experts dequantized once (score and train's choice)
    dense_layers: tuple[int, ...] = ()  # trainable dense layers (--targets dense): their MLP's and attention's linears

    @property
    def train_from(self) -> int:
        return min(self.layers + self.dense_layers)



@dataclass(frozen=True)
class Component:
    name: str
    device: int = 0
    host: int = 0
    basis: str = ""  # the formula or measurement it comes from, in words


@dataclass(frozen=True)
class StagePlan:
    stage: str
    components: tuple[Component, ...]
    disk: int = 0  # bytes written to disk beyond the artifact (prefix spill)

    @property
    def device_peak(self) -> int:
        return sum(c.device for c in self.components)

    @property
    def host_peak(self) -> int:
        return sum(c.host for c in self.components)


def _place(target: Target, name: str, nbytes: int, basis: str, *, on_device: bool = True) -> Component:
    if on_device and target.separate_device:
        return Component(name, device=nbytes, basis=basis)
    return Component(name, host=nbytes, basis=basis)


def _framework(target: Target) -> list[Component]:
    out = [
        Component(
            "framework (Python, torch)",
            host=target.host_baseline,
            basis="CLI fixed cost, measured" + ("; + CUDA runtime, assumed" if target.separate_device else ""),
        )
    ]
    if target.separate_device:
        out.append(Component("device context", device=target.context, basis="CUDA context, assumed 500 MiB"))
    return out


def _model_weights(m: ModelFacts, q: QuantSettings, t: Target, s: Settings) -> list[Component]:
    """What score, train and eval all hold: non-expert weights, 4-bit experts, resident bases."""
    layers = len(s.layers)
    experts = sum(w.layer_quantized_bytes(m, layer, q) for layer in m.spec.moe_layers)
    group = f"{q.nbits}-bit, group {q.group_size}"
    out = [
        _place(
            t,
            "non-expert weights",
            w.other_weight_bytes(m, s.layers, t.c),
            f"attention, embeddings, norms, frozen routers in {t.dtype}",
        ),
    ]
    if s.placement == "stream":
        buffer = STREAM_BUFFER_LAYERS * w.layer_quantized_bytes(m, m.spec.moe_layers[-1], q)
        out.append(Component("4-bit experts, all layers", host=experts, basis=f"{group}, pinned host memory"))
        out.append(Component("4-bit streaming buffer", device=buffer, basis="2 layers"))
    else:
        out.append(_place(t, "4-bit experts, all layers", experts, f"{group}, codes + fp16 scale/zero"))
    if "experts" in s.targets:  # the other targets' base is their own weight, counted with the non-expert weights
        out.append(
            _place(t, "resident bases", w.resident_bytes(m, layers, t.c), f"{layers} layers dequantized to {t.dtype}")
        )
    frozen = w.frozen_layer_count(m, s.train_from)
    if frozen and s.frozen_resident:  # usaf.stages.engine_setup.frozen_layers_resident: when they fit
        bases = w.resident_bytes(m, frozen, t.c)
        out.append(_place(t, "frozen layers, dequantized once", bases, f"{frozen} layers dequantized to {t.dtype}"))
    elif frozen:  # frozen layers run (prefix capture, score and eval forwards): a block of experts at a time
        experts, nbytes = w.frozen_block_bytes(m, t.c, t.separate_device)
        out.append(_place(t, "frozen-layer dequantization", nbytes, f"a block of {experts} experts"))
    return out


def _forward(m: ModelFacts, t: Target, s: Settings, capture: int) -> list[Component]:
    """One training forward's saved activations, and the working memory of the loss, of the backward or of a
    prefix capture.

    The working memories are never held together: the chunked loss frees its last chunk before the forward
    returns, and the backward's gradients of intermediates come after; a prefix capture of ``capture`` sequences
    runs before the forward (score's calibration batch; train's first-visit company, a few microbatches of short
    sequences: ``usaf.settings.train.company_size``). The largest one counts.
    """
    batch = act.Batch(s.microbatch, s.seq_len)
    saved = act.saved_activations(m, s.train_from, batch, t.c, s.targets)
    workings = [
        ("loss working memory", act.loss_workspace(m, batch), "one chunk of logits and its softmax"),
        ("backward working memory", act.backward_workspace(m, s.train_from, batch, t.c, s.targets),
         "one layer's activation gradients"),
    ]  # fmt: skip
    if s.train_from > 0:  # frozen layers below: a capture runs them
        captured = act.Batch(capture, s.seq_len)
        workings.append(("prefix capture working memory", act.capture_workspace(m, captured, t.c),
                         f"one frozen layer's forward over {capture} sequences"))  # fmt: skip
    name, nbytes, basis = max(workings, key=lambda w: w[1])
    smaller = " and ".join(other.removesuffix(" working memory") for other, _, _ in workings if other != name)
    return [
        _place(t, "activations (saved)", sum(saved.values()), f"formula, microbatch {s.microbatch} x {s.seq_len}"),
        _place(t, name, nbytes, f"{basis} (the {smaller}'s smaller)"),
    ]


def quantize_stage(m: ModelFacts, q: QuantSettings, t: Target) -> StagePlan:
    layer = m.spec.moe_layers[-1]
    source = m.expert_params_per_layer * m.source_bytes_per_param
    copies = QUANTIZE_LAYER_COPIES.get(m.source_bytes_per_param, 4)
    _, o, i = m.gate_up_shape
    parts = [
        *_framework(t),
        Component(
            "source experts, one layer",
            host=copies * source,
            basis=f"{copies} copies of the layer in {m.source_dtype} (measured)",
        ),
        Component(
            "quantized experts, one layer", host=w.layer_quantized_bytes(m, layer, q), basis="codes + scale/zero"
        ),
        _place(t, "solver workspace", QUANTIZE_SLICE_COPIES * act.FP32 * o * i, "fp32 expert slices, assumed"),
    ]
    return StagePlan("quantize", tuple(parts))


def _shapes(m: ModelFacts, s: Settings) -> list[tuple[int, int, int]]:
    """Every trainable tensor of the settings' MoE and dense layers as ``(E, O, I)``."""
    return w.trained_shapes(m, s.layers + s.dense_layers, s.targets)


def _dense_slice(m: ModelFacts, s: Settings) -> int:
    """Elements of the largest dense gradient a scoring backward forms at once: an expert slice or a linear target."""
    return max(o * i for _, o, i in _shapes(m, s))


def score_stage(m: ModelFacts, q: QuantSettings, t: Target, s: Settings) -> StagePlan:
    """At the plan's --dtype, which its score command passes (score computed in the device's own dtype once, and the
    plan held it there after score took --dtype: a --dtype float32 plan for a GPU counted score's weights in bf16;
    found in review, 2026-12-07)."""
    shapes = _shapes(m, s)
    routers = w.router_params(m, s.layers)
    entries = w.shapes_delta_entries(shapes, s.frac)
    # the lr test (on by default) trains probe runs on the chosen masks: train's deltas, gradients and state
    lr_test = w.shapes_delta_bytes(shapes, s.frac) + act.FP32 * entries
    lr_test += w.OPTIMIZER_BYTES_PER_PARAM * (entries + routers)
    parts = [
        *_framework(t),
        *_model_weights(m, q, t, s),
        _place(t, "routers (fp32)", 3 * act.FP32 * routers, "masters, anchors, gradients"),
        _place(
            t,
            "score pools",
            3 * w.shapes_pool_bytes(shapes, s.frac),
            f"sample + two halves, up to {w.POOL_FACTOR * (1 + w.POOL_OVERFLOW):g} x budget candidates of 12 bytes",
        ),
        _place(
            t, "dense expert-slice gradient", 3 * act.FP32 * _dense_slice(m, s), "gradient, statistic, top-k; assumed"
        ),
        _place(t, "lr test (probe runs)", lr_test, "deltas, their gradients and optimizer state"),
        *_forward(m, t, s, capture=s.microbatch),  # the calibration batch
    ]
    if s.train_from > 0:  # the scoring pass's prefix states: the lr test's input, then the plan's store
        states = w.CALIB_SAMPLES * s.seq_len * m.spec.hidden_size * t.c
        basis = f"{w.CALIB_SAMPLES} calibration sequences x {s.seq_len} tokens x hidden size, compute dtype"
        parts.append(Component("calibration prefix states", host=states, basis=basis))
    return StagePlan("score", tuple(parts))


def train_stage(m: ModelFacts, q: QuantSettings, t: Target, s: Settings) -> StagePlan:
    shapes = _shapes(m, s)
    entries = w.shapes_delta_entries(shapes, s.frac)
    routers = w.router_params(m, s.layers)
    batch = act.Batch(s.microbatch, s.seq_len)
    kernel = act.sparse_kernel_workspace(m, batch, s.frac, t.c, cpu=not t.separate_device, targets=s.targets)
    kernel_basis = "one expert's gathered entries"
    if t.kind == "cuda":  # the experts run grouped there (Capabilities.dense_delta_terms); RigL's steps run the loop
        grouped = act.grouped_delta_workspace(m, batch, s.targets)
        if grouped > kernel:
            kernel, kernel_basis = grouped, "a grouped block's fp32 delta and its gradient"
    parts = [
        *_framework(t),
        *_model_weights(m, q, t, s),
        _place(t, "deltas + index buffers", w.shapes_delta_bytes(shapes, s.frac), f"{entries:,} entries"),
        _place(t, "delta gradients", act.FP32 * entries, "fp32"),
        _place(t, "routers (fp32)", 3 * act.FP32 * routers, f"{routers:,} weights: masters, anchors, gradients"),
        _place(t, "optimizer state", w.OPTIMIZER_BYTES_PER_PARAM * (entries + routers), "2 fp32 moments + int32 step"),
        _place(t, "grow-score pools (RigL)", w.shapes_pool_bytes(shapes, s.frac), "RigL's last 4 steps"),
        _place(t, "dense expert-slice gradient", 3 * act.FP32 * _dense_slice(m, s), "RigL's scoring steps; assumed"),
        *_forward(m, t, s, capture=company_size(s.microbatch, s.seq_len, 1)),  # a first visit's company
        _place(t, "sparse-kernel workspace", kernel, kernel_basis),
    ]
    if s.train_from > 0:
        states = batch.tokens * m.spec.hidden_size * t.c
        parts.append(_place(t, "prefix states, one batch", states, "(B, T, H)"))
        # its cap: a run fills it as it first visits sequences, and a small corpus never does (a 0.4 GB train run was
        # planned at 2.4 GB "peak" with nothing saying so but a note; found in review)
        parts.append(Component("prefix cache in RAM, at most", host=s.prefix_ram,
                               basis="--prefix-cache-gib: filled as sequences are first visited"))  # fmt: skip
    staged = entries * (act.FP32 + act.INT64 + 12) + routers * act.FP32
    if t.separate_device:  # a checkpoint copies deltas, the cumulative delta and optimizer state to the host
        staged += w.OPTIMIZER_BYTES_PER_PARAM * (entries + routers)
    parts.append(Component("checkpoint staging", host=staged, basis="deltas and state copied to save"))
    return StagePlan("train", tuple(parts), disk=s.prefix_disk)


def eval_stage(m: ModelFacts, q: QuantSettings, t: Target, s: Settings) -> StagePlan:
    """The held-out forward of a trained change (``SparseEngine.apply_change``; no gradients), at the plan's --dtype
    and eval's own microbatch, as the plan's eval command runs it. What grows with the sequences evaluated is said
    apart (:func:`eval_bytes_per_sequence`): the plan does not know how many."""
    routers = w.router_params(m, s.layers)
    batch = act.Batch(EVAL_MICROBATCH, s.seq_len)
    parts = [
        *_framework(t),
        *_model_weights(m, q, t, s),
        _place(t, "deltas + index buffers", w.shapes_delta_bytes(_shapes(m, s), s.frac), "applied change"),
        _place(t, "routers (fp32)", 2 * act.FP32 * routers, "masters, anchors"),
        _place(t, "forward working memory", act.forward_workspace(m, batch),
               f"loss chunk, hidden states; eval's --microbatch {EVAL_MICROBATCH}"),  # fmt: skip
    ]
    return StagePlan("eval", tuple(parts))


def eval_bytes_per_sequence(m: ModelFacts, t: Target, s: Settings) -> int:
    """What eval keeps per sequence evaluated, in RAM: the base pass's states entering the first trained layer (for
    the fine-tuned pass; none where nothing is frozen below it), and both passes' routing sets (a top-k set of each
    MoE layer per token, ``engine.routing``). Eval's memory grew by them unplanned (found in review, 2026-12-07)."""
    states = s.seq_len * m.spec.hidden_size * t.c if s.train_from > 0 else 0
    set_bytes = 1 if m.spec.num_experts <= 256 else 2  # engine.routing.set_dtype
    return states + 2 * s.seq_len * len(m.spec.moe_layers) * m.spec.top_k * set_bytes


def all_stages(m: ModelFacts, q: QuantSettings, t: Target, s: Settings) -> list[StagePlan]:
    return [quantize_stage(m, q, t), score_stage(m, q, t, s), train_stage(m, q, t, s), eval_stage(m, q, t, s)]
