"""What usaf knows about one MoE model: frozen dataclasses, no torch, no transformers.

A :class:`FamilySpec` is built from ``config.json`` by a family file (or the structural fallback) and
answers every naming question the rest of usaf asks: which layers are MoE, the shapes and layout of
the fused expert tensors in memory, where the router and shared experts live, and how the family's
checkpoints name the same tensors on disk.

Shapes use E = experts per layer, I = expert width (intermediate size), H = hidden size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class RouterKind(str, Enum):
    """How a family turns router logits into (expert ids, weights); see :mod:`usaf.families.routing`."""

    SOFTMAX_TOPK = "softmax_topk"  # softmax over all E, top-k of the probabilities, renormalise iff asked
    SIGMOID_GROUP_TOPK = "sigmoid_group_topk"  # DeepSeek-V3: sigmoid, +correction bias for choice, groups
    TOPK_SOFTMAX = "topk_softmax"  # gpt-oss: top-k of the (biased) logits, softmax over those k only
    MODEL_DEFINED = "model_defined"  # structural fallback: usaf keeps the model's own router forward


class DiskLayout(str, Enum):
    """How a checkpoint stores one MoE layer's experts."""

    PER_EXPERT = "per_expert"  # one 2-D tensor per expert and projection (gate [I,H], up [I,H], down [H,I])
    FUSED = "fused"  # the in-memory 3-D tensors under their in-memory names
    MXFP4 = "mxfp4"  # gpt-oss hub checkpoints: `*_blocks` (packed FP4) + `*_scales` (E8M0) + bf16 biases


@dataclass(frozen=True)
class ExpertsLayout:
    """The in-memory layout of a layer's fused experts (transformers v5 ``@use_experts_implementation``).

    transposed=False: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, applied as ``F.linear(x, W[e])``.
    transposed=True:  ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, applied as ``x @ W[e]``.
    interleaved=False: gate is ``[0:I]`` and up is ``[I:2I]`` along the 2I axis (transformers'
    ``is_concatenated=True``); interleaved=True: gate at even and up at odd positions (gpt-oss).
    has_bias: ``gate_up_proj_bias [E, 2I]`` (same gate/up order as the weight), ``down_proj_bias [E, H]``.
    """

    transposed: bool = False
    interleaved: bool = False
    has_bias: bool = False

    def gate_up_shape(self, e: int, i: int, h: int) -> tuple[int, int, int]:
        return (e, h, 2 * i) if self.transposed else (e, 2 * i, h)

    def down_shape(self, e: int, i: int, h: int) -> tuple[int, int, int]:
        return (e, i, h) if self.transposed else (e, h, i)


@dataclass(frozen=True)
class RouterSpec:
    """The router of a MoE block. Names are relative to the MoE block (``model.layers.{i}.mlp``)."""

    kind: RouterKind
    module: str  # "gate" (qwen, mixtral, olmoe, deepseek) or "router" (gpt-oss)
    params: tuple[str, ...] = ("weight",)  # tensors of the router module: weight [E, H], bias [E], ...
    renormalize: bool = False  # `norm_topk_prob`: divide the k kept weights by their sum
    scaling_factor: float = 1.0  # `routed_scaling_factor` (DeepSeek-V3) multiplies the final weights
    n_group: int | None = None  # DeepSeek-V3 group-limited routing: E experts in n_group groups,
    topk_group: int | None = None  # of which the topk_group best (sum of their top-2 scores) are eligible
    fp32: bool = False  # transformers keeps this router in float32 whatever the model dtype

    def describe(self) -> str:
        if self.kind is RouterKind.SOFTMAX_TOPK:
            return "softmax over experts, top-k" + (", renormalised" if self.renormalize else ", not renormalised")
        if self.kind is RouterKind.SIGMOID_GROUP_TOPK:
            return (
                f"sigmoid + e_score_correction_bias for choice, top-{self.topk_group} of {self.n_group} groups, "
                f"top-k{', renormalised' if self.renormalize else ''}, x {self.scaling_factor:g}"
            )
        if self.kind is RouterKind.TOPK_SOFTMAX:
            return "top-k of biased logits, then softmax over the k"
        return f"defined by the model's own router module ({', '.join(self.params)})"


