"""``autotune search``: server configs and rate caps under a P99 SLO, for goodput.

This module only parses: every option becomes a typed value of one
:class:`autotune.search.options.SearchOptions`, and
:func:`autotune.search.pipeline.run_search` runs the whole pipeline with it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from autotune.analysis.tiers import parse_tier
from autotune.cli._app import app
from autotune.cli._common import one_line_errors
from autotune.cli._options import (
    NUM_PROMPTS,
    VLLM_CMD,
    WARMUP,
    AttachUrl,
    BacklogShare,
    Budget,
    By,
    ByOpt,
    DatasetSource,
    GpuIds,
    Gpus,
    Headroom,
    MaxDuration,
    MaxModelLen,
    MaxProbes,
    MinDuration,
    Mlflow,
    Model,
    MultiTurn,
    NoPrune,
    NTrials,
    NumPrompts,
    Objective,
    PerGpu,
    PrefixShare,
    Prescreen,
    PrescreenTrials,
    Profile,
    ProveTop,
    Sampler,
    SearchBackend,
    SearchSeed,
    Slo,
    SloP99,
    Space,
    StartupTimeout,
    Storage,
    StudiesDir,
    StudyName,
    Think,
    ThinkOpt,
    ThinkTime,
    TierOpt,
    Timeout,
    Tokenizer,
    Tol,
    TopK,
    Twin,
    TwinCandidates,
    TwinPrior,
    Validate,
    VllmCmd,
    VllmEnv,
    Wandb,
    Warmup,
)
from autotune.cli._parse import (
    backend_kind,
    duration,
    load_space,
    load_unit,
    parse_slo,
    parse_steady,
    parse_validate,
    server_options,
    sim_profile,
)
from autotune.search import pipeline
from autotune.search.options import SearchOptions, TwinOptions
from autotune.tuning.options import OptionsError, RateSearch, WorkloadOptions
from autotune.workload.pool import PoolOptions


@app.command("search")
def search(  # one line per option, each defined in cli._options
    slo_p99: SloP99 = None, slo: Slo = None, space: Space = "default", gpus: Gpus = None,
    profile: Profile = None, model: Model = None, backend: SearchBackend = None,
    study_name: StudyName = None, storage: Storage = None, sampler: Sampler = "tpe",
    n_trials: NTrials = None, timeout: Timeout = None, budget: Budget = None,
    objective: Objective = None, per_gpu: PerGpu = False,
    num_prompts: NumPrompts = NUM_PROMPTS, warmup: Warmup = WARMUP, seed: SearchSeed = 0,
    prescreen: Prescreen = None, prescreen_trials: PrescreenTrials = 40, top_k: TopK = 3,
    vllm_cmd: VllmCmd = VLLM_CMD, url: AttachUrl = None, no_prune: NoPrune = False,
    headroom: Headroom = 0.10, studies_dir: StudiesDir = Path("studies"),
    max_model_len: MaxModelLen = None, tokenizer: Tokenizer = None, prove_top: ProveTop = 2,
    min_duration: MinDuration = None, max_duration: MaxDuration = None,
    backlog_share: BacklogShare = 0.02, tol: Tol = 0.03, max_probes: MaxProbes = 8,
    validate: Validate = "5m", wandb: Wandb = None, mlflow: Mlflow = None,
    startup_timeout: StartupTimeout = 900.0, gpu_ids: GpuIds = None,
    vllm_env: VllmEnv = None, twin: Twin = False, twin_prior: TwinPrior = None,
    twin_candidates: TwinCandidates = 12, dataset: DatasetSource = "sharegpt",
    multi_turn: MultiTurn = False, prefix_share: PrefixShare = 0.0, tier: TierOpt = None,
    by: ByOpt = By.rate, think_time: ThinkTime = None, think: ThinkOpt = Think.exponential,
) -> None:
    """Search vLLM configs and rate caps for the highest goodput under the SLO."""
    with one_line_errors():
        the_space = load_space(space)
        sim = sim_profile(profile, the_space, gpus)
        if (twin_prior or twin_candidates != 12) and not twin:
            raise OptionsError("--twin-prior and --twin-candidates set up the twin: add --twin")
        if prescreen is not None and prescreen != "sim":
            raise OptionsError(f"unknown --prescreen {prescreen!r}; the only pre-screen is "
                               "'sim'")
        unit = load_unit(by.value, think_time, think.value)
        options = SearchOptions(
            slo=parse_slo(slo_p99, slo), space=the_space,
            backend=backend_kind(backend, url=url, model=model), profile=sim,
            profile_given=profile is not None,
            workload=WorkloadOptions(num_prompts=num_prompts, warmup=warmup, seed=seed,
                                     tokenizer=tokenizer, max_model_len=max_model_len),
            pool=PoolOptions(dataset=dataset, multi_turn=multi_turn,
                             prefix_share=prefix_share),
            tiers=tuple(parse_tier(t) for t in tier or ()),
            server=server_options(model=model, url=url, vllm_cmd=vllm_cmd,
                                  startup_timeout=startup_timeout, gpu_ids=gpu_ids,
                                  vllm_env=vllm_env),
            steady=parse_steady(min_duration, max_duration, num_prompts, backlog_share),
            rates=RateSearch(tol=tol, max_probes=max_probes, headroom=headroom),
            study_name=study_name, storage=storage, studies_dir=studies_dir,
            sampler=sampler.lower(), n_trials=n_trials,
            timeout_s=duration("--timeout", timeout), budget_s=duration("--budget", budget),
            unit=unit, objective=objective or ("tokens" if unit.closed is None else "level"),
            per_gpu=per_gpu, prescreen=True if prescreen else None,
            prescreen_trials=prescreen_trials, top_k=top_k, prune=not no_prune,
            prove_top=prove_top, validate_s=parse_validate(validate),
            twin=TwinOptions(prior=twin_prior or sim.hardware, candidates=twin_candidates)
            if twin else None, wandb=wandb, mlflow=mlflow)
        code = pipeline.run_search(options)
    if code:
        raise typer.Exit(code)
