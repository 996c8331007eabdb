"""The options of the commands, each defined once: one name, one meaning, one default.

A command's signature is one line per option (``slo_p99: SloP99 = None``); what an
option's text means is parsed in :mod:`autotune.cli._parse`.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

# The steady-state options of every command that runs load tests, defined once so that
# each means the same everywhere (autotune.tuning.verdict.SteadyState).
MinDuration = Annotated[str | None, typer.Option(
    help="Arrivals of each load test last at least this long before it may pass "
         "(default max(60s, 6x the largest latency limit)).")]
MaxDuration = Annotated[str | None, typer.Option(
    help="Hard cap: an inconclusive load test runs on at the same rate up to this long "
         "(default: what the limits' sequential tests need at its rate, within 3x "
         "--min-duration and 10 minutes).")]
BacklogShare = Annotated[float, typer.Option(
    help="Largest growth of the backlog, as a share of the offered rate, that a load "
         "test may show and pass (its 95% upper bound must be under it).")]

# The workload options every command shares: one name, one meaning, one default.
NUM_PROMPTS, WARMUP = 1000, 100  # as vLLM's `vllm bench serve --num-prompts` (1000)
NumPrompts = Annotated[int, typer.Option(
    help="Requests drawn from the dataset (a search or ceiling draws at least 10,000, "
         "each test sized by time taking up where the last stopped); tests with an SLO "
         "are sized by time (--min-duration/--max-duration), never stretched by this; "
         "without an SLO, bench sends exactly this many.")]
Warmup = Annotated[int, typer.Option(
    help="Warm-up requests sent before each load test and excluded from every figure.")]
Seed = Annotated[int, typer.Option(help="Seed of the workload sample and the arrivals.")]
VLLM_CMD = "vllm serve"
VllmCmd = Annotated[str, typer.Option(
    help="Command that starts vLLM (the model is appended, or passed as --model when the "
         "command does not end in 'serve').")]
VllmEnv = Annotated[list[str] | None, typer.Option(
    help="KEY=VAL in the vLLM server's environment (repeatable).")]
MaxModelLen = Annotated[int | None, typer.Option(
    help="The server's context length (vLLM --max-model-len): ShareGPT pairs whose prompt "
         "+ output exceed it are dropped, as the server would refuse them.  Default: the "
         "config's max_model_len (space, --set/--param), else what the server reports in "
         "GET /v1/models, else 8192.")]

# -- the SLO
SloP99 = Annotated[str | None, typer.Option(help="P99 end-to-end latency limit, e.g. 10s.")]
Slo = Annotated[str | None, typer.Option(
    help="More limits, e.g. 'p99:ttft<=2s,p99:tpot<=100ms'.")]

# -- the server and the simulator
Model = Annotated[str | None, typer.Option(
    help="Model to serve (a path or name); implies --backend vllm.")]
AttachUrl = Annotated[str | None, typer.Option(
    help="Attach to this running server (only the rate cap is searched).")]
Profile = Annotated[str | None, typer.Option(
    help="Simulator profile HARDWARE[:MODEL], e.g. a100-80gb:llama-3-8b "
         "(default: the space's).")]
Gpus = Annotated[int | None, typer.Option(
    help="GPUs of the node (rule: TP <= GPUs; the simulator's GPU count).")]
StartupTimeout = Annotated[float, typer.Option(
    help="Seconds a vLLM server may take to become ready.")]
GpuIds = Annotated[str | None, typer.Option(
    help="GPU ids for CUDA_VISIBLE_DEVICES of the vLLM server, e.g. 0,1.")]
Tokenizer = Annotated[str | None, typer.Option(
    help="Path to the model's tokenizer.json (default: mistral-common's tekken).")]
InputLen = Annotated[int, typer.Option(help="Synthetic: mean prompt tokens.")]
OutputLen = Annotated[int, typer.Option(help="Synthetic: mean output tokens.")]
LengthSpread = Annotated[float, typer.Option(
    help="Synthetic: relative spread of lengths (0 = fixed).")]
LengthDistribution = Annotated[str, typer.Option(help="Synthetic: fixed, uniform or lognormal.")]
SearchSeed = Annotated[int, typer.Option(help="Seed of workload, arrivals and sampler.")]

# -- the study
Space = Annotated[str, typer.Option(
    help="Search space: a YAML path or a name in search_spaces/.")]
SearchBackend = Annotated[str | None, typer.Option(
    help="sim (virtual time, default without --model/--url), vllm, or attach.")]
StudyName = Annotated[str | None, typer.Option(
    help="Study name; the same name resumes the study.")]
Storage = Annotated[str | None, typer.Option(
    help="Optuna storage URL (default sqlite:///studies/<name>.db).")]
StudiesDir = Annotated[Path, typer.Option(help="Folder of study databases and result files.")]
Sampler = Annotated[str, typer.Option(help="tpe, gp, random or grid.")]
NTrials = Annotated[int | None, typer.Option(
    help="Finished trials the study should reach (default 30 sim, 20 otherwise).")]
Timeout = Annotated[str | None, typer.Option(
    help="Stop starting trials after this wall time, e.g. 30m.")]
Budget = Annotated[str | None, typer.Option(
    help="Total server time, restarts and the --validate run included (virtual for "
         "sim), e.g. 2h; a load test running when it ends is cut there.")]
Objective = Annotated[str | None, typer.Option(
    help="tokens (goodput output tok/s, the default) or requests (goodput req/s); a "
         "search --by concurrency or users ranks by the users it sustains.")]
PerGpu = Annotated[bool, typer.Option(help="Divide the objective by the GPUs a config uses.")]
Prescreen = Annotated[str | None, typer.Option(
    help="'sim': run the study in virtual time first, then measure its top configs.")]
PrescreenTrials = Annotated[int, typer.Option(help="Trials of the pre-screen.")]
TopK = Annotated[int, typer.Option(help="Pre-screened configs to measure first.")]
NoPrune = Annotated[bool, typer.Option(
    "--no-prune", help="No beat-the-incumbent pruning: every config gets its whole "
                       "ceiling search (as a sweep would).")]
ProveTop = Annotated[int, typer.Option(
    "--prove-top", "--refine-top",
    help="Screen fast, prove once: each trial screens its config with short tests; then "
         "this many best configs, and vLLM's defaults, get the full steady-state ceiling "
         "search (0: every trial a full ceiling search).")]
Wandb = Annotated[str | None, typer.Option(
    "--wandb", help="Log every trial to this Weights & Biases project.")]
Mlflow = Annotated[str | None, typer.Option(
    "--mlflow", help="Log every trial to the MLflow tracking server at this URI.")]
Twin = Annotated[bool, typer.Option(
    "--twin", help="Learn the server: after each trial, fit the simulator's profile to "
                   "every load test so far (studies/<name>/profile.fitted.yaml), measure "
                   "the twin's best config next and start each trial at its predicted "
                   "ceiling.")]
TwinPrior = Annotated[str | None, typer.Option(
    help="With --twin: the hardware profile the twin starts from (default: --profile's).")]
TwinCandidates = Annotated[int, typer.Option(
    help="With --twin: simulated trials behind each of its picks (0: only predict each "
         "trial's ceiling).")]

# -- each config's rate search
Headroom = Annotated[float, typer.Option(
    help="Rate cap this share under the highest feasible rate.")]
Tol = Annotated[float, typer.Option(
    help="Each trial's rate search stops when its passing and failing rates are this "
         "close (relative).")]
MaxProbes = Annotated[int, typer.Option(help="Load tests one trial's rate search may run.")]
Validate = Annotated[str, typer.Option(
    help="Run the recommended config at its cap this long before recommending it "
         "(virtual time on the simulator); 'off' skips it.")]

# -- the workload's source (ceiling, search)
DatasetSource = Annotated[str, typer.Option(
    "--dataset", help="Request source: sharegpt, synthetic, or the path of your own "
                      "requests (JSON lines, CSV or an OpenAI request log; docs/workload.md).")]
MultiTurn = Annotated[bool, typer.Option(
    "--multi-turn", help="ShareGPT's whole conversations: each turn resends the history "
                         "so far, as chat clients do.")]
PrefixShare = Annotated[float, typer.Option(
    help="Prepend one shared system prompt making this share of the prompt tokens "
         "(0 to 1, as auto_tune.sh's MIN_CACHE_HIT_PCT / 100).")]
TierOpt = Annotated[list[str] | None, typer.Option(
    "--tier", help="An SLO tier NAME=SLO (repeatable), e.g. interactive='p99:ttft<=500ms,"
                   "p99:tpot<=50ms' or batch=60s: its best proven config, re-judged from "
                   "the proof's load tests.")]


# What a ceiling counts (`ceiling --by`, and what a search's trials search and rank by).
class By(str, Enum):
    rate = "rate"
    concurrency = "concurrency"
    users = "users"
    speed = "speed"


class Think(str, Enum):
    exponential = "exponential"
    fixed = "fixed"


ByOpt = Annotated[By, typer.Option(
    help="What the ceiling counts: rate (open-loop Poisson req/s), concurrency (requests "
         "kept in flight, each sent when the last ended), users (each thinks "
         "--think-time between its requests) or speed (ceiling only: a --dataset trace "
         "replayed at its logged times, this many times faster).")]
ThinkTime = Annotated[str | None, typer.Option(
    help="--by users: a user's mean think time between a reply and its next request, "
         "e.g. 20s.")]
ThinkOpt = Annotated[Think, typer.Option(
    help="Think-time distribution: exponential (mean --think-time) or fixed.")]
