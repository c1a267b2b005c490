"""Activation memory of a training forward, and the working memory around it, by formula.

The engine *measures* what autograd saves (``SavedTensorMeter``: distinct storages kept for backward,
weights excluded); a planner has no forward to measure, so it adds up what each operation saves. Every
term below was read off the saved storages of the engine's training forward (transformers 5.24, torch
2.13, CPU) and checked against the meter on tiny models of each family: the formula for Qwen3-MoE,
Mixtral, OLMoE and Qwen2-MoE layers matches it to within a few bytes per token; DeepSeek (MLA) and
gpt-oss (eager attention with sinks) are approximated (``tests/test_memory_plan.py`` pins each).

Who saves what (N = B·T tokens, c = bytes of the compute dtype, k = experts per token):

* Autograd keeps only what a gradient needs. Frozen weights need no gradient, so a linear layer whose
  input does not require grad saves nothing; that is why layers below the first trainable one build no
  graph, and why the first trainable layer saves its MoE block only (its attention's input is a frozen
  function of the prefix). Every later layer saves attention, two RMSNorms and its MLP or MoE block.
* RMSNorm upcasts to fp32 and saves that copy plus the reciprocal RMS: ``4·N·H + 4·N`` in any dtype.
* Attention (SDPA, fused kernel): Q, K, V after rotary, the output (c each) and a log-sum-exp (fp32,
  per head and position). A padding mask makes transformers repeat K and V for every query head before
  SDPA, and the mask itself (``B·T·T``, c) is kept once per forward. SDPA's math kernel (taken when the
  value head dim differs, as in MLA) keeps fp32 Q, K, V and the ``(B, heads, T, T)`` probabilities; eager
  attention (gpt-oss, for its sinks) keeps them in the compute dtype. q/k norms save fp32 copies of Q, K.
* Router (softmax over E then top-k): its input (c), the fp32 softmax, top-k indices (int64), and the
  renormalisation's sum and weights when ``norm_topk_prob``; an fp32 master router seen in half
  precision also keeps its cast (``E·H·c`` per layer).
* Each routed (token, expert) pair: the gathered input (H), the gate-up output (2I), the SwiGLU's two
  (I) intermediates, the expert's output (H) in c; an fp32 (H) copy on the way to the fp32 sum; two int64
  indices and a routing weight. gpt-oss's clamped SwiGLU keeps five (I) intermediates.
* The loss: the final norm, then the chunked cross-entropy (``usaf.engine.head_loss``) saves only its
  gradient with respect to the hidden states, ``c·B·(T-1)·H``; no logits are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from usaf.families import RouterKind
from usaf.memory_plan.model import ModelFacts

FP32 = 4
INT64 = 8
# The chunked loss holds one chunk's logits at a time (usaf.engine.head_loss: CHUNK_LOGIT_BYTES of fp32
# logits per chunk), turned into the softmax in place: measured 8.2 (fp32) and 6.6 (bf16) bytes per logit of a
# chunk at the step's peak, most of it the CPU BLAS's temporary for the projection (peak RSS of the step above
# the RSS before it, glibc's mmap threshold lowered so RSS follows allocations; Qwen3-30B-A3B's head on CPU:
# benchmarks/bench_head_loss.py).
LOSS_WORKSPACE_PER_LOGIT = 9
# usaf.engine.head_loss.CHUNK_LOGIT_BYTES (not imported: the planner does not import torch)
CHUNK_LOGIT_BYTES = 64 * 2**20
# Sparse-delta kernels gather (tokens × entries) fp32 temporaries, one expert at a time, in chunks of at
# most this many tokens (usaf.engine.sparse_linear's default chunk_tokens).
CHUNK_TOKENS = 1024
# usaf.engine.grouped_deltas.DELTA_BLOCK_BYTES (not imported: the planner does not import torch): one block's fp32
# dense delta where a trainable layer's experts run grouped (CUDA)
DELTA_BLOCK_BYTES = 256 * 2**20
# Routing is uneven: the busiest expert is taken to receive this multiple of the mean load when sizing
# the per-expert temporaries (a random-init router measured about 2x; trained routers are more even).
BUSIEST_EXPERT_LOAD = 2


@dataclass(frozen=True)
class Batch:
    """One microbatch: ``size`` sequences of ``seq_len`` tokens, padded (a mask present) or not."""

    size: int
    seq_len: int
    padded: bool = True  # the conservative case: packed windows are full, but each source's last one is not

    @property
    def tokens(self) -> int:
        return self.size * self.seq_len


FIRST_LAYER = "first trainable layer (its MoE block or dense MLP)"


def saved_activations(
    m: ModelFacts, first_layer: int, batch: Batch, c: int, targets: tuple[str, ...] = ("experts",)
) -> dict[str, int]:
    """Bytes autograd keeps between one training forward and its backward, by part.

    Args:
        m: the model.
        first_layer: the first trainable layer (MoE, or dense with the dense target); every layer above it is in
            the graph.
        batch: the microbatch.
        c: bytes per element of the compute dtype.
        targets: the trainable layers' sparse-delta targets (``--targets``).
    """
    spec = m.spec
    n = batch.tokens
    above = [layer for layer in range(first_layer + 1, spec.num_layers)]
    # The first trainable layer's input is a frozen function of the prefix: only the parts with a trainable
    # weight save anything. Experts alone: the router and routed experts; its attention and shared expert build
    # no graph. A trainable attention puts the rest of the layer in the graph (attention, the post-attention
    # norm, the whole MoE block); a trainable shared expert, that expert's input.
    dense_first = first_layer not in spec.moe_layers  # a dense layer (--targets dense): its MLP trains
    mlp = dense_mlp(m.dense_width or 0, n, c) if dense_first else moe_block(m, n, c)
    if "attention" in targets:
        a = m.attention
        # the sparse kernels keep their inputs (a frozen projection's backward needs only its weight): the normed
        # hidden state of q/k/v, MLA's normed latents, o_proj's input; this layer's SDPA keeps its own padding mask
        kernels = c * n * (spec.hidden_size + sum(a.latent_dims) + a.heads * a.v_head_dim)
        mask = batch.size * batch.seq_len**2 * c if batch.padded else 0
        first = attention(m, batch, c) + kernels + mask + rms_norm(n, spec.hidden_size) + mlp
    else:
        first = mlp if dense_first else moe_block(m, n, c, shared="shared" in targets)
    if dense_first:  # the dense MLP's sparse kernels keep their input, the normed state. An upper estimate: on the
        # tiny Qwen3 the whole graph measured 1.7 % below it (experts + dense) and 6.1 % (with attention)
        first += c * n * spec.hidden_size
    elif "shared" in targets and m.shared_width:  # measured: two (T, W) tensors more than a frozen shared expert keeps
        first += 2 * c * n * m.shared_width
    parts = {FIRST_LAYER: first}
    layers = 0
    for layer in above:
        layers += 2 * rms_norm(n, spec.hidden_size) + attention(m, batch, c)
        layers += moe_block(m, n, c) if layer in spec.moe_layers else dense_mlp(m.dense_width or 0, n, c)
    parts["layers above it (attention, norms, MLP)"] = layers
    once = 0
    if above:  # rotary cos/sin of the positions, and the padding mask, are shared by every layer
        once += 2 * batch.seq_len * m.attention.qk_head_dim * c
        if batch.padded:
            once += batch.size * batch.seq_len**2 * c
    parts["rotary tables and mask (once)"] = once
    scored = batch.size * (batch.seq_len - 1)
    parts["final norm and loss gradient"] = rms_norm(n, spec.hidden_size) + c * scored * spec.hidden_size
    return parts


def backward_workspace(
    m: ModelFacts, first_layer: int, batch: Batch, c: int, targets: tuple[str, ...] = ("experts",)
) -> int:
    """Gradients of one layer's intermediates, alive while that layer's backward runs: taken as the largest
    layer's saved activations (an estimate; on the CPU-sized model it closes the gap to the measured peak)."""
    spec, n = m.spec, batch.tokens
    largest = saved_activations(m, first_layer, batch, c, targets)[FIRST_LAYER]
    for layer in range(first_layer + 1, spec.num_layers):
        mlp = moe_block(m, n, c) if layer in spec.moe_layers else dense_mlp(m.dense_width or 0, n, c)
        largest = max(largest, 2 * rms_norm(n, spec.hidden_size) + attention(m, batch, c) + mlp)
    return largest


