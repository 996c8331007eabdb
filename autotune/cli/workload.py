"""``autotune workload PATH``: describe a traffic file beside ShareGPT, with a plot.

This module only parses; :func:`autotune.analysis.traffic.describe_traffic` reads and
describes.  Exit 0 with the description; 2 on bad input (one line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.analysis.traffic import describe_traffic, lines
from autotune.cli._app import app
from autotune.cli._common import UsageError, one_line_errors
from autotune.cli._options import MaxModelLen, Seed, Tokenizer
from autotune.core.files import check_writable, write_json
from autotune.core.terminal import console
from autotune.report import plots
from autotune.tuning.options import DEFAULT_CONTEXT
from autotune.workload.tokenizer import load_tokenizer

PathArg = Annotated[Path, typer.Argument(
    help="Requests as JSON lines, CSV or an OpenAI request log (docs/workload.md).")]
Compare = Annotated[int, typer.Option(
    help="ShareGPT first turns to describe beside it (0: none).")]
PlotOpt = Annotated[Path | None, typer.Option(
    "--plot", help="Length histograms beside ShareGPT's (PNG).")]
Output = Annotated[Path | None, typer.Option(
    "--output", "--out", help="Write the description as JSON.")]


@app.command("workload")
def workload(  # one line per option
    path: PathArg, tokenizer: Tokenizer = None, max_model_len: MaxModelLen = None,
    compare: Compare = 2000, plot: PlotOpt = Path("workload.png"), output: Output = None,
    seed: Seed = 0,
) -> None:
    """Describe a traffic file beside ShareGPT, and what of it the simulator models.

    Lengths, conversations, shared prefixes and arrivals, with a plot."""
    with one_line_errors():
        if compare < 0:
            raise UsageError(f"--compare must be 0 or more ShareGPT requests, got {compare}")
        if not path.is_file():
            raise UsageError(f"{path}: no such file; give a JSON-lines, CSV or OpenAI "
                             "request-log file")
        check_writable(output, "--output")
        check_writable(plot, "--plot")
        traffic = describe_traffic(str(path), tokenizer=load_tokenizer(tokenizer),
                                   max_model_len=max_model_len or DEFAULT_CONTEXT,
                                   compare=compare, seed=seed)
        for line in lines(traffic):
            console.print(line, soft_wrap=True, highlight=False)
        if output is not None:
            write_json(output, traffic.to_dict())
            console.print(f"wrote {output}")
        if plot is not None:
            plots.traffic(
                {"prompt_tokens": traffic.prompt_lengths,
                 "output_tokens": traffic.output_lengths},
                {"prompt_tokens": traffic.sharegpt_prompt_lengths,
                 "output_tokens": traffic.sharegpt_output_lengths},
                plot, title=f"{traffic.ours['source']}",
                provenance=f"token lengths counted with {traffic.ours['tokenizer']}; "
                           "read from the file, not measured on a server")
            console.print(f"wrote {plot}")