@dataclass(frozen=True)
class SharedExpertSpec:
    """Always-on expert(s) of a MoE block, next to the routed ones. Names relative to the MoE block."""

    module: str  # "shared_expert" (qwen2_moe) or "shared_experts" (deepseek_v3): a plain gated MLP
    width: int | None  # its intermediate size
    gate: str | None = None  # qwen2_moe "shared_expert_gate": Linear(H, 1); output *= sigmoid(gate(x))
    extra_modules: tuple[str, ...] = ()  # structural fallback: further shared modules found by name


@dataclass(frozen=True)
class PerExpertNaming:
    """Per-expert tensor names, relative to the in-memory MoE block, ``{e}`` = expert index.

    Matched after the family's renames have been applied to the on-disk name (so Mixtral's
    ``block_sparse_moe.experts.{e}.w1.weight`` is matched as ``mlp.experts.{e}.w1.weight``).
    """

    gate: str = "experts.{e}.gate_proj.weight"  # [I, H]
    up: str = "experts.{e}.up_proj.weight"  # [I, H]
    down: str = "experts.{e}.down_proj.weight"  # [H, I]


@dataclass(frozen=True)
class DiskSpec:
    """How the family's checkpoints name tensors, as ``save_pretrained`` writes them in transformers 5.24."""

    canonical: DiskLayout
    per_expert: PerExpertNaming | None = PerExpertNaming()
    # Literal (on-disk fragment, in-memory fragment) substitutions applied in order to every on-disk
    # name (and reversed, in reverse order, to write one), e.g. Mixtral (".block_sparse_moe.", ".mlp.").
    renames: tuple[tuple[str, str], ...] = ()
    accepts_mxfp4: bool = False  # gpt-oss: MXFP4 expert blocks can be decoded with transformers' code

    def to_memory(self, name: str) -> str:
        for disk, memory in self.renames:
            name = name.replace(disk, memory)
        return name

    def to_disk(self, name: str) -> str:
        for disk, memory in reversed(self.renames):
            name = name.replace(memory, disk)
        return name