def rms_norm(n: int, width: int) -> int:
    return FP32 * n * width + FP32 * n


def attention(m: ModelFacts, batch: Batch, c: int) -> int:
    a = m.attention
    n, t = batch.tokens, batch.seq_len
    total = 0
    if a.qk_norm == "head":
        total += rms_norm(n * a.heads, a.qk_head_dim) + rms_norm(n * a.kv_heads, a.qk_head_dim)
    elif a.qk_norm == "full":
        total += rms_norm(n, a.q_dim) + rms_norm(n, a.k_dim)
    total += sum(rms_norm(n, d) for d in a.latent_dims)
    repeat = batch.padded or a.core != "fused"  # K/V are repeated per query head unless SDPA does GQA itself
    k_dim = a.heads * a.qk_head_dim if repeat else a.k_dim
    v_dim = a.heads * a.v_head_dim if repeat else a.v_dim
    columns = t + 1 if a.sinks else t
    if a.core == "fused":
        total += c * n * (a.q_dim + k_dim + v_dim + a.heads * a.v_head_dim)  # Q, K, V, output
        total += FP32 * batch.size * a.heads * t  # log-sum-exp
    elif a.core == "math":  # SDPA's math kernel computes in fp32: fp32 copies of Q, K, V and the probabilities
        total += FP32 * n * (a.q_dim + k_dim + v_dim) + FP32 * batch.size * a.heads * t * columns
    else:  # eager: the model's own matmuls and softmax, in the compute dtype
        total += c * n * (a.q_dim + k_dim + v_dim) + c * batch.size * a.heads * t * columns
        if a.sinks:
            total += INT64 * batch.size * a.heads * t  # the row max kept for the sink column
    return total


