"""The ``eval_report`` artifact written by ``usaf eval``: base vs fine-tuned perplexity and routing drift."""

from __future__ import annotations

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register

REPORT_JSON = "report.json"  # the summary below, as JSON
REPORT_MD = "report.md"
PLOTS_DIR = "plots"


class Estimate(Record):
    """A token-weighted mean NLL over sequences, its perplexity and their bootstrap interval."""

    nll: float = Field(description="token-weighted mean negative log-likelihood, nats per token")
    ppl: float = Field(description="exp(nll)")
    nll_ci: list[float] | None = Field(description="[low, high] percentile bootstrap interval; None below 2 sequences")
    ppl_ci: list[float] | None


class Difference(Record):
    """Fine-tuned minus base on the same sequences (paired bootstrap: one resample drives both)."""

    nll: float
    ppl: float
    nll_ci: list[float] | None
    ppl_ci: list[float] | None
    excludes_zero: bool | None = Field(description="the interval lies entirely on one side of 0")


class ResultRow(Record):
    set: str = Field(description="'data' (in-domain, --data) or 'held-out' (--held-out)")
    source: str = Field(description="a source (repository, file group), or 'all' on a total row")
    overall: bool = Field(description="a total row: of one input (input set) or of the whole set (input None)")
    input: str | None = Field(
        None,
        description="the --data/--held-out input the row's sequences come from; None on the set's overall row. "
        "A set with several inputs has one total row per input, then its overall row",
    )
    sequences: int = Field(description="sequences with at least one scored token")
    tokens: int = Field(description="scored tokens (labels not -100, after the shift)")
    base: Estimate
    tuned: Estimate | None
    delta: Difference | None


class LayerDrift(Record):
    layer: int
    experts: int
    base_tokens_per_expert: list[int]
    base_entropy: float = Field(description="entropy of the expert-load distribution, nats (max log E)")
    base_max_share: float
    base_dead: int
    tuned_tokens_per_expert: list[int] | None
    tuned_entropy: float | None
    tuned_max_share: float | None
    tuned_dead: int | None
    changed_fraction: float | None = Field(description="share of tokens whose top-k expert set differs from the base")


class InputSummary(Record):
    set: str
    flag: str
    path: str
    kind: str = Field(description="'tokens' (artifact), 'tokens-jsonl', or 'text' (tokenized on the fly)")
    fingerprint: str
    sequences: int
    tokens: int = Field(description="scored tokens")
    unscored: int = Field(
        0,
        description="of the sequences, those with no scored token (every label -100, or 1 token long): in no row, "
        "whose counts were then short of this input's without a word (found in review)",
    )
    sampled_from: int | None = Field(
        None,
        description="the sequences the input holds, where a seeded sample of them was evaluated (--max-sequences, or "
        "eval's default sample of a training split it picked itself); None: all of them",
    )


class PassSummary(Record):
    sequences: int
    input_tokens: int = Field(description="tokens run through the model (padding excluded)")
    seconds: float
    tokens_per_s: float
    cached: bool = Field(description="read from the base cache instead of computed")
    first_layer: int = Field(
        0, description="the first decoder layer the pass ran (the fine-tuned pass starts at the first trainable layer "
        "from the base pass's states), so its tokens/s is not the whole model's"
    )


class EvalSummary(Record):
    model_fingerprint: str
    checkpoint: str | None = Field(description="the run or checkpoint evaluated; None = base model only")
    checkpoint_fingerprint: str | None
    trainable_layers: list[int]
    data_fingerprint: str = Field(description="sha256 over the evaluated sequences (set, source, ids, labels)")
    base_cache_key: str
    base_cache: str | None = Field(description="the cache entry used or written; None with --no-base-cache")
    base_cached: bool = Field(description="the base pass was reused from the cache")
    max_logit_change: float | None = Field(
        description="max |tuned - base| logit on the batch of the most real tokens (> 0: applied)"
    )
    experts_resident: bool = Field(description="experts dequantized once (else per forward, or no pass ran)")
    compute_dtype: str | None = Field(
        None, description="the dtype both passes computed in (--dtype); None: a report from before it was recorded"
    )
    inputs: list[InputSummary]
    rows: list[ResultRow]
    routing: list[LayerDrift]
    bootstrap_samples: int
    confidence: float
    seed: int
    base_pass: PassSummary
    tuned_pass: PassSummary | None
    plots: list[str] = Field(description="PNG files under plots/")
    plots_note: str | None = Field(description="why plots are missing, when they are")
    heldout_in_training: int | None = Field(
        None,
        description="held-out sequences found verbatim (the same token ids) in the evaluated run's training tokens: "
        "their perplexity is fit, not generalization; a floor (text packed otherwise is not found). None: not checked "
        "(no held-out input, no finished run, or its tokens not found)",
    )
    overlap_note: str | None = Field(None, description="what heldout_in_training means here, or why it is None")
    seconds: float


@register
class EvalReportManifest(Manifest):
    KIND = "eval_report"
    SCHEMA_VERSION = 1
    DESCRIPTION = "base vs fine-tuned perplexity per source with bootstrap intervals, and routing drift"

    summary: EvalSummary
