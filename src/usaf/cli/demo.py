"""``usaf demo``: tokenize → quantize → score → train → eval (→ export) on the built-in default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from usaf.cli.flags import settings_command


def _run(cli: dict[str, Any], *, config: Path | None, json_output: bool, verbose: bool) -> None:
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.cli.console import out, print_json
        from usaf.cli.eval_ import _print_summary as print_eval
        from usaf.cli.progress import RichProgress
        from usaf.config import resolve_config
        from usaf.settings.demo import DemoConfig
        from usaf.stages import demo

        settings = resolve_config(DemoConfig, section="demo", cli=cli, config_file=config)
        done: list = []

        def show(step) -> None:
            done.append(step)
            if not json_output:
                state = "reused" if step.reused else "done"
                out.print(f"[bold green]✓[/] {step.name:9s} {state:6s} → {step.path}")

        manifest, path = demo.run(settings, progress=RichProgress(), on_step=show)
        if json_output:
            groups = demo.outcomes(settings, json.loads((path / "report.json").read_text()))
            print_json({"path": str(path), "stages": {s.name: str(s.path) for s in done},
                        "outcomes": [vars(g) for g in groups], **manifest.model_dump(mode="json")})  # fmt: skip
            return
        print_eval(out, manifest, path)
        _print_outcomes(out, demo.outcomes(settings, json.loads((path / "report.json").read_text())))
        out.print("\nThe same, step by step:")
        for step in done:
            out.print(demo.shell_line(step.command), markup=False, highlight=False, soft_wrap=True)


command = settings_command(
    "usaf.settings.demo:DemoConfig",
    _run,
    doc="""Fine-tune the built-in pretrained MoE on stdlib sources it never saw, end to end, with no download.

    Shows every stage, the before/after table, and the shell commands that do the same step by step.
    Rerunning reuses finished stages and resumes the stage Ctrl-C stopped (quantize, score, training or eval).
    """,
)


def _print_outcomes(console, groups) -> None:
    from rich.table import Table

    table = Table(title="before → after (perplexity, lower is better)", title_justify="left")
    for column in ("evaluated on", "sources", "tokens", "base", "fine-tuned", "change"):
        table.add_column(column, justify="left" if column == "evaluated on" else "right")
    for g in groups:
        tuned = "-" if g.tuned_ppl is None else f"{g.tuned_ppl:.2f}"
        change = "-" if g.tuned_ppl is None else f"{100 * (g.tuned_ppl / g.base_ppl - 1):+.1f} %"
        table.add_row(g.group, str(g.sources), f"{g.tokens:,}", f"{g.base_ppl:.2f}", tuned, change)
    console.print(table)
