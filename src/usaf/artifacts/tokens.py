"""The ``tokens`` artifact written by ``usaf tokenize``: packed sequences split by source."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register
from usaf.errors import UsafError

TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"


class TokenizerRecord(Record):
    name_or_path: str
    fingerprint: str = Field(description="sha256 of the tokenizer's files (tokenizer.json, config, template)")
    vocab_size: int
    eos_token_id: int
    model_max_length: int | None = None


class SourceCount(Record):
    source: str
    split: Literal["train", "heldout"]
    documents: int
    sequences: int
    tokens: int
    loss_tokens: int = Field(description="positions with a loss: a label not -100, the sequence's first excepted "
                             "(nothing before it predicts it)")


class TokensSummary(Record):
    tokenizer: TokenizerRecord
    seq_len: int
    stride: int
    train_sequences: int
    heldout_sequences: int
    train_tokens: int
    heldout_tokens: int
    train_loss_tokens: int
    heldout_loss_tokens: int
    documents: int
    input_bytes: int
    skipped_binary_files: int
    skipped_by_default: dict[str, int] = Field(
        default_factory=dict,
        description="paths a directory input skipped by default (--all-files reads them), by reason: hidden, "
        "environment, gitignore; a directory counts once",
    )
    skipped_empty_documents: int
    skipped_undecodable_files: int = Field(0, description="text files not UTF-8, skipped (--decode-errors skip)")
    skipped_wide_files: int = Field(
        0, description="UTF-16 or UTF-32 text files under a directory input, skipped (usaf reads UTF-8)"
    )  # said on the console only, the manifest recorded nothing skipped (found in review)
    replaced_undecodable_files: int = Field(
        0, description="text files not UTF-8, read with their bad bytes replaced by U+FFFD (--decode-errors replace)"
    )
    relabelled_shifted_lines: int = Field(description="pre-tokenized lines whose pre-shifted labels were unshifted")
    heldout_sources: list[str]
    sources: list[SourceCount]


@register
class TokensManifest(Manifest):
    KIND = "tokens"
    SCHEMA_VERSION = 1
    DESCRIPTION = "packed token sequences (train.jsonl, heldout.jsonl), held out by source"

    summary: TokensSummary


def check_tokenizer(path: Path, manifest: TokensManifest, tokenizer_fingerprint: str, *, flag: str) -> None:
    """Refuse tokens made with another tokenizer than the model's: their ids would mean other text.

    Raises:
        UsafError: naming ``flag path`` and both fingerprints.
    """
    made_with = manifest.summary.tokenizer
    if made_with.fingerprint != tokenizer_fingerprint:
        raise UsafError(
            f"{flag} {path}: tokenized with another tokenizer ({made_with.name_or_path}, fingerprint "
            f"{made_with.fingerprint[:16]}) than the model's (fingerprint {tokenizer_fingerprint[:16]})",
            "re-run usaf tokenize with --model pointing at this model",
        )


def check_tokens_file(file: Path, tokenizer_fingerprint: str, *, flag: str) -> None:
    """A sequences file of a usaf tokens directory, given by itself, is checked as its directory is: its ids mean
    the text of the tokenizer that directory's manifest names. ``--data TOKENS/train.jsonl`` skipped the check and
    trained a model on another tokenizer's ids in silence (found in review). Other JSONL files are the user's own:
    only their ids' range can be checked, which their readers do."""
    # lazy: the loader and outputs modules register and read manifests, of which this module defines one
    from usaf.artifacts.loader import load_verified
    from usaf.artifacts.outputs import manifest_kind

    directory = Path(file).parent
    if file.name not in (TRAIN_FILE, HELDOUT_FILE) or manifest_kind(directory) != TokensManifest.KIND:
        return
    manifest = load_verified(directory, TokensManifest, flag=flag, hashes=False)  # a file edited since: still its ids
    check_tokenizer(file, manifest, tokenizer_fingerprint, flag=flag)
