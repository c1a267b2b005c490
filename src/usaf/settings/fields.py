"""Fields that several commands share, and the metadata that turns a field into a flag.

A field becomes ``--kebab-name``; its description is the flag's help, and ``[default: …]`` is written from
its default (or from ``default_text`` where the default is computed at run time). Metadata keys, all
optional, under ``json_schema_extra={"cli": {...}}``:

- ``argument``: a positional argument instead of an option;
- ``flag``: the declaration where the rule does not give it (``"--resident/--streaming"``); booleans are
  otherwise a plain switch ``--x`` when they default to False, ``--x/--no-x`` when they default to True/None;
- ``alias``: a second name for the option (quantize's ``--force`` is also ``--overwrite``, every other command's name
  for it); messages name the first;
- ``default_text``: what ``[default: …]`` says (``""``: nothing);
- ``hidden``: not a flag (a ``--config``/``USAF_*`` setting only);
- ``min``/``max``: checked by the command line itself (a usage error);
- ``names_a_path``: a text field naming a directory or a hub id, refused empty on the command line as a path field
  is (``--base ""`` read as the current directory);
- ``decided_by``: the field whose artifact decides this one (``"plan"``); a value given on the command line
  or in the command's own TOML table while that field is set is refused, one from a shared source
  ([defaults], ``USAF_*``, legacy variables) is dropped (:func:`usaf.config.resolve_config`);
- ``remedy`` (on a deciding field): how to get another value of the fields it decides;
- ``alternative_to``: the field this one is a choice against (``epochs`` and ``steps``): from sources of
  different precedence the higher one's wins, the other is dropped;
- ``own_only``: read from the flag and the command's own TOML table only, never from ``USAF_*``, ``[defaults]``
  or a legacy variable, where the name means something else to other commands (export's ``dtype``, the stored
  tensors' dtype, is train's compute dtype elsewhere: ``USAF_DTYPE=auto`` failed every export; ``held_out``), or
  where a value set once for every command would delete work (``overwrite``, quantize's ``force``). Set in a shared
  source that no command reads it from, it is refused (:func:`usaf.config.resolve_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

FRAC = 0.005  # the default share of the trainable layers' expert weights (score, train, plan)
# Without --frac, small trainable sets get a larger share: enough for MIN_ENTRIES expert weights, at most
# FLOOR_FRAC_CAP (docs/ARCHITECTURE.md, "Defaults set by the evidence benchmark": 0.005 of a small model's layer
# trains too few weights).
MIN_ENTRIES = 100_000
FLOOR_FRAC_CAP = 0.1

# Which layers and weights train: chosen by usaf score, or by train when it scores on the fly.
SELECTION_FIELDS = ("frac", "train_from", "layers", "calib_samples", "statistic", "budget", "targets")

# The weights of a trainable layer that may carry a sparse delta (usaf.families.targets spells their modules).
TARGETS = ("experts", "attention", "shared", "dense")
# Without --targets: these, and the shared experts where the model has them (usaf.families.targets.default_targets;
# docs/ARCHITECTURE.md, "Defaults set by the evidence benchmark").
DEFAULT_TARGETS = ("experts", "attention")
DEFAULT_TARGETS_TEXT = "experts,attention, and shared where the model has shared experts"
EXPERTS_ONLY = ("experts",)  # what a plan or change from before --targets trained; the engine's library default


def parse_targets(text: str | Iterable[str]) -> tuple[str, ...]:
    """``"attention, experts"`` (or a sequence of names) -> ``("experts", "attention")`` (in :data:`TARGETS` order).

    Raises:
        ValueError: an unknown or repeated name, or none (the message lists the valid ones).
    """
    parts = text.split(",") if isinstance(text, str) else [str(n) for n in text]
    names = [n.strip() for n in parts if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown target {unknown[0]!r}; choose from {', '.join(TARGETS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a target is named twice in {text!r}")
    if not names:
        raise ValueError(f"no target given; choose from {', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


Targets = Annotated[str, AfterValidator(lambda text: ",".join(parse_targets(text)))]  # None: the model's default


def default_frac(weights: int) -> float:
    """The share of ``weights`` (the trainable layers' expert weights) selected when ``--frac`` is not given.

    :data:`FRAC`, raised to ``MIN_ENTRIES / weights`` where it would select fewer than :data:`MIN_ENTRIES`, at
    most to :data:`FLOOR_FRAC_CAP`. An explicit ``--frac`` is always used as given.
    """
    if weights <= 0 or FRAC * weights >= MIN_ENTRIES:
        return FRAC
    return max(FRAC, min(FLOOR_FRAC_CAP, MIN_ENTRIES / weights))


FRAC_DEFAULT_TEXT = f"{FRAC:g}; on small layers enough for {MIN_ENTRIES:,} weights, at most {FLOOR_FRAC_CAP:g}"

Statistic = Literal["grad", "grad2", "grad_x_weight"]
Budget = Literal["per-tensor", "per-layer", "global", "per-expert"]
DistBackend = Literal["auto", "gloo", "nccl"]
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]


def cli(**meta: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field: how it appears on the command line (keys in the module docstring)."""
    return {"cli": meta}


# -- paths and places ---------------------------------------------------------------------------------------


def quantized_model(default_text: str = "newest in the workspace") -> Any:
    return Field(None, description="Quantized model directory.", json_schema_extra=cli(default_text=default_text))


def out_dir(kind: str, what: str = "Output directory.") -> Any:
    return Field(None, description=what, json_schema_extra=cli(default_text=f"WORKSPACE/{kind}/<time>-<name>"))


def workspace() -> Any:
    return Field(
        None,
        description="Where stages write by default and look for their inputs (also USAF_WORKSPACE).",
        json_schema_extra=cli(default_text="current dir"),
    )


def checkpoint(default_text: str = "newest run for the model") -> Any:
    return Field(
        None,
        description="Run, checkpoints/step-N or delta directory.",
        json_schema_extra=cli(default_text=default_text),
    )


def device(default: str | None = "auto", **meta: Any) -> Any:
    return Field(
        default,
        min_length=1,  # an empty --device "" ran on what auto found (found in review); an empty USAF_DEVICE is unset
        description="auto|cpu|cuda|cuda:N|mps|directml (also USAF_DEVICE; legacy USE_CUDA=1 means cuda).",
        json_schema_extra=cli(**meta),
    )


def overwrite(description: str = "Replace the output directory if it exists.") -> Any:
    # own_only: USAF_OVERWRITE=1 or [defaults] overwrite, set once, started every interrupted run over without a word
    # (found in review); what deletes work is asked for on the command line or in the command's own table
    return Field(False, description=description, json_schema_extra=cli(own_only=True))


def stream_experts() -> Any:
    return Field(
        None,
        description="Keep the 4-bit experts in host memory and stream the frozen layers' to the device one layer "
        "ahead.",
        json_schema_extra=cli(default_text="when they would take over half the free device memory"),
    )


def dist_backend() -> Any:
    return Field("auto", description="Under torchrun: auto | gloo | nccl.",
                 json_schema_extra=cli(default_text="nccl on CUDA, else gloo"))  # fmt: skip


# -- the selection (score, train; plan's frac) ---------------------------------------------------------------

_DECIDED = cli(decided_by="plan")  # ignored by a command without a plan field (score)


def frac(default: float | None = None, **meta: Any) -> Any:
    """``None``: :func:`default_frac` of the trainable layers' size, decided by usaf score."""
    text = {"default_text": FRAC_DEFAULT_TEXT} if default is None else {}
    return Field(default, gt=0, lt=1, description="Fraction of the trainable layers' target weights (--targets).",
                 json_schema_extra=cli(**{**_DECIDED["cli"], **text, **meta}))  # fmt: skip


# usaf score's trainable block when neither --train-from nor --layers is given (stages.score.DEFAULT_TOP_FRACTION)
TOP_LAYERS_TEXT = "the top quarter of the MoE layers"


def train_from() -> Any:
    # one choice with --layers: from sources of different precedence the higher one's wins (USAF_LAYERS with
    # --train-from gave train a pydantic traceback from the plan it scored; found in review)
    return Field(None, ge=0, description="First trainable layer (every MoE layer from it up).",
                 json_schema_extra=cli(decided_by="plan", default_text=TOP_LAYERS_TEXT,
                                       alternative_to="layers"))  # fmt: skip


def layers() -> Any:
    return Field(None, description="A trainable MoE layer (repeatable).", json_schema_extra=_DECIDED)


def calib_samples() -> Any:
    return Field(64, ge=1, description="Calibration sequences.", json_schema_extra=_DECIDED)


def statistic() -> Any:
    return Field("grad", description="grad (|g|) | grad2 (g²) | grad_x_weight (|w·g|).", json_schema_extra=_DECIDED)


def targets() -> Any:
    """``None``: the model's default targets (:data:`DEFAULT_TARGETS_TEXT`), decided by usaf score."""
    return Field(None, json_schema_extra=cli(**{**_DECIDED["cli"], "default_text": DEFAULT_TARGETS_TEXT}),
                 description=f"Weights that get sparse deltas, comma-separated: {', '.join(TARGETS)} (dense: the "
                 "MLPs of dense layers at or above --train-from; the routers: --router).")  # fmt: skip


def budget() -> Any:
    return Field("per-tensor", description="per-tensor | per-layer | global | per-expert: how --frac is spread.",
                 json_schema_extra=_DECIDED)  # fmt: skip


def seq_len_field(default: int | None, description: str = "Tokens per sequence.", **meta: Any) -> Any:
    return Field(default, ge=2, description=description, json_schema_extra=cli(**meta))
