"""Typed artifacts: manifests, atomic writes, loading with checks, and workspace conventions."""

from usaf.artifacts import delta as _delta  # noqa: F401  (registers 'delta')
from usaf.artifacts import eval_report as _eval_report  # noqa: F401  (registers 'eval_report')
from usaf.artifacts import hf_export as _hf_export  # noqa: F401  (registers 'hf_export')
from usaf.artifacts import plan as _plan  # noqa: F401  (registers 'plan')
from usaf.artifacts import quantized as _quantized  # noqa: F401  (registers 'quantized_model')
from usaf.artifacts import run as _run  # noqa: F401  (registers 'run')
from usaf.artifacts import tokens as _tokens  # noqa: F401  (registers the 'tokens' kind)
from usaf.artifacts.delta import DeltaManifest
from usaf.artifacts.eval_report import EvalReportManifest
from usaf.artifacts.hf_export import HfExportManifest
from usaf.artifacts.loader import load_manifest, load_verified, verify_files
from usaf.artifacts.manifest import (
    MANIFEST_KINDS,
    MANIFEST_NAME,
    EnvironmentRecord,
    FileRecord,
    InputRecord,
    Manifest,
    current_environment,
    register,
)
from usaf.artifacts.plan import PlanManifest
from usaf.artifacts.quantized import QuantizedModelManifest
from usaf.artifacts.run import RunManifest
from usaf.artifacts.tokens import TokensManifest, TokensSummary
from usaf.artifacts.workspace import default_output, find_artifacts, pick_latest, settings_workspace, workspace_dir
from usaf.artifacts.writer import ArtifactWriter

EXPORT_KINDS = (HfExportManifest.KIND, DeltaManifest.KIND)  # usaf export's formats: its --overwrite replaces either

__all__ = [
    "EXPORT_KINDS",
    "MANIFEST_KINDS",
    "MANIFEST_NAME",
    "ArtifactWriter",
    "DeltaManifest",
    "EnvironmentRecord",
    "EvalReportManifest",
    "FileRecord",
    "HfExportManifest",
    "InputRecord",
    "Manifest",
    "PlanManifest",
    "QuantizedModelManifest",
    "RunManifest",
    "TokensManifest",
    "TokensSummary",
    "current_environment",
    "default_output",
    "find_artifacts",
    "load_manifest",
    "load_verified",
    "pick_latest",
    "register",
    "verify_files",
    "settings_workspace",
    "workspace_dir",
]