def moe_block(m: ModelFacts, n: int, c: int, *, shared: bool = True) -> int:
    """Router + routed experts (+ shared expert, when its input requires grad) of one MoE layer."""
    spec = m.spec
    e, k, h, i = spec.num_experts, spec.top_k, spec.hidden_size, spec.expert_width
    total = c * n * h  # the router's input (needed for the router's weight gradient)
    if c != FP32:
        total += e * h * c  # the fp32 master router, cast to the compute dtype
    kind = spec.router.kind
    if kind is RouterKind.TOPK_SOFTMAX:  # gpt-oss: softmax over the k chosen logits only
        total += INT64 * n * k + FP32 * n * k
    else:
        total += FP32 * n * e + INT64 * n * k  # probabilities over all experts, top-k indices
        if kind is RouterKind.SIGMOID_GROUP_TOPK:  # group scores, group choice, expert mask
            groups = spec.router.n_group or 1
            total += INT64 * n * 2 * groups + INT64 * n * (spec.router.topk_group or 1) + n * e
        if spec.router.renormalize:
            total += FP32 * n + c * n * k
    intermediates = 5 if m.clamped_gate else 2
    per_pair = c * (2 * h + (2 + intermediates) * i) + FP32 * h + 2 * INT64 + c
    total += n * k * per_pair
    if shared and m.shared_width:
        total += dense_mlp(m.shared_width, n, c)
        if m.shared_gated:  # sigmoid(gate(x)) * shared(x) keeps both factors
            total += c * n * h + c * n
    return total


def dense_mlp(width: int, n: int, c: int) -> int:
    """A gated MLP whose weights are frozen: the gate projection, its SiLU and the up projection."""
    return 3 * c * n * width


def loss_workspace(m: ModelFacts, batch: Batch) -> int:
    """Transient bytes of the chunked cross-entropy: one chunk's logits and what surrounds them."""
    return LOSS_WORKSPACE_PER_LOGIT * loss_chunk_rows(m, batch) * m.vocab


