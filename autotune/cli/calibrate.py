"""``autotune calibrate``: fit the simulator's profile to a real server.

This module only parses: the options become one
:class:`autotune.tuning.calibration.CalibrateOptions` and
:func:`autotune.tuning.calibration.run_calibration` does the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.cli._app import app
from autotune.cli._common import one_line_errors
from autotune.cli._options import (
    NUM_PROMPTS,
    VLLM_CMD,
    WARMUP,
    MaxModelLen,
    NumPrompts,
    Seed,
    VllmCmd,
    VllmEnv,
    Warmup,
)
from autotune.cli._parse import server_options, sim_profile
from autotune.cli.ceiling import parse_params
from autotune.tuning.calibration import CalibrateOptions, parse_loads, run_calibration
from autotune.tuning.options import WorkloadOptions


@app.command("calibrate")
def calibrate(
    profile: Annotated[str, typer.Option(
        help="The profile to start from, HARDWARE[:MODEL], e.g. a100-80gb:llama-3-8b "
             "(the model profile must describe the served model).")],
    out: Annotated[Path, typer.Option(
        "--out", "--output", help="Where to write the fitted hardware profile (.yaml).")],
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Also write the fit (factors, errors per test) as JSON.")] = None,
    gpus: Annotated[int | None, typer.Option(
        help="GPUs the server uses (the profile's GPU count).")] = None,
    url: Annotated[str | None, typer.Option(
        help="A running server to calibrate (describe its config with --param).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model for autotune to serve (with --vllm-cmd); the server is stopped after.")
    ] = None,
    vllm_cmd: VllmCmd = VLLM_CMD,
    vllm_env: VllmEnv = None,
    param: Annotated[list[str] | None, typer.Option(
        help="The server config, key=value (repeatable), e.g. max_num_seqs=16: launched "
             "with it, or, with --url, how the running server was started.")] = None,
    num_prompts: NumPrompts = NUM_PROMPTS,
    warmup: Warmup = WARMUP,
    loads: Annotated[str, typer.Option(
        help="Poisson tests after the saturation test, as fractions of its service "
             "rate.")] = "0.5,0.8",
    seed: Seed = 0,
    dataset: Annotated[str, typer.Option(help="sharegpt or synthetic.")] = "sharegpt",
    input_len: Annotated[int, typer.Option(help="Synthetic prompt tokens (median).")] = 256,
    output_len: Annotated[int, typer.Option(help="Synthetic output tokens (median).")] = 128,
    max_model_len: MaxModelLen = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="Path to the model's tokenizer.json (default: the server's, else "
             "mistral-common's tekken).")] = None,
    studies_dir: Annotated[Path, typer.Option(
        help="Folder for the launched server's logs (calibrate/logs).")] = Path("studies"),
) -> None:
    """Run calibration load shapes against a server and fit the simulator to them."""
    with one_line_errors():
        options = CalibrateOptions(
            prior=sim_profile(profile, None, gpus), out=out, json_path=json_path,
            server=server_options(model=model, url=url, vllm_cmd=vllm_cmd,
                                  startup_timeout=900.0, gpu_ids=None, vllm_env=vllm_env),
            flags=parse_params(param),
            workload=WorkloadOptions(num_prompts=num_prompts, warmup=warmup, seed=seed,
                                     tokenizer=tokenizer, max_model_len=max_model_len),
            loads=parse_loads(loads), dataset=dataset, input_len=input_len,
            output_len=output_len, studies_dir=studies_dir)
        code = run_calibration(options)
    if code:
        raise typer.Exit(code)
