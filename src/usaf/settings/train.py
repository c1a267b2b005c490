"""Settings of ``usaf train`` (each also ``USAF_<NAME>`` and a ``[train]`` TOML key)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PrivateAttr, model_validator

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import Budget, ComputeDtype, DistBackend, Statistic, Targets, cli

DEFAULT_LR = 3e-3  # the deltas' lr when neither --lr nor the plan's lr test gives one (the evidence benchmark's)
# The routers' lr: 1e-3 was better in-domain than 1e-4 on all 6 torch-cpp seeds of both evidence models, for a little
# more forgetting (docs/ARCHITECTURE.md, "Defaults set by the evidence benchmark"; BENCHMARKS.md, "The router lr").
DEFAULT_ROUTER_LR = 1e-3

# A first visit computes the frozen-prefix states of its company at once (usaf.stages.train.companies): as many whole
# microbatches as fit in this many tokens (at least one microbatch). Of captures of 1 to
# 16 sequences of 256 tokens on CPU (docs/BENCHMARKS.md, "A first visit's prefix capture"), 4 ran fastest or within
# 6 % of the fastest at the three shapes measured with the experts dequantized once (the mode train chooses where
# they fit), and within 10 % per forward, where 8-16 were fastest at 128 experts; at 32 experts 8 and more lost to 4,
# the working set leaving the cache. The memory plan counts the capture's transients at this size
# (usaf.memory_plan.activations.capture_workspace).
COMPANY_TOKENS = 1024


def company_size(microbatch: int, seq_len: int, world_size: int) -> int:
    """Sequences per company: the most whole microbatches within :data:`COMPANY_TOKENS` of ``seq_len`` tokens each,
    at least one. Under data parallel one microbatch: a company of several would hold other ranks' sequences (a
    step's positions are dealt to the ranks in contiguous shares), computed by a rank that never trains them."""
    if world_size > 1:
        return microbatch
    return microbatch * max(1, COMPANY_TOKENS // max(1, seq_len * microbatch))


class TrainConfig(StageConfig):
    """Settings of ``usaf train`` (each also ``USAF_<NAME>`` and a ``[train]`` TOML key)."""

    model: Path | None = f.quantized_model()
    data: Path | None = Field(
        None, description="Tokens directory or JSONL.", json_schema_extra=cli(default_text="newest matching the model")
    )
    plan: Path | None = Field(
        None,
        description="Plan from usaf score; it decides the selection (--frac, --train-from, --layers, ...).",
        json_schema_extra=cli(default_text="newest for the model, else scored now into RUN/plan",
                              remedy="re-run usaf score with it"),
    )  # fmt: skip
    eval_data: Path | None = Field(None, description="Held-out tokens (a tokens dir uses its heldout.jsonl).")
    out: Path | None = f.out_dir("run", "Run directory.")
    workspace: Path | None = f.workspace()
    frac: float | None = f.frac()
    train_from: int | None = f.train_from()
    layers: list[int] | None = f.layers()
    statistic: Statistic = f.statistic()
    budget: Budget = f.budget()
    targets: Targets | None = f.targets()
    steps: int | None = Field(None, ge=1, description="Optimizer steps (or --epochs).")
    epochs: float | None = Field(
        None, gt=0, le=10_000, description="Passes over the data.",
        json_schema_extra=cli(default_text="1", alternative_to="steps"),
    )  # fmt: skip
    microbatch: int = Field(2, ge=1, description="Sequences per forward.")
    grad_accum: int = Field(1, ge=1, description="Microbatches per optimizer step.")
    lr: float | None = Field(
        None, gt=0, description="Peak learning rate of the deltas (docs/ARCHITECTURE.md: the evidence).",
        json_schema_extra=cli(default_text=f"the plan's (usaf score's lr test), else {DEFAULT_LR:g}"),
    )  # fmt: skip
    router_lr: float = Field(DEFAULT_ROUTER_LR, ge=0, description="Peak learning rate of the routers.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled, toward the pretrained weights.")
    clip: float | None = Field(1.0, gt=0, description="Gradient-norm clip over all trainables.")
    warmup: float = Field(0.05, ge=0, lt=1, description="Warmup as a fraction of the run.")
    reselect_every: int | None = Field(
        None, ge=0, description="Steps between RigL reselections; 0 = static mask.",
        json_schema_extra=cli(default_text="50; static where none would replace anything (runs of <= 66 steps; "
                                           "a small plan's longer ones)"),
    )  # fmt: skip
    seq_len: int | None = f.seq_len_field(None, "Cut longer sequences to N tokens.", default_text="as tokenized")
    reselect_fraction: float = Field(0.2, ge=0, le=1, description="Initial fraction replaced, cosine to 0 at 75%.")
    aux_loss_coef: float = Field(
        0.0, ge=0,
        description="Weight of the load-balancing loss: the family's own, per trainable layer, averaged.",
    )  # fmt: skip
    z_loss_coef: float = Field(0.0, ge=0, description="Router z-loss weight.")
    router: bool = Field(True, description="Train the routers.")
    dense_router_grad: bool = Field(
        False,
        description="DenseMixer's router gradient: the routers learn from every expert's output, not only the "
        "top-k's (forward unchanged; one extra pass over the trained layers' experts per backward).",
    )
    eval_every: int = Field(0, ge=0, description="Held-out loss every N steps; 0 = at the start and end only.")
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps; 0 = none (Ctrl-C still saves one).")
    keep_checkpoints: int | None = Field(
        None, ge=1,
        description="Keep the newest N checkpoints (and, of those where the held-out loss was measured, the lowest), "
        "deleting older ones as each is written.",
        json_schema_extra=cli(default_text="all"),
    )  # fmt: skip
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the data order.")
    deterministic: bool = Field(
        False,
        description="Bit-reproducible on a GPU: torch's deterministic kernels (slower), so equal runs, and a resumed "
        "run and the straight one, give the same bytes. The CPU's kernels always are.",
    )
    device: str = f.device()
    dtype: ComputeDtype = Field(
        "auto", description="auto | float32 | bfloat16 | float16 (with dynamic loss scaling); auto: bf16 where "
        "native, else fp16 + loss scaling; fp32 on CPU.",
    )  # fmt: skip
    calib_samples: int = f.calib_samples()
    prefix_cache_gib: float = Field(
        2.0, ge=0, le=2**20, description="RAM for cached frozen-prefix states before they spill to the run's disk file."
    )
    stream_experts: bool | None = f.stream_experts()
    vram: str | None = Field(
        None,
        description="Device memory budget (12GiB, ...): usaf plan picks --microbatch, --grad-accum, --stream-experts, "
        "--prefix-cache-gib and (without a plan) --train-from where not given.",
        json_schema_extra=cli(default_text="this device's"),
    )
    ram: str | None = Field(
        None, description="Host memory budget (32GiB, ...) for the same choice.",
        json_schema_extra=cli(default_text="this machine's"),
    )  # fmt: skip
    dist_backend: DistBackend = f.dist_backend()
    resume: bool = Field(
        False, description="Continue the interrupted run in --out, with the settings it recorded for those not given."
    )
    overwrite: bool = f.overwrite("Replace --out.")
    # settings --resume took from the interrupted run's record, not given: where they came from, for what is said of
    # them (a resumed lr was "from --lr", which nobody passed; found in review)
    _from_record: frozenset[str] = PrivateAttr(default_factory=frozenset)
    # under --vram/--ram, the planner's choice for the frozen layers' experts (dequantized once or per forward); None:
    # decided from the free memory. Decided from the free memory under a budget, a 1 GiB --ram run peaked at 1.27 GiB
    # (found in review)
    _frozen_resident: bool | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _length(self) -> TrainConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("pass either --steps or --epochs, not both")
        if self.train_from is not None and self.layers is not None:  # as score refuses them, before it is called
            raise ValueError("pass either --train-from or --layers, not both")
        if self.steps is not None and self.reselect_every is not None and self.reselect_every > self.steps:
            raise ValueError(
                f"--reselect-every {self.reselect_every} exceeds --steps {self.steps}; "
                "lower it or pass 0 for a static mask"
            )
        if self.resume and self.overwrite:  # --overwrite deletes what --resume would continue
            raise ValueError("pass either --resume (continue the run in --out) or --overwrite (replace it), not both")
        if self.dense_router_grad and not self.router:
            raise ValueError("--dense-router-grad changes only the routers' gradient; --no-router trains none")
        return self