def loss_chunk_rows(m: ModelFacts, batch: Batch) -> int:
    """Positions per chunk of the loss (``usaf.engine.head_loss.next_token_loss``), at most the batch's."""
    return min(batch.size * (batch.seq_len - 1), max(1, CHUNK_LOGIT_BYTES // (FP32 * m.vocab)))


def sparse_kernel_workspace(
    m: ModelFacts, batch: Batch, frac: float, c: int, *, cpu: bool, targets: tuple[str, ...] = ("experts",)
) -> int:
    """The largest per-expert temporary of the sparse-delta kernels (one expert, or one linear target, at a time).

    Forward gathers a (tokens, entries) fp32 block; backward's gradient of the values gathers two of
    them, except on CPU in fp32, where ``torch.sparse.sampled_addmm`` needs none. A linear target (attention,
    shared) sees every token of the batch, an expert its share of them.
    """
    spec = m.spec
    blocks = 1 if (cpu and c == FP32) else 2
    largest = 0
    if "experts" in targets:
        mean_load = batch.tokens * spec.top_k / spec.num_experts
        tokens = min(CHUNK_TOKENS, batch.tokens, max(1, round(BUSIEST_EXPERT_LOAD * mean_load)))
        _, o, i = m.gate_up_shape  # the larger of the two tensors per expert
        largest = blocks * FP32 * tokens * max(1, int(frac * o * i)) + FP32 * tokens * o
    tokens = min(CHUNK_TOKENS, batch.tokens)
    for kind in targets:
        for o, i in m.linear_targets.get(kind, ()):
            largest = max(largest, blocks * FP32 * tokens * max(1, int(frac * o * i)) + FP32 * tokens * o)
    return largest


def grouped_delta_workspace(m: ModelFacts, batch: Batch, targets: tuple[str, ...] = ("experts",)) -> int:
    """The transients of a trainable layer's experts run grouped (``usaf.engine.grouped_deltas``, CUDA): at its
    backward's peak, one block's dense delta and its gradient (fp32, at most ``DELTA_BLOCK_BYTES`` each) and the
    block's rows of ``x`` and ``dy`` cast to fp32 (every routed row, at most)."""
    if "experts" not in targets:
        return 0
    e, o, i = m.gate_up_shape  # the larger of the two tensors per expert
    rows = batch.tokens * m.spec.top_k
    return 2 * min(DELTA_BLOCK_BYTES, FP32 * e * o * i) + FP32 * rows * (o + i)


def forward_workspace(m: ModelFacts, batch: Batch) -> int:
    """No-grad forward (eval): the larger of the loss of one sequence at a time, a chunk of positions at a time
    (taken as large as the training loss's working memory), and the check that the change moves the logits (two
    fp32 chunks of the whole batch's logits: ``usaf.stages.eval.passes.max_logit_change``; it was not counted, and
    eval peaked 19-21 % over its plan: found in review), plus a layer's hidden states.

    The layer term (eight (N, H) fp32 tensors: residual, norm, attention and MoE outputs) is an assumption,
    not a measurement.
    """
    n = batch.tokens
    check = 2 * FP32 * min(n, max(1, CHUNK_LOGIT_BYTES // (FP32 * m.vocab))) * m.vocab
    return max(loss_workspace(m, Batch(1, batch.seq_len)), check) + 8 * FP32 * n * m.spec.hidden_size


def capture_workspace(m: ModelFacts, batch: Batch, c: int) -> int:
    """A first visit's no-grad prefix capture of ``batch`` (a company: ``usaf.stages.train.companies``): one frozen
    layer's transients at a time, taken as what a training forward saves for that layer's attention and MoE block
    plus eight (N, H) fp32 tensors (residual, norm, attention and MoE outputs, as :func:`forward_workspace` assumes;
    an assumption, not a measurement). The dequantized experts are counted apart (``memory_plan.stages``)."""
    n = batch.tokens
    return attention(m, batch, c) + moe_block(m, n, c) + 8 * FP32 * n * m.spec.hidden_size
