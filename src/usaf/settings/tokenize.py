"""Settings of ``usaf tokenize``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import cli


class TokenizeConfig(StageConfig):
    """Settings of ``usaf tokenize``; each field's description is its flag's help."""

    inputs: list[Path] = Field(
        default_factory=list,
        description="Text files, directories (recursive) and JSONL files (text, chat 'messages', or input_ids).",
        json_schema_extra=cli(argument=True),
    )
    model: str | None = Field(None, description="Model directory or hub id whose tokenizer to use.",
                              json_schema_extra=cli(names_a_path=True))  # fmt: skip
    out: Path | None = f.out_dir("tokens")
    workspace: Path | None = f.workspace()
    seq_len: int = f.seq_len_field(512)
    stride: int = Field(
        0, ge=0, description="Overlap of consecutive sequences (tokens); overlapped tokens get label -100."
    )
    text_field: str = Field("text", min_length=1, description="JSONL field holding the text.")
    source_field: str = Field(
        "source", min_length=1, description="JSONL field naming the source (else 'repo', else the file)."
    )
    source_depth: int = Field(1, ge=0, description="Path components under a directory input that name a file's source.")
    # what the globs match was said nowhere: --include data/x.py matched nothing, --held-out data/x.py did (review)
    include: list[str] = Field(
        default_factory=list,
        description="Only files matching this glob (repeatable), read as .gitignore reads it: with a /, from the "
        "input's top (src/*.py, ** for any depth) or its name (repo/src/*.py); without, any file or directory name "
        "(*.py, tests); a directory's match takes everything under it.",
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="Skip files matching this glob (repeatable), matched as --include is.",
    )
    follow_symlinks: bool = Field(
        True,
        description="Follow symbolic links under directory inputs (each real directory and file is read once); "
        "--no-follow-symlinks skips them and says how many.",
    )
    all_files: bool = Field(
        False,
        description="Also read what directory inputs skip by default: hidden files and directories, environments "
        "(pyvenv.cfg, conda-meta, node_modules) and what git ignores (.gitignore).",
    )
    held_out: list[str] = Field(
        default_factory=list,
        description="Hold out this source (glob on source names: an input's name, and under a directory input the "
        "first --source-depth parts of a file's path, as src/util.py; repeatable): its sequences go to heldout.jsonl.",
        json_schema_extra=cli(own_only=True),  # source globs here, paths to eval: not from a shared source
    )
    held_out_frac: float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this fraction of sources, chosen by --seed.",
        json_schema_extra=cli(alternative_to="held_out"),
    )  # fmt: skip
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the --held-out-frac choice.")
    decode_errors: Literal["strict", "replace", "skip"] = Field(
        "strict", description="Non-UTF-8 text files: strict (error) | replace | skip."
    )
    fix_shifted_labels: bool = Field(False, description="Unshift pre-shifted labels in pre-tokenized JSONL input.")
    trust_remote_code: bool = Field(False, description="Allow a hub tokenizer's own Python code to run.")
    overwrite: bool = f.overwrite()

    @model_validator(mode="after")
    def _cross_field(self) -> TokenizeConfig:
        problems = []
        if not self.inputs:
            problems.append("no INPUTS given: pass text files, directories or JSONL files")
        if self.model is None:
            problems.append("--model is required: the model (directory or hub id) whose tokenizer to use")
        if self.stride >= self.seq_len:
            problems.append(f"--stride {self.stride} must be smaller than --seq-len {self.seq_len}")
        if self.held_out and self.held_out_frac:
            problems.append("pass either --held-out or --held-out-frac, not both")
        if problems:
            raise ValueError("; ".join(problems))
        return self
