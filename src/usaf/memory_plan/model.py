"""The facts about a model the memory formulas need, from ``config.json`` alone.

The family layer (:func:`usaf.families.resolve_family`) gives the MoE layout; transformers, building the
model on the meta device (no memory, no weights), gives every other tensor's exact size and the shape
of each layer's attention — so the planner counts what the engine will hold instead of approximating
parameter counts from widths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from usaf.families import FamilySpec, resolve_family
from usaf.families.attention import AttentionShape, attention_shape
from usaf.families.fields import text_config
from usaf.families.meta import in_usaf_names, meta_model
from usaf.families.targets import linear_target_modules

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of one model, by what the engine does with them.

    Expert shapes are in the quantized tensors' stored orientation ``(E, O, I)`` (out-major, grouped
    along I): ``gate_up (E, 2I, H)``, ``down (E, H, I)`` for every family.
    """

    spec: FamilySpec
    vocab: int
    source_dtype: str  # the checkpoint's dtype (what quantize reads)
    global_numel: int  # embeddings, head, final norm: non-layer tensors (tied ones once)
    layer_numel: Mapping[int, int]  # per decoder layer: attention, norms, shared experts, dense MLP, biases
    router_numel: Mapping[int, int]  # per MoE layer: router parameters (trainable ones become fp32 masters)
    attention: AttentionShape
    dense_width: int | None  # dense layers' MLP width
    shared_width: int | None  # shared expert MLP width per MoE layer
    shared_gated: bool  # qwen2_moe: the shared expert's output is scaled by sigmoid(gate(x))
    # per linear target kind (attention, shared): the (O, I) weights of one MoE layer's nn.Linear modules
    linear_targets: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    @property
    def gate_up_shape(self) -> tuple[int, int, int]:
        s = self.spec
        return (s.num_experts, 2 * s.expert_width, s.hidden_size)

    @property
    def down_shape(self) -> tuple[int, int, int]:
        s = self.spec
        return (s.num_experts, s.hidden_size, s.expert_width)

    @property
    def expert_params_per_layer(self) -> int:
        return sum(e * o * i for e, o, i in (self.gate_up_shape, self.down_shape))

    @property
    def source_bytes_per_param(self) -> int:
        return _DTYPE_BYTES.get(self.source_dtype, 2)

    @property
    def clamped_gate(self) -> bool:
        """gpt-oss's clamped SwiGLU keeps five (t, I) tensors for backward, plain SwiGLU two."""
        return self.spec.activation.startswith("gpt_oss")


def model_facts(config: Mapping[str, Any]) -> ModelFacts:
    """Facts of the model ``config`` describes (builds it on the meta device: ~1 s, no memory)."""
    spec = resolve_family(config)
    text, _ = text_config(config)
    model = meta_model(config)
    params = dict(model.named_parameters())  # tied parameters once (named_parameters deduplicates)
    state = model.state_dict()
    tensors = {**{n: b for n, b in model.named_buffers() if n in state}, **params}
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    shapes = in_usaf_names(config, shapes, spec)  # transformers 4.x: per-expert weights as the fused tensors
    params = {spec.disk.to_memory(n) for n in params}  # 4.x names are the on-disk ones
    quantized = {name for layer in spec.moe_layers for name in (spec.gate_up_name(layer), spec.down_name(layer))}
    routers = {name: layer for layer in spec.moe_layers for name in spec.router_names(layer)}
    prefix = spec.layers_prefix + "."
    global_numel = 0
    layer_numel = dict.fromkeys(range(spec.num_layers), 0)
    router_numel = dict.fromkeys(spec.moe_layers, 0)
    for name, shape in shapes.items():
        if name in quantized:
            continue
        numel = math.prod(shape)
        if name in routers and name in params:
            router_numel[routers[name]] += numel
        elif name.startswith(prefix):
            layer_numel[int(name[len(prefix) :].split(".", 1)[0])] += numel
        else:
            global_numel += numel
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    return ModelFacts(
        spec=spec,
        vocab=int(model.get_output_embeddings().weight.shape[0]),
        source_dtype=dtype.removeprefix("torch."),
        global_numel=global_numel,
        layer_numel=layer_numel,
        router_numel=router_numel,
        attention=attention_shape(model, spec),
        dense_width=spec.dense_width,
        shared_width=spec.shared.width if spec.shared is not None else None,
        shared_gated=bool(spec.shared is not None and spec.shared.gate),
        linear_targets=_linear_target_shapes(model, spec),
    )


def _linear_target_shapes(model: Any, spec: FamilySpec) -> dict[str, tuple[tuple[int, int], ...]]:
    """The (O, I) weights of the top MoE layer's attention and shared-expert ``nn.Linear`` modules, and of the
    first dense layer's MLP (``dense``; none without dense layers)."""
    top = spec.moe_layers[-1]

    def shapes(layer: int, kind: str) -> tuple[tuple[int, int], ...]:
        names = linear_target_modules(model, spec, layer, kind)
        return tuple(tuple(model.get_submodule(n).weight.shape) for n in names)

    out = {kind: shapes(top, kind) for kind in ("attention", "shared")}
    out["dense"] = shapes(spec.dense_layers[0], "dense") if spec.dense_layers else ()
    return out
