"""``SparseEngine``: what ``score``, ``train`` and ``eval`` drive.

It owns the choice of trainable layers (resident dequantized bases, sparse deltas, fp32 routers), the
loss (token-weighted cross-entropy, plus the model's own load-balancing loss and a router z-loss when
asked), dense-score passes, the frozen-prefix runner, per-layer expert-load statistics and memory
accounting. It never prints and never touches files.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from usaf.backends.transfer import check_allocation, move
from usaf.engine.accounting import (  # noqa: F401 (budget, resident_placement: re-exported)
    LayerLoad,
    budget,
    layer_loads,
    memory_by_component,
    resident_placement,
    weight_storages,
)
from usaf.engine.activations import SavedTensorMeter
from usaf.engine.deltas import SparseDelta
from usaf.engine.head_loss import IGNORE_INDEX, HeadInput, next_token_loss  # noqa: F401 (IGNORE_INDEX: re-exported)
from usaf.engine.linear_target import attach
from usaf.engine.loading import LoadedModel
from usaf.engine.prefix import PrefixCache, PrefixRunner, PrefixTap, cache_key, padded_states
from usaf.engine.scores import ScoreAccumulator
from usaf.engine.streaming import ExpertStreamer
from usaf.engine.trainable import TrainableTensor
from usaf.families.modules import decoder_returns_tuple, load_balancing_loss_of
from usaf.families.routing import dense_router_grad_refusal
from usaf.families.targets import EXPERTS_ONLY, index_free_refusal, linear_target_modules, parse_targets


class TargetsError(ValueError):
    """The asked ``targets`` cannot train on this model or device (said as a ``--targets`` error by the stages)."""


@dataclass
class LossParts:
    loss: torch.Tensor  # what backward() is called on
    ce: torch.Tensor  # token-weighted mean cross-entropy
    aux: torch.Tensor | None  # the model's own load-balancing loss (unscaled)
    z: torch.Tensor | None  # router z-loss (unscaled)
    tokens: int  # scored tokens


class SparseEngine:
    """Sparse fine-tuning of a quantized MoE model's top layers.

    Args:
        loaded: the model from :func:`usaf.engine.loading.load_quantized_model`.
        trainable_layers: the layers whose deltas (and routers) train: MoE layers, at least one, and with the
            ``dense`` target dense (non-MoE) layers too, which carry their MLP's ``nn.Linear`` modules (and their
            attention's with the ``attention`` target), no experts and no router. Kept apart as
            :attr:`trainable_layers` (the MoE ones) and :attr:`dense_layers`.
        targets: which weights of those layers carry sparse deltas (:mod:`usaf.families.targets`):
            ``experts`` (the fused routed experts, over resident dequantized bases), ``attention``, ``shared``
            and ``dense`` (every ``nn.Linear`` of the attention / shared experts / a dense layer's MLP, over their
            own weights).
        train_router: also train those layers' router weights (dense, fp32).
        aux_loss_coef: weight of the load-balancing loss in :meth:`loss` (the family's own, per trainable layer).
        z_loss_coef: weight of the router z-loss (mean squared logsumexp of router logits).
        resident_device: where trainable layers' dequantized bases live (default: the model's device).
        pin_resident: keep them in pinned host memory instead (streamed to the device per expert).
        stream_experts: keep every layer's 4-bit experts in host memory and stream the frozen layers' to
            the device one layer ahead of the forward (:mod:`usaf.engine.streaming`); ``"copy"`` also
            copies when the device is host memory (tests).
        pin_experts: page-locked host memory for the streamed experts (backends that support it).
        dense_router_grad: DenseMixer's router gradient on the trainable layers (needs ``train_router``):
            the forward is unchanged, the routers' gradient is the dense mixture's over all experts, at the
            cost of one extra no-grad pass over all experts of those layers in each backward
            (:class:`usaf.engine.experts._DenseRouterGrad`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        trainable_layers: Sequence[int],
        targets: Sequence[str] = EXPERTS_ONLY,
        train_router: bool = True,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        resident_device: torch.device | None = None,
        pin_resident: bool = False,
        stream_experts: bool | str = False,
        pin_experts: bool = False,
        dense_router_grad: bool = False,
    ) -> None:
        spec = loaded.spec
        targets = parse_targets(targets)
        dense = set(spec.dense_layers) if "dense" in targets else set()
        bad = sorted(set(trainable_layers) - set(spec.moe_layers) - dense)
        moe = sorted(set(trainable_layers) & set(spec.moe_layers))
        if bad or not moe:
            kinds = "MoE layers (and, with the dense target, dense layers)" if dense else "MoE layers"
            raise ValueError(
                f"trainable layers must be {kinds} {list(spec.moe_layers)}, one MoE layer at least; "
                f"got {list(trainable_layers)}"
            )
        self.loaded = loaded
        self.model = loaded.model
        self.spec = spec
        self.trainable_layers = tuple(moe)  # the MoE layers: experts, routers
        self.dense_layers = tuple(sorted(set(trainable_layers) & dense))  # linear targets only
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.targets = targets
        self.weights: dict[str, TrainableTensor] = {}  # in-memory name -> trainable tensor, (E, O, I)
        device = self.device
        if resident_device is None and not pin_resident:
            resident_device = device  # the 4-bit codes may be in host memory (streaming); the bases are not
        for layer in self.trainable_layers if "experts" in self.targets else ():
            state = loaded.experts[layer]
            for name, weight in ((spec.gate_up_name(layer), state.gate_up), (spec.down_name(layer), state.down)):
                _, o, i = weight.shape
                # The base is stored in chunks of whole experts under the device's per-allocation limit
                # (DirectML: ~800 MB), dequantized in fp32 batches: one expert's fp32 slice must fit.
                one_expert = o * i * max(4, torch.empty(0, dtype=weight.compute_dtype).element_size())
                where = torch.device("cpu") if pin_resident else resident_device or weight.q.codes.device
                what = f"one expert of the resident base of {name} (fp32 while dequantized)"
                check_allocation(one_expert, where, what)
                weight.make_resident(resident_device, pin=pin_resident)
                self.weights[name] = weight
        self._attach_linear_targets()
        self.routers: dict[str, nn.Parameter] = {}
        self.router_anchors: dict[str, torch.Tensor] = {}
        if train_router:
            for layer in self.trainable_layers:
                for name in spec.router_names(layer):
                    module_name, _, attr = name.rpartition(".")
                    module = self.model.get_submodule(module_name)
                    if attr not in module._parameters:
                        continue  # e.g. DeepSeek's e_score_correction_bias: a buffer, not trained
                    compute = module._parameters[attr].dtype
                    master = nn.Parameter(module._parameters[attr].detach().float().clone(), requires_grad=True)
                    module._parameters[attr] = master
                    if compute != torch.float32:  # the model computes in half: it sees a cast of the fp32 master
                        parametrize.register_parametrization(module, attr, _CastTo(compute), unsafe=True)
                        assert module.parametrizations[attr].original is master
                    self.routers[name] = master
                    self.router_anchors[name] = master.detach().clone()
        self.dense_router_grad = dense_router_grad
        if dense_router_grad:
            self._attach_dense_router_grad(train_router)
        self.streamer = None
        if stream_experts:
            frozen = [layer for layer in spec.moe_layers if layer not in self.trainable_layers]
            for layer in self.trainable_layers:  # their codes are read only by folds: host memory is enough
                for weight in (loaded.experts[layer].gate_up, loaded.experts[layer].down):
                    weight.q = weight.q.to("cpu")
            self.streamer = ExpertStreamer(
                self.model.model.layers, loaded.experts, frozen, device, pin=pin_experts,
                copy=stream_experts == "copy", top_k=spec.top_k,
            )  # fmt: skip
        self.head = HeadInput.of(self.model.get_output_embeddings())
        first = self.layers[0]
        self.activations = SavedTensorMeter(self._weight_storages, start_at=self.model.model.layers[0])
        returns_tuple = decoder_returns_tuple(spec)
        self.prefix = PrefixRunner(self.model.model.layers, first, returns_tuple=returns_tuple) if first > 0 else None

    def _attach_linear_targets(self) -> None:
        """Every ``nn.Linear`` of the asked attention/shared/dense targets in the trainable layers (MoE and dense)
        becomes a LinearTarget."""
        spec, loaded = self.spec, self.loaded
        index_ops = all(loaded.experts[layer].index_ops for layer in self.trainable_layers)  # one compute device
        if not index_ops and (refusal := index_free_refusal(spec, self.targets)):
            raise TargetsError(refusal)
        layers = list(self.layers)
        for target in self.targets:
            if target == "experts":
                continue
            found = 0
            for layer in layers:
                for module_name in linear_target_modules(self.model, spec, layer, target):
                    module = self.model.get_submodule(module_name)
                    self.weights[f"{module_name}.weight"] = attach(module, index_ops=index_ops)
                    found += 1
            if not found:  # asked for and absent: never a silent no-op
                hint = _dense_hint(spec, target)
                raise TargetsError(f"{spec.model_type} has no {target} modules in layers {layers}{hint}")

    def _attach_dense_router_grad(self, train_router: bool) -> None:
        """Each trainable layer's router hands its logits to that layer's experts (a per-instance forward hook)."""
        if not train_router:
            raise ValueError("dense_router_grad needs train_router: it changes only the routers' gradient")
        refusal = dense_router_grad_refusal(self.spec)
        if refusal is not None:
            raise ValueError(refusal)
        for layer in self.trainable_layers:
            state = self.loaded.experts[layer]
            state.dense_router = self.spec.router
            router = self.model.get_submodule(self.spec.router_prefix(layer))
            router.register_forward_hook(functools.partial(_keep_router_logits, state))

    @property
    def layers(self) -> tuple[int, ...]:
        """Every layer that trains, MoE and dense, ascending (what artifacts record as ``trainable_layers``)."""
        return tuple(sorted(self.trainable_layers + self.dense_layers))

    @property
    def device(self) -> torch.device:
        """Where the model computes: the device of its non-expert weights."""
        return self.model.get_input_embeddings().weight.device

    # -- deltas ----------------------------------------------------------------------------------

    def set_deltas(self, selection: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor] | None = None):
        """Install a sparse delta per trainable tensor: sorted flat indices into its ``(E, O, I)``."""
        unknown = set(selection) - set(self.weights)
        if unknown:
            raise KeyError(f"not trainable tensors: {sorted(unknown)}")
        for name, weight in self.weights.items():
            indices = selection.get(name)
            if indices is None:
                weight.delta = None
                continue
            vals = None if values is None else values.get(name)
            weight.delta = SparseDelta(weight.shape, indices, vals).to(weight.home)

    @torch.no_grad()
    def apply_change(self, change) -> None:
        """Install a finished run's change (:class:`usaf.artifacts.run.TrainedChange`) for inference.

        The cumulative deltas become this engine's active deltas (the same forward as training's), the
        routers are copied into the model. The engine must train exactly the change's layers; its
        routers must be trainable when the change has routers.
        """
        if tuple(sorted(change.trainable_layers)) != self.layers:
            raise ValueError(f"change trains layers {change.trainable_layers}, engine {list(self.layers)}")
        unknown = set(change.deltas) - set(self.weights)
        if unknown:
            raise KeyError(f"change has deltas for tensors this model does not have: {sorted(unknown)[:3]}")
        missing = set(change.routers) - set(self.routers)
        if missing:
            raise KeyError(f"change has routers the engine does not train: {sorted(missing)[:3]}")
        for name, weight in change.routers.items():  # copy_ would broadcast a (1, H) router over every expert
            if tuple(weight.shape) != tuple(self.routers[name].shape):
                raise ValueError(
                    f"router {name} of shape {tuple(weight.shape)}, the model's {tuple(self.routers[name].shape)}"
                )
        self.set_deltas({n: i for n, (i, _) in change.deltas.items()}, {n: v for n, (_, v) in change.deltas.items()})
        for delta in self.deltas().values():
            delta.values.requires_grad_(False)
        for name, master in self.routers.items():
            if name in change.routers:
                master.copy_(move(change.routers[name], master.device, master.dtype))

    def deltas(self) -> dict[str, SparseDelta]:
        return {name: w.delta for name, w in self.weights.items() if w.delta is not None}

    def parameter_groups(self, *, lr: float, router_lr: float, weight_decay: float) -> list[dict]:
        """Groups for :class:`usaf.engine.optim.SparseAdamW`.

        Deltas decay toward 0 (that is, toward the base weight); routers toward their pretrained weights.
        """
        groups = [
            {
                "name": "deltas",
                "params": [d.values for d in self.deltas().values()],
                "lr": lr,
                "weight_decay": weight_decay,
                "anchor": None,
            },
        ]
        if self.routers:
            groups.append(
                {
                    "name": "routers",
                    "params": list(self.routers.values()),
                    "lr": router_lr,
                    "weight_decay": weight_decay,
                    "anchor": [self.router_anchors[n] for n in self.routers],
                }
            )
        return groups

    # -- the loss ------------------------------------------------------------------------------------

    def loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        prefix_states: torch.Tensor | None = None,
    ) -> LossParts:
        """Token-weighted next-token cross-entropy (labels unshifted, -100 ignored) + router losses.

        ``prefix_states (B, T, H)``: the hidden states entering the first trainable layer (from
        :meth:`prefix_states`); the frozen layers below are then not run.
        """
        want_router_logits = self.aux_loss_coef > 0 or self.z_loss_coef > 0
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        if want_router_logits:
            kwargs["output_router_logits"] = True
        if prefix_states is not None and self.prefix is None:
            raise ValueError("no frozen prefix: the first trainable layer is layer 0")
        injecting = self.injected(prefix_states) if prefix_states is not None else contextlib.nullcontext()
        with self.activations.measure(), injecting, self.head.capture() as head_input:
            outputs = self.model(**kwargs)  # its logits are not computed: the loss is, a chunk at a time
            summed, tokens = next_token_loss(head_input(), labels, self.head.head)  # position t predicts t+1
            ce = summed / max(tokens, 1)
        loss, aux, z = ce, None, None
        first = self.prefix.start if prefix_states is not None else 0  # skipped frozen layers route nothing
        if self.aux_loss_coef > 0:
            aux = self._aux_loss(outputs, attention_mask, first_run_layer=first)
            loss = loss + self.aux_loss_coef * aux
        if self.z_loss_coef > 0:
            z = self._z_loss(outputs.router_logits, first_run_layer=first)
            loss = loss + self.z_loss_coef * z
        return LossParts(loss, ce, aux, z, tokens)

    def _trainable_router_logits(self, router_logits: Iterable[torch.Tensor], first_run_layer: int) -> list:
        """The trainable layers' router logits ``[(B*T, E), ...]``, in layer order.

        ``router_logits`` holds one entry per MoE layer that ran, in order: from a cached prefix state the
        frozen layers below ``first_run_layer`` did not run and recorded none.
        """
        per_layer = [logits for logits in router_logits if logits is not None]
        ran = [layer for layer in self.spec.moe_layers if layer >= first_run_layer]
        if len(per_layer) != len(ran):
            raise RuntimeError(f"{len(per_layer)} router logits for the {len(ran)} MoE layers that ran")
        return [per_layer[ran.index(layer)] for layer in self.trainable_layers]

    def _aux_loss(self, outputs, attention_mask: torch.Tensor | None, *, first_run_layer: int) -> torch.Tensor:
        """The mean over the trainable layers of each layer's own load-balancing loss (the family's function).

        Not the model's ``aux_loss``, which pools every layer's counts before the product: that couples a
        trainable router's gradient to the frozen layers' routing, which a step from a cached prefix state
        never computes, so cached and uncached steps trained differently. Per layer, it is the same with or
        without the prefix, and it balances each trained layer rather than their sum.
        """
        balance = load_balancing_loss_of(self.model)
        if balance is None:
            raise ValueError(f"{self.spec.model_type} computes no load-balancing loss; pass aux_loss_coef=0")
        chosen = self._trainable_router_logits(outputs.router_logits, first_run_layer)
        return torch.stack(
            [balance((x,), self.spec.num_experts, self.spec.top_k, attention_mask) for x in chosen]
        ).mean()

    def _z_loss(self, router_logits: Iterable[torch.Tensor], *, first_run_layer: int = 0) -> torch.Tensor:
        """Mean squared logsumexp of the trainable layers' router logits (ST-MoE's z-loss)."""
        chosen = self._trainable_router_logits(router_logits, first_run_layer)
        return torch.stack([torch.logsumexp(x.float(), dim=-1).pow(2).mean() for x in chosen]).mean()

    @contextlib.contextmanager
    def injected(self, prefix_states: torch.Tensor) -> Iterator[None]:
        """Within the block, model forwards start at the first trainable layer from ``prefix_states (B, T, H)``
        (on the model's device); the frozen layers below pass it through and stream no experts."""
        if self.prefix is None:
            raise ValueError("no frozen prefix: the first trainable layer is layer 0")
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.prefix.injecting(prefix_states))
            if self.streamer is not None:  # the skipped frozen layers need no experts on the device
                stack.enter_context(self.streamer.skipping(below=self.prefix.start))
            yield

    @torch.no_grad()
    def prefix_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states ``(B, T, H)`` entering the first trainable layer (what the prefix cache stores)."""
        if self.prefix is None:
            raise ValueError("no frozen prefix: the first trainable layer is layer 0")
        return self.prefix.capture(self.model, input_ids, attention_mask)

    def prefix_tap(self) -> PrefixTap:
        """A tap recording the hidden states ``(B, T, H)`` entering the first trainable layer on every forward,
        in host memory; ``close()`` it after."""
        if self.prefix is None:
            raise ValueError("no frozen prefix: the first trainable layer is layer 0")
        return PrefixTap(self.model.model.layers[self.prefix.start])

    def prefix_key(self, tokens: torch.Tensor, model_fingerprint: str) -> str:
        """Cache key of one sample's prefix state: its unpadded ``tokens (t,)`` and all else it depends on."""
        if self.prefix is None:
            raise ValueError("no frozen prefix: the first trainable layer is layer 0")
        dtype = next(self.model.parameters()).dtype
        return cache_key(tokens, model_fingerprint=model_fingerprint, start=self.prefix.start, dtype=dtype)

    def cached_prefix_states(
        self,
        input_ids: torch.Tensor,
        cache: PrefixCache,
        *,
        model_fingerprint: str,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B, T, H)`` prefix states of a batch from ``cache``; samples not cached are computed and stored.

        Keys are per sample (its unpadded token ids, the model fingerprint, the first trainable layer,
        the dtype and library versions). Padding is assumed on the right, where a causal model's real
        tokens never see it, so a sample's state does not depend on the batch it came in.
        """
        if self.prefix is None:
            raise ValueError("no frozen prefix: the first trainable layer is layer 0")
        lengths = (
            attention_mask.sum(dim=1).tolist() if attention_mask is not None else [input_ids.shape[1]] * len(input_ids)
        )
        rows = [input_ids[i, : int(n)] for i, n in enumerate(lengths)]
        keys = [self.prefix_key(r, model_fingerprint) for r in rows]
        for row, key in zip(rows, keys):
            if key in cache:
                cache.hits += 1
            else:
                cache.misses += 1
                cache.put(key, self.prefix_states(row[None])[0])  # (t, H), one sample: never skipped
        return padded_states([cache.get(key) for key in keys], input_ids.shape[1]).to(input_ids.device)

    # -- dense scores ----------------------------------------------------------------------------------

    def dense_scores(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        *,
        candidates: int | Mapping[str, int],
        statistic: str = "grad",
        exact: bool = False,
        pool_factor: int = 4,
        into: dict[str, ScoreAccumulator] | None = None,
    ) -> dict[str, ScoreAccumulator]:
        """Accumulate a per-weight importance statistic over ``batches`` (input_ids, labels, mask).

        Each trainable tensor's dense gradient exists one expert slice at a time inside the backward
        and is reduced immediately into a :class:`ScoreAccumulator` of ``candidates`` entries. ``into``: go on
        adding to these (:meth:`score_accumulators`'s, restored: a resumed calibration), which hold every batch
        completed before an exception stops the pass.
        """
        settings = {"candidates": candidates, "statistic": statistic, "exact": exact, "pool_factor": pool_factor}
        tagged = ((None, *batch) for batch in batches)
        sample, _ = self._dense_scores(tagged, halves=False, into=None if into is None else (into, []), **settings)
        return sample

    def dense_scores_in_halves(
        self,
        batches: Iterable[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]],
        *,
        candidates: int | Mapping[str, int],
        statistic: str = "grad",
        exact: bool = False,
        pool_factor: int = 4,
        into: tuple[dict[str, ScoreAccumulator], list[dict[str, ScoreAccumulator]]] | None = None,
    ) -> tuple[dict[str, ScoreAccumulator], tuple[dict[str, ScoreAccumulator], dict[str, ScoreAccumulator]]]:
        """:meth:`dense_scores` of the whole sample and of two halves of it, from one backward per batch.

        ``batches`` yield ``(half, input_ids, labels, mask)``, ``half`` 0 or 1: every batch's statistic is added
        to the sample's accumulators and to its half's (computed once, :meth:`ScoreAccumulator.sink_with`).
        ``into``: ``(sample, [half 0, half 1])`` to go on adding to (:meth:`dense_scores`).

        Returns:
            ``(sample, (half 0, half 1))``, each a mapping name -> :class:`ScoreAccumulator`.
        """
        settings = {"candidates": candidates, "statistic": statistic, "exact": exact, "pool_factor": pool_factor}
        sample, halves = self._dense_scores(batches, halves=True, into=into, **settings)
        return sample, (halves[0], halves[1])

    def score_accumulators(
        self, *, candidates: int | Mapping[str, int], statistic: str = "grad", exact: bool = False, pool_factor: int = 4
    ) -> dict[str, ScoreAccumulator]:
        """An empty :class:`ScoreAccumulator` per trainable tensor, as :meth:`dense_scores` makes them."""
        return {
            name: ScoreAccumulator(
                weight.shape,
                candidates if isinstance(candidates, int) else candidates[name],
                statistic,
                exact=exact,
                pool_factor=pool_factor,
            )
            for name, weight in self.weights.items()
        }

    def _dense_scores(
        self,
        tagged: Iterable[tuple],
        *,
        halves: bool,
        into: tuple[dict[str, ScoreAccumulator], list[dict[str, ScoreAccumulator]]] | None,
        **settings: Any,
    ) -> tuple[dict[str, ScoreAccumulator], list[dict[str, ScoreAccumulator]]]:
        if into is not None:
            sample, parts = into
        else:
            sample = self.score_accumulators(**settings)
            parts = [self.score_accumulators(**settings), self.score_accumulators(**settings)] if halves else []
        try:
            for half, input_ids, labels, mask in tagged:
                fed = [sample] if half is None else [sample, parts[half]]
                for name, weight in self.weights.items():
                    weight.score_sink = sample[name].sink if half is None else sample[name].sink_with(parts[half][name])
                self.model.zero_grad(set_to_none=True)
                # batches come from the host (usaf score's calibration batches): the model's device takes them
                input_ids, labels = input_ids.to(self.device), labels.to(self.device)
                mask = None if mask is None else mask.to(self.device)
                self.loss(input_ids, labels, mask).loss.backward()
                for acc in (a for accs in fed for a in accs.values()):
                    acc.end_batch()
        finally:
            for weight in self.weights.values():
                weight.score_sink = None
            self.model.zero_grad(set_to_none=True)
            for delta in self.deltas().values():
                delta.values.grad = None
        return sample, parts

    # -- statistics ------------------------------------------------------------------------------------

    def load_stats(self, *, reset: bool = True) -> dict[int, LayerLoad]:
        """Per MoE layer: tokens per expert since the last reset, load entropy, max share, dead experts."""
        return layer_loads(self.loaded.experts, reset=reset)

    def memory(self, *, optimizer: object | None = None, cache: PrefixCache | None = None) -> dict[str, int]:
        """Bytes by component (:func:`usaf.engine.accounting.memory_by_component`)."""
        return memory_by_component(self, optimizer=optimizer, cache=cache)

    def _weight_storages(self) -> set[int]:
        return weight_storages(self)

    def trainable_count(self) -> dict[str, int]:
        return {
            "delta_entries": sum(d.nnz for d in self.deltas().values()),
            "router_params": sum(p.numel() for p in self.routers.values()),
        }


def _keep_router_logits(state, module: nn.Module, args, output) -> None:
    """Forward hook of a trainable layer's router: its logits ``(T, E)`` go to the layer's experts forward.

    transformers 5 routers return ``(logits, weights, index)``; a 4.x softmax router is a Linear (logits).
    """
    state.router_logits = output[0] if isinstance(output, tuple) else output


class _CastTo(nn.Module):
    """A parametrization: the fp32 router master, cast to the compute dtype where the model reads it."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, master: torch.Tensor) -> torch.Tensor:
        return master.to(self.dtype)


def _dense_hint(spec, target: str) -> str:
    """Where the dense target's modules are, when asked for and absent from the trainable layers."""
    if target != "dense":
        return ""
    if not spec.dense_layers:
        return " (every layer of this model is a MoE layer)"
    return f" (its dense layers are {list(spec.dense_layers)}: train from the lowest of them, --train-from)"
