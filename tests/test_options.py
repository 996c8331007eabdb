"""One option, one meaning: every option that several commands take has the same name and
the same default in each of them, and every command that writes results answers to both
``--output`` and ``--out``."""

from __future__ import annotations

from typing import Any

import typer

from autotune.cli import app

# Options that name the same thing wherever they appear.
SHARED = ("--num-prompts", "--warmup", "--seed", "--studies-dir", "--tol", "--max-probes",
          "--headroom", "--backlog-share", "--min-duration", "--max-duration", "--tokenizer",
          "--gpu-ids", "--slo-p99", "--slo", "--profile", "--validate", "--storage",
          "--max-model-len")
WRITERS = ("bench", "ceiling", "calibrate", "sweep", "report", "recommend")


def commands() -> dict[str, Any]:
    # Typed loosely: typer ships its own copy of click, so click's classes do not match.
    group: Any = typer.main.get_command(app)
    return dict(group.commands)


def options_of(cmd: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in cmd.params:
        if p.param_type_name == "option":
            for name in p.opts:
                out[name] = p
    return out


def test_shared_options_have_one_default_everywhere() -> None:
    seen: dict[str, dict[str, Any]] = {}
    for name, cmd in commands().items():
        for opt, p in options_of(cmd).items():
            if opt in SHARED:
                seen.setdefault(opt, {})[name] = p.default
    assert set(seen) >= {"--num-prompts", "--warmup", "--seed", "--tol"}
    differ = {opt: by_cmd for opt, by_cmd in seen.items()
              if len({repr(v) for v in by_cmd.values()}) > 1}
    assert differ == {}
    assert {seen["--num-prompts"][c] for c in seen["--num-prompts"]} == {1000}
    assert {seen["--warmup"][c] for c in seen["--warmup"]} == {100}


def test_gpu_ids_is_a_list_and_gpus_a_count_in_every_command() -> None:
    for name, cmd in commands().items():
        opts = options_of(cmd)
        if "--gpus" in opts:
            assert opts["--gpus"].bare_type() == "int", name  # a count
        if "--gpu-ids" in opts:
            assert opts["--gpu-ids"].bare_type() == "str", name  # a list such as 0,1


def test_every_command_that_writes_results_takes_output_and_out() -> None:
    cmds = commands()
    for name in WRITERS:
        opts = options_of(cmds[name])
        assert "--output" in opts and "--out" in opts, name
        assert opts["--output"] is opts["--out"], name  # two names of one option


def shared_table() -> str:
    """docs/options.md's table of shared options, from the commands themselves."""
    rows: dict[str, tuple[Any, list[str]]] = {}
    for name, cmd in sorted(commands().items()):
        for opt, p in options_of(cmd).items():
            if opt in SHARED:
                default = p.default
                rows.setdefault(opt, (default, []))[1].append(name)
    lines = ["| option | default | commands |", "| --- | --- | --- |"]
    for opt in SHARED:
        if opt in rows:
            default, cmds = rows[opt]
            shown = "-" if default is None else f"`{default}`"
            lines.append(f"| `{opt}` | {shown} | {', '.join(cmds)} |")
    return "\n".join(lines)


def test_the_docs_table_of_shared_options_matches_the_commands() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "options.md").read_text()
    begin, end = "<!-- shared-options -->", "<!-- /shared-options -->"
    assert begin in page and end in page
    block = page.split(begin, 1)[1].split(end, 1)[0].strip()
    assert block == shared_table(), "docs/options.md out of date; the table should read:\n" + (
        shared_table())


def test_the_kubernetes_job_passes_only_options_the_worker_takes() -> None:
    from pathlib import Path

    import yaml

    job = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy" / "k8s"
                          / "worker-job.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["autotune", "worker"]
    known = options_of(commands()["worker"])
    given = [arg.split("=", 1)[0] for arg in container["args"]]
    assert given and [g for g in given if g not in known] == []


def test_every_command_summary_is_one_paragraph_of_one_line() -> None:
    # `autotune --help` lists each command by its docstring's first paragraph; a hard line
    # break inside it printed as a broken summary (bench and recommend did).
    for name, cmd in commands().items():
        summary = (cmd.help or "").strip().split("\n\n")[0]
        assert summary and "\n" not in summary, (name, summary)
