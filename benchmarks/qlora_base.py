"""QLoRA's base for the CPU benchmarks: a transformers model whose decoder weights are held as 4-bit codes.

QLoRA (Dettmers et al., 2023) keeps the frozen base in 4 bits and dequantizes each weight when a forward uses it;
LoRA trains on top. ``bitsandbytes`` quantizes ``nn.Linear`` only, and transformers 5 keeps an MoE layer's experts
as fused 3-D parameters, so this module does the same thing through ``torch.nn.utils.parametrize``: every decoder
layer's attention and MLP projections and fused expert tensors are replaced by usaf's own 4-bit codes (the format
``usaf quantize`` writes: affine, grouped along the input axis), and reading the weight dequantizes it (fp32). peft's
LoRA then wraps them as it wraps plain weights (its fused-expert adapters add their own parametrization on top).

What a step pays over LoRA on fp32 weights is therefore the dequantization of every base weight the forward uses,
once per forward (autograd keeps the dequantized weight for the backward; bitsandbytes dequantizes again there to
save memory, so this is QLoRA's cheaper side). The embedding, the final norm, the routers and the LM head stay fp32,
as in QLoRA.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.utils import parametrize

from usaf.quant import QuantizedTensor, dequantize, quantize_experts

# Projections quantized in each decoder layer (nn.Linear weights) and fused expert tensors (3-D parameters).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_NAMES = ("gate_up_proj", "down_proj")


class Dequantized(nn.Module):
    """A parametrization whose stored tensor is 4-bit codes and whose value is their fp32 dequantization.

    ``right_inverse`` quantizes the weight once, when the parametrization is registered (the fp32 weight is then
    dropped); ``forward`` rebuilds it on every read. The codes are stored as their bytes viewed as fp32, because
    a parametrization may not change its tensor's dtype and peft reads it as one tensor; the scales and zeros are
    this module's buffers. 2-D weights are quantized as a stack of one.
    """

    def __init__(self, shape: torch.Size, nbits: int, group_size: int, method: str) -> None:
        super().__init__()
        self.flat = len(shape) == 2
        self.nbits, self.group_size, self.method = nbits, group_size, method

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        stack = weight.unsqueeze(0) if self.flat else weight  # (E, O, I)
        q = quantize_experts(stack, method=self.method, nbits=self.nbits, group_size=self.group_size)
        self.register_buffer("scale", q.scale)  # (E, O, I/g) fp16
        self.register_buffer("zero", q.zero)
        self.meta = {"shape": q.shape, "nbits": q.nbits, "group_size": q.group_size, "method": q.method,
                     "source_dtype": q.source_dtype}  # fmt: skip
        return q.codes.view(torch.float32)  # (E, O, I/8): the packed bytes, reinterpreted, never computed on

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        q = QuantizedTensor(codes=codes.view(torch.uint8), scale=self.scale, zero=self.zero, transposed=False,
                            **self.meta)  # fmt: skip
        w = dequantize(q)  # (E, O, I) fp32
        return w[0] if self.flat else w


def _patch_peft() -> None:
    """Two fixes to peft 0.21's fused-expert adapters over a weight that is already parametrized (idempotent).

    1. Each adapter reads its weight (``get_param``) before adding its LoRA term, inside the outer adapter's
       ``parametrize.cached()`` (an experts module with two adapted tensors nests two wrappers): the read caches
       the weight without the term, and the forward then used it, so the inner adapter got no gradient. The
       entry is dropped once the term is registered.
    2. peft removes its term after the forward only when it is the weight's sole parametrization; over
       :class:`Dequantized` it stayed, and every forward stacked one more. It is removed as peft does otherwise.
    """
    from peft.tuners.lora import layer

    wrapper = layer.ParamWrapper
    if getattr(wrapper, "usaf_patched", False):
        return
    activate, remove = wrapper._activate_lora, wrapper._remove_parametrizations

    @contextlib.contextmanager
    def activate_uncached(self, active_adapters):
        with activate(self, active_adapters):
            parametrize._cache.pop((id(self.get_base_layer()), self.parameter_name), None)
            yield

    def remove_own(self) -> None:
        stack = self.get_base_layer().parametrizations[self.parameter_name]
        if len(stack) > 1 and isinstance(stack[-1], layer._LoraFactorsProxy):
            del stack[-1]
            return
        remove(self)

    wrapper._activate_lora, wrapper._remove_parametrizations = activate_uncached, remove_own
    wrapper.usaf_patched = True


def quantize_base(model: nn.Module, *, nbits: int = 4, group_size: int = 64, method: str = "rtn") -> int:
    """Hold every decoder layer's projection and fused expert weights as 4-bit codes; returns how many weights.

    The routers (``mlp.gate``) and norms stay fp32, as QLoRA keeps them; so do the embedding and the LM head.
    """
    _patch_peft()
    count = 0
    for layer in model.model.layers:
        for path, module in layer.named_modules():
            if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in LINEAR_NAMES:
                names = ["weight"]
            else:
                names = [n for n in EXPERT_NAMES if isinstance(getattr(module, n, None), nn.Parameter)]
            for name in names:
                weight = getattr(module, name).requires_grad_(False)
                count += weight.numel()
                parametrize.register_parametrization(
                    module, name, Dequantized(weight.shape, nbits, group_size, method), unsafe=True
                )
    return count


def check_base(model: nn.Module, reference: nn.Module, input_ids: torch.Tensor) -> dict:
    """The 4-bit model's logits against the fp32 source's: a QLoRA arm must differ from it (a negative control
    that the base really is quantized) and must equal a copy of the source holding the dequantized weights."""
    dequantized = {}
    for path, module in model.named_modules():
        for name in getattr(module, "parametrizations", {}):
            with torch.no_grad():
                dequantized[f"{path}.{name}".removeprefix("base_model.model.")] = getattr(module, name).clone()
    with torch.no_grad():
        quantized = model(input_ids=input_ids, use_cache=False).logits
        source = reference(input_ids=input_ids, use_cache=False).logits
        reference.load_state_dict(dequantized, strict=False)
        rebuilt = reference(input_ids=input_ids, use_cache=False).logits
    result = {
        "weights_quantized": len(dequantized),
        "max_abs_logit_change_from_source": float((quantized - source).abs().max()),
        "max_abs_logit_diff_to_dequantized_copy": float((quantized - rebuilt).abs().max()),
    }
    if not dequantized or result["max_abs_logit_change_from_source"] == 0.0:
        raise RuntimeError(f"the QLoRA base is not quantized: {result}")
    if result["max_abs_logit_diff_to_dequantized_copy"] > 1e-4:
        raise RuntimeError(f"the QLoRA base does not compute with its dequantized weights: {result}")
    return result


def check_adapters(model: nn.Module, input_ids: torch.Tensor) -> int:
    """One forward and backward on ``input_ids``: every trainable parameter must get a gradient (an adapter that
    the forward skipped gets none) and no LoRA term may stay registered afterwards; returns how many were checked.
    The gradients are cleared again."""
    model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trained if p.grad is None]
    if missing:
        raise RuntimeError(f"LoRA parameters outside the forward: {missing}")
    for module in model.modules():
        for name, stack in getattr(module, "parametrizations", {}).items():
            if len(stack) != 1:
                raise RuntimeError(f"{name}: {len(stack)} parametrizations stayed after a forward: {list(stack)}")
    model.zero_grad(set_to_none=True)
    return len(trained)
