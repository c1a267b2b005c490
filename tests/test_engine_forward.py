"""The engine's model equals transformers' own model with the dequantized experts, for every family."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES
from helpers import reference_model
from usaf.engine.loading import load_quantized_model


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_equals_transformers_with_dequantized_experts(family, tiny_model, quantized):
    loaded = load_quantized_model(quantized(family))
    reference = reference_model(tiny_model(family), loaded)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(input_ids=ids).logits
        theirs = reference(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    # Negative control: the undequantized (original) experts give measurably different logits.
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model(family)).eval()
    with torch.no_grad():
        assert (original(input_ids=ids).logits - ours).abs().max() > 1e-4
    # Every MoE layer routed tokens through usaf's experts, and counted them.
    for state in loaded.experts.values():
        assert int(state.tokens_per_expert.sum()) == ids.numel() * loaded.spec.top_k
