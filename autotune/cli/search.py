"""``autotune search``: server configs and rate caps under a P99 SLO, for goodput.

This module only parses: the options become one :class:`autotune.search.pipeline.SearchOptions`
and :func:`autotune.search.pipeline.run_search` runs the whole pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.cli._app import app
from autotune.cli._common import (
    NUM_PROMPTS,
    VLLM_CMD,
    WARMUP,
    BacklogShare,
    MaxDuration,
    MaxModelLen,
    MinDuration,
    NumPrompts,
    VllmCmd,
    VllmEnv,
    Warmup,
    one_line_errors,
)


@app.command("search")
def search(
    slo_p99: Annotated[str | None, typer.Option(
        help="P99 end-to-end latency limit, e.g. 10s.")] = None,
    slo: Annotated[str | None, typer.Option(
        help="More limits, e.g. 'p99:ttft<=2s,p99:tpot<=100ms'.")] = None,
    space: Annotated[str, typer.Option(
        help="Search space: a YAML path or a name in search_spaces/.")] = "default",
    gpus: Annotated[int | None, typer.Option(
        help="GPUs of the node (rule: TP <= GPUs; the simulator's GPU count).")] = None,
    profile: Annotated[str | None, typer.Option(
        help="Simulator profile HARDWARE[:MODEL], e.g. a100-80gb:llama-3-8b "
             "(default: the space's).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model to serve (a path or name); implies --backend vllm.")] = None,
    backend: Annotated[str | None, typer.Option(
        help="sim (virtual time, default without --model/--url), vllm, or attach.")] = None,
    study_name: Annotated[str | None, typer.Option(
        help="Study name; the same name resumes the study.")] = None,
    storage: Annotated[str | None, typer.Option(
        help="Optuna storage URL (default sqlite:///studies/<name>.db).")] = None,
    sampler: Annotated[str, typer.Option(help="tpe, gp, random or grid.")] = "tpe",
    n_trials: Annotated[int | None, typer.Option(
        help="Finished trials the study should reach (default 30 sim, 20 otherwise).")
    ] = None,
    timeout: Annotated[str | None, typer.Option(
        help="Stop starting trials after this wall time, e.g. 30m.")] = None,
    budget: Annotated[str | None, typer.Option(
        help="Total server time, restarts and the --validate run included (virtual for "
             "sim), e.g. 2h; a load test running when it ends is cut there.")] = None,
    objective: Annotated[str, typer.Option(
        help="tokens (goodput output tok/s) or requests (goodput req/s).")] = "tokens",
    per_gpu: Annotated[bool, typer.Option(
        help="Divide the objective by the GPUs a config uses.")] = False,
    num_prompts: NumPrompts = NUM_PROMPTS,
    warmup: Warmup = WARMUP,
    seed: Annotated[int, typer.Option(help="Seed of workload, arrivals and sampler.")] = 0,
    prescreen: Annotated[str | None, typer.Option(
        help="'sim': run the study in virtual time first, then measure its top configs.")
    ] = None,
    prescreen_trials: Annotated[int, typer.Option(help="Trials of the pre-screen.")] = 40,
    top_k: Annotated[int, typer.Option(help="Pre-screened configs to measure first.")] = 3,
    vllm_cmd: VllmCmd = VLLM_CMD,
    url: Annotated[str | None, typer.Option(
        help="Attach to this running server (only the rate cap is searched).")] = None,
    no_prune: Annotated[bool, typer.Option(
        "--no-prune", help="No beat-the-incumbent pruning: every config gets its whole "
                           "ceiling search (as a sweep would).")] = False,
    headroom: Annotated[float, typer.Option(
        help="Rate cap this share under the highest feasible rate.")] = 0.10,
    studies_dir: Annotated[Path, typer.Option(
        help="Folder of study databases and result files.")] = Path("studies"),
    max_model_len: MaxModelLen = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="Path to the model's tokenizer.json (default: mistral-common's tekken).")
    ] = None,
    prove_top: Annotated[int, typer.Option(
        "--prove-top", "--refine-top",
        help="Screen fast, prove once: each trial screens its config with short tests; "
             "then this many best configs, and vLLM's defaults, get the full "
             "steady-state ceiling search (0: every trial a full ceiling search).")] = 2,
    min_duration: MinDuration = None,
    max_duration: MaxDuration = None,
    backlog_share: BacklogShare = 0.02,
    tol: Annotated[float, typer.Option(
        help="Each trial's rate search stops when its passing and failing rates are "
             "this close (relative).")] = 0.03,
    max_probes: Annotated[int, typer.Option(
        help="Load tests one trial's rate search may run.")] = 8,
    validate: Annotated[str, typer.Option(
        help="Run the recommended config at its cap this long before recommending it "
             "(virtual time on the simulator); 'off' skips it.")] = "5m",
    wandb: Annotated[str | None, typer.Option(
        "--wandb", help="Log every trial to this Weights & Biases project.")] = None,
    mlflow: Annotated[str | None, typer.Option(
        "--mlflow", help="Log every trial to the MLflow tracking server at this URI.")
    ] = None,
    startup_timeout: Annotated[float, typer.Option(
        help="Seconds a vLLM server may take to become ready.")] = 900.0,
    gpu_ids: Annotated[str | None, typer.Option(
        help="GPU ids for CUDA_VISIBLE_DEVICES of the vLLM server, e.g. 0,1.")] = None,
    vllm_env: VllmEnv = None,
    twin: Annotated[bool, typer.Option(
        "--twin", help="Learn the server: after each trial, fit the simulator's profile "
                       "to every load test so far (studies/<name>/profile.fitted.yaml), "
                       "measure the twin's best config next and start each trial at its "
                       "predicted ceiling.")] = False,
    twin_prior: Annotated[str | None, typer.Option(
        help="With --twin: the hardware profile the twin starts from (default: "
             "--profile's).")] = None,
    twin_candidates: Annotated[int, typer.Option(
        help="With --twin: simulated trials behind each of its picks (0: only predict "
             "each trial's ceiling).")] = 12,
) -> None:
    """Search vLLM configs and rate caps for the highest goodput under the SLO."""
    given = dict(locals())
    from autotune.search import pipeline

    with one_line_errors():
        code = pipeline.run_search(pipeline.SearchOptions(**given))
    if code:
        raise typer.Exit(code)
