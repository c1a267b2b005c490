"""huggingface_hub's own log lines under usaf (usaf.data.hub.hub_logs_quiet): where the hub cannot be reached its
retries printed five pairs of lines before usaf's one error line (found in review, `usaf tokenize --model ORG/NAME`
offline). No network here: the retries' log records are emitted as huggingface_hub emits them."""

from __future__ import annotations

import logging

import huggingface_hub  # its logging setup: the handlers a user's run has

from usaf.data.hub import hub_logs_quiet

HTTP = "huggingface_hub.utils._http"


def retries() -> None:
    http = logging.getLogger(HTTP)
    for attempt in range(1, 4):
        http.warning("'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/x")
        http.warning(f"Retrying in {attempt}s [Retry {attempt}/5].")
    logging.getLogger("huggingface_hub.file_download").warning("some other hub warning")


def test_the_retries_are_said_once_in_usafs_words_and_the_loggers_restored(capfd):
    before = [(logging.getLogger(n).level, logging.getLogger(n).propagate) for n in ("huggingface_hub", HTTP)]
    with hub_logs_quiet():
        retries()
    said = capfd.readouterr().err
    assert said.count("the Hugging Face hub does not answer") == 1, said
    assert "thrown while requesting" not in said and "Retrying in" not in said and "other hub warning" not in said
    assert [(logging.getLogger(n).level, logging.getLogger(n).propagate) for n in ("huggingface_hub", HTTP)] == before
    assert not any(type(h).__name__ == "_FirstRetry" for h in logging.getLogger(HTTP).handlers)


def test_outside_the_block_the_hub_logs_as_it_does(capfd):
    """Control: the records above reach huggingface_hub's handlers when usaf does not quiet them."""
    logging.getLogger("huggingface_hub").addHandler(handler := logging.StreamHandler())
    try:
        retries()
    finally:
        logging.getLogger("huggingface_hub").removeHandler(handler)
    said = capfd.readouterr().err
    assert "Retrying in 1s" in said and "the Hugging Face hub does not answer" not in said


def test_a_rate_limit_is_not_called_a_hub_that_does_not_answer(capfd):
    """The hub answered (HTTP 429): its wait may be longer than a minute, and it is not unreachable."""
    with hub_logs_quiet():
        logging.getLogger(HTTP).warning("Rate limited. Waiting 90.0s before retry [Retry 1/5].")
    assert "does not answer" not in capfd.readouterr().err


def test_usaf_plan_of_a_hub_id_says_the_retries_once(monkeypatch, capfd):
    """`usaf plan ORG/NAME` offline printed the hub's retry lines too (found in review of the fix for tokenize)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from helpers import invoke

    def download(repo, filename, **kwargs):
        retries()
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, filename, **kwargs: None)
    result = invoke("plan", "someorg/somemodel")
    said = result.stderr + capfd.readouterr().err
    assert result.exit_code == 2 and "its config.json is not in the local Hugging Face cache" in said, said
    assert "someorg/somemodel: no such directory, and as a hub id" in " ".join(said.split())  # a typo'd path (review)
    assert said.count("the Hugging Face hub does not answer") == 1 and "Retrying in" not in said


def test_a_mistyped_local_name_is_no_such_directory_at_once(monkeypatch, tmp_path):
    """``usaf tokenize notes.txt --model tiny-mo`` (a typo of a local directory) went to the hub, a minute of retries
    offline, and never said that no such directory exists; quantize said "not in the local Hugging Face cache" (found
    in review). A name with no ORG/ is no MoE hub id: refused at once, the hub never asked. The control: an ORG/NAME
    id is still looked up."""
    from helpers import invoke

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **k: asked.append(repo) or 1 / 0)
    (tmp_path / "notes.txt").write_text("hello\n")
    for command in (["tokenize", tmp_path / "notes.txt", "--model", "tiny-mo"], ["quantize", "tiny-mo"]):
        result = invoke(*command)
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and "tiny-mo: no such directory (and not a hub id, which reads ORG/NAME)" in said
    assert asked == []
    # a typo under a directory that is here (ws/tiny-mo) took 49 s of hub retries in tokenize (found in review)
    (tmp_path / "ws").mkdir()
    monkeypatch.chdir(tmp_path)
    typo = "ws/tiny-mo"  # relative: the shape of a local path, and of a hub id
    for command in (["tokenize", tmp_path / "notes.txt", "--model", typo], ["quantize", typo]):
        said = " ".join(invoke(*command).stderr.split())
        assert f"{typo}: no such directory" in said, said
    assert asked == []
    assert invoke("quantize", "someorg/tiny-mo").exit_code != 0 and asked == ["someorg/tiny-mo"]

