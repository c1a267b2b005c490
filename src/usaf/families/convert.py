"""On-disk <-> in-memory expert tensors: pure torch, one MoE layer at a time.

E = experts, I = expert width, H = hidden size. Per-expert checkpoints hold gate [I, H], up [I, H]
and down [H, I] per expert (``nn.Linear`` weights, out x in). In memory, transformers v5 holds one
``gate_up_proj`` and one ``down_proj`` per layer in the layout of :class:`ExpertsLayout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from usaf.families.spec import ExpertsLayout

if TYPE_CHECKING:
    import torch


class ExpertOp(str, Enum):
    """How one in-memory fused tensor is built from its on-disk sources."""

    STACK_GATE_UP = "stack_gate_up"  # sources (gate per expert, up per expert) -> gate_up in the memory layout
    STACK_DOWN = "stack_down"  # sources (down per expert,) -> down [E, H, I] (or [E, I, H] if transposed)
    COPY = "copy"  # sources ((name,),): stored fused in the in-memory layout already
    MXFP4 = "mxfp4"  # sources ((blocks, scales),): decoded by transformers.integrations.mxfp4


@dataclass(frozen=True)
class FusedTensorPlan:
    """One in-memory fused expert tensor and the on-disk tensors it is built from."""

    target: str  # in-memory name, e.g. model.layers.1.mlp.experts.gate_up_proj
    role: str  # "gate_up" | "down" | "gate_up_bias" | "down_bias"
    op: ExpertOp
    sources: tuple[tuple[str, ...], ...]  # on-disk names in the order the op reads them (see ExpertOp)
    shape: tuple[int, ...]  # in-memory shape

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(n for group in self.sources for n in group)

    def describe(self, layout: ExpertsLayout) -> str:
        """How the tensor is built, in words (for plans shown to users)."""
        if self.op is ExpertOp.STACK_GATE_UP:
            n = len(self.sources[0])
            how = f"stack {n} gate [I,H] and {n} up [I,H]; "
            how += "interleave gate/up rows" if layout.interleaved else "concatenate gate then up on dim 1"
            return how + (", transpose to [E,H,2I]" if layout.transposed else " -> [E,2I,H]")
        if self.op is ExpertOp.STACK_DOWN:
            n = len(self.sources[0])
            return f"stack {n} down [H,I]" + (", transpose to [E,I,H]" if layout.transposed else " -> [E,H,I]")
        if self.op is ExpertOp.MXFP4:
            return "decode MXFP4 blocks/scales (transformers.integrations.mxfp4)"
        return "copy (already fused)"


@dataclass(frozen=True)
class ExpertLayerPlan:
    """The fused expert tensors of one MoE layer and how to convert them both ways."""

    layer: int
    layout: ExpertsLayout
    num_experts: int
    tensors: tuple[FusedTensorPlan, ...]

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(n for t in self.tensors for n in t.source_names)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.target for t in self.tensors)

    def fuse(self, disk: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """On-disk tensors (name -> tensor, at least this layer's sources) -> in-memory fused tensors.

        ``dtype`` applies to decoded formats only (MXFP4; default bfloat16); other tensors keep theirs.
        """
        # lazy: importing usaf.families stays free of torch
        import torch

        out = {}
        for t in self.tensors:
            if t.op is ExpertOp.STACK_GATE_UP:
                gate = torch.stack([disk[n] for n in t.sources[0]])  # [E, I, H]
                up = torch.stack([disk[n] for n in t.sources[1]])  # [E, I, H]
                out[t.target] = combine_gate_up(gate, up, self.layout)
            elif t.op is ExpertOp.STACK_DOWN:
                down = torch.stack([disk[n] for n in t.sources[0]])  # [E, H, I]
                out[t.target] = down.transpose(1, 2).contiguous() if self.layout.transposed else down
            elif t.op is ExpertOp.MXFP4:
                # lazy: gpt-oss's MXFP4 checkpoints only; transformers is heavy
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                blocks, scales = (disk[n] for n in t.sources[0])
                # blocks [E, R, H/32, 16] u8 (two FP4 values a byte), scales [E, R, H/32] u8 (E8M0) -> [E, H, R]
                out[t.target] = convert_moe_packed_tensors(blocks, scales, dtype=dtype or torch.bfloat16)
            else:
                out[t.target] = disk[t.sources[0][0]]
            if tuple(out[t.target].shape) != t.shape:
                raise ValueError(f"{t.target}: built shape {tuple(out[t.target].shape)}, expected {t.shape}")
        return out

    def split(self, memory: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """In-memory fused tensors -> the on-disk tensors of this plan (inverse of :meth:`fuse`).

        Outputs are contiguous and own their storage (safetensors refuses shared tensors). A decoded
        format (MXFP4) cannot be re-encoded: its tensors are returned unquantized under the in-memory names.
        """
        out = {}
        for t in self.tensors:
            w = memory[t.target]
            if t.op is ExpertOp.STACK_GATE_UP:
                gate, up = gate_up_halves(w, self.layout)  # views [E, I, H]
                for names, half in ((t.sources[0], gate), (t.sources[1], up)):
                    out.update({n: half[e].clone(memory_format=_contiguous()) for e, n in enumerate(names)})
            elif t.op is ExpertOp.STACK_DOWN:
                down = w.transpose(1, 2) if self.layout.transposed else w  # [E, H, I]
                out.update({n: down[e].clone(memory_format=_contiguous()) for e, n in enumerate(t.sources[0])})
            elif t.op is ExpertOp.MXFP4:
                out[t.target] = w
            else:
                out[t.sources[0][0]] = w
        return out


def _contiguous():
    # lazy: importing usaf.families stays free of torch
    import torch

    return torch.contiguous_format


def combine_gate_up(gate: torch.Tensor, up: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """gate [E, I, H] + up [E, I, H] -> gate_up in ``layout`` ([E, 2I, H], or [E, H, 2I] if transposed)."""
    # lazy: importing usaf.families stays free of torch
    import torch

    e, i, h = gate.shape
    # interleaved: rows g0, u0, g1, u1, ...; else rows g0..g(I-1), u0..u(I-1)
    w = torch.stack((gate, up), dim=2).reshape(e, 2 * i, h) if layout.interleaved else torch.cat((gate, up), dim=1)
    return w.transpose(1, 2).contiguous() if layout.transposed else w


def gate_up_halves(w: torch.Tensor, layout: ExpertsLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (gate, up), each [E, I, H], into a fused gate_up tensor; in-place edits write through."""
    if layout.transposed:
        w = w.transpose(-1, -2)  # [E, H, 2I] -> [E, 2I, H]
    i = w.shape[-2] // 2
    if layout.interleaved:
        return w[..., 0::2, :], w[..., 1::2, :]
    return w[..., :i, :], w[..., i:, :]


def bias_halves(b: torch.Tensor, layout: ExpertsLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (gate, up), each [E, I], into a fused gate_up bias [E, 2I]."""
    i = b.shape[-1] // 2
    if layout.interleaved:
        return b[..., 0::2], b[..., 1::2]
    return b[..., :i], b[..., i:]