@dataclass(frozen=True)
class LegacyModules:
    """How transformers 4.x (4.51-4.57, the DirectML configuration) holds this family's MoE block in memory.

    transformers 4.x has no experts-implementation registry. Its tensor names in memory are the
    on-disk names (the family's renames are applied by v5's loader only), and most families keep their
    experts as an ``nn.ModuleList`` of per-expert MLPs named like :class:`PerExpertNaming`.

    Attributes:
        experts: ``"per_expert"`` (a ModuleList of gated MLPs, ``nn.Linear`` gate/up/down) or ``"fused"``
            (the same 3-D tensors as v5, under the same names: gpt-oss).
        returns_router_logits: the block's forward returns ``(hidden, router_logits)``, else ``hidden``.
        router_routes: the router module returns the routing itself (DeepSeek-V3: ``(indices, weights)``;
            gpt-oss: ``(scores [T, E], indices)``), else it is an ``nn.Linear`` giving logits.
        layer_returns_tuple: the decoder layer returns ``(hidden, [attentions], [router_logits])`` and the
            model reads ``[0]`` (OLMoE, Qwen2-MoE in 4.57), else the hidden state alone.
        config_renames: ``(name transformers 5 writes, name 4.x reads)`` for config fields whose name
            changed: a ``config.json`` saved by transformers 5 would otherwise get 4.x's default there
            (Qwen3-MoE: ``num_local_experts`` vs ``num_experts``, default 128).
    """

    experts: str = "per_expert"
    returns_router_logits: bool = True
    router_routes: bool = False
    layer_returns_tuple: bool = False
    config_renames: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class FamilySpec:
    """Everything usaf needs to know about one MoE model, resolved from its ``config.json``."""

    family: str  # the family file that built this spec, or "structural" for the fallback
    model_type: str
    architectures: tuple[str, ...]
    num_layers: int
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    num_experts: int  # E
    top_k: int  # k
    expert_width: int  # I
    hidden_size: int  # H
    dense_width: int | None  # intermediate size of the dense layers' MLP (None when every layer is MoE)
    router: RouterSpec
    shared: SharedExpertSpec | None
    layout: ExpertsLayout
    disk: DiskSpec
    activation: str = "silu"  # expert activation; gpt-oss: its clamped SwiGLU with (up + 1)
    layers_prefix: str = "model.layers"
    moe_module: str = "mlp"  # the MoE block's attribute on a decoder layer, in memory
    mtp_layers: int = 0  # on-disk layers num_layers .. num_layers+mtp_layers-1 that transformers ignores
    tie_word_embeddings: bool = False
    nested_in: str | None = None  # "text_config" when the text model's fields are nested
    # the transformers 4.x module layout; None: usaf supports the family on transformers >= 5 only
    legacy: LegacyModules | None = None
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the config.json dict

    @property
    def structural(self) -> bool:
        return self.family == "structural"

    # -- in-memory names -------------------------------------------------------------------------------
    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def layer_prefix(self, layer: int) -> str:
        return f"{self.layers_prefix}.{layer}"

    def layer_of(self, name: str) -> int:
        """The decoder layer of an in-memory tensor name (``model.layers.3.mlp.experts.down_proj`` -> 3)."""
        rest = name.removeprefix(f"{self.layers_prefix}.")
        if rest == name:
            raise ValueError(f"{name!r} is not under {self.layers_prefix!r}")
        return int(rest.split(".", 1)[0])

    def moe_prefix(self, layer: int) -> str:
        return f"{self.layers_prefix}.{layer}.{self.moe_module}"

    def experts_prefix(self, layer: int) -> str:
        return f"{self.moe_prefix(layer)}.experts"

    def gate_up_name(self, layer: int) -> str:
        return f"{self.experts_prefix(layer)}.gate_up_proj"

    def down_name(self, layer: int) -> str:
        return f"{self.experts_prefix(layer)}.down_proj"

    def gate_up_bias_name(self, layer: int) -> str | None:
        return f"{self.experts_prefix(layer)}.gate_up_proj_bias" if self.layout.has_bias else None

    def down_bias_name(self, layer: int) -> str | None:
        return f"{self.experts_prefix(layer)}.down_proj_bias" if self.layout.has_bias else None

    def expert_names(self, layer: int) -> dict[str, str]:
        """Role -> in-memory name of every fused expert tensor of a MoE layer."""
        names = {"gate_up": self.gate_up_name(layer), "down": self.down_name(layer)}
        if self.layout.has_bias:
            names["gate_up_bias"] = f"{self.experts_prefix(layer)}.gate_up_proj_bias"
            names["down_bias"] = f"{self.experts_prefix(layer)}.down_proj_bias"
        return names

    def router_prefix(self, layer: int) -> str:
        return f"{self.moe_prefix(layer)}.{self.router.module}"

    def router_weight_name(self, layer: int) -> str:
        return f"{self.router_prefix(layer)}.weight"

    def router_names(self, layer: int) -> tuple[str, ...]:
        return tuple(f"{self.router_prefix(layer)}.{p}" for p in self.router.params)

    def shared_prefixes(self, layer: int) -> tuple[str, ...]:
        """Module prefixes of the shared expert(s) (and their gate) in a MoE layer; empty if none."""
        if self.shared is None:
            return ()
        modules = (self.shared.module, *((self.shared.gate,) if self.shared.gate else ()), *self.shared.extra_modules)
        return tuple(f"{self.moe_prefix(layer)}.{m}" for m in modules)

    # -- shapes ----------------------------------------------------------------------------------------
    @property
    def gate_up_shape(self) -> tuple[int, int, int]:
        return self.layout.gate_up_shape(self.num_experts, self.expert_width, self.hidden_size)

    @property
    def down_shape(self) -> tuple[int, int, int]:
        return self.layout.down_shape(self.num_experts, self.expert_width, self.hidden_size)

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Role -> shape of the fused expert tensors of one MoE layer."""
        e, i, h = self.num_experts, self.expert_width, self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"gate_up": self.gate_up_shape, "down": self.down_shape}
        if self.layout.has_bias:
            shapes["gate_up_bias"] = (e, 2 * i)
            shapes["down_bias"] = (e, h)
        return shapes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready facts (without the raw config)."""
        out = asdict(self)
        out.pop("config")
        out["router"]["kind"] = self.router.kind.value
        out["disk"]["canonical"] = self.disk.canonical.value
        out["router_description"] = self.router.describe()
        return out
