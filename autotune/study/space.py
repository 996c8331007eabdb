"""Search spaces: which vLLM flags (and which rate cap) a study may try (pure).

A space is a YAML file in ``search_spaces/``::

    name: llama3-8b-4xa100
    profile: {hardware: a100-80gb, model: llama-3-8b, gpus: 4}   # for the simulator
    attention_heads: 32          # for the rule "TP divides the attention heads"
    fixed: {model: meta-llama/Meta-Llama-3-8B-Instruct, max_model_len: 8192}
    parameters:
      tensor_parallel_size: {type: categorical, choices: [1, 2, 4]}
      max_num_seqs: {type: int, low: 64, high: 512, step: 64}
      gpu_memory_utilization: {type: float, low: 0.8, high: 0.95, step: 0.05}
      enable_chunked_prefill: {type: bool}
      request_rate: {type: float, low: 5, high: 50, log: true}
    baseline: {tensor_parallel_size: 1, max_num_seqs: 256, ...}   # vLLM's defaults
    rules: [tp_divides_heads, tp_fits_gpus, batched_tokens_cover_model_len]

``request_rate`` (and ``max_concurrency``) are client-side: they shape the load test,
not the server.  A config that breaks a rule is never launched.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from autotune.core.errors import AutotuneError
from autotune.core.flags import CLIENT_PARAMS, command_line, config_to_argv, serve_argv

PARAM_TYPES = ("int", "float", "categorical", "bool")
# vLLM engine flags a space may set (snake_case of `vllm serve --flag`).
VLLM_FLAGS = (
    "model",
    "served_model_name",
    "tokenizer",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "max_model_len",
    "block_size",
    "swap_space",
    "enforce_eager",
    "scheduling_policy",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
    "seed",
)
KNOWN_PARAMS = VLLM_FLAGS + CLIENT_PARAMS
# The value each typed vLLM flag takes, so that a bad value is refused where it is
# given, naming the flag, not deep in a launch or the simulator.
FLAG_TYPES: dict[str, type] = {
    **dict.fromkeys(("tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "block_size",
                     "long_prefill_token_threshold", "max_num_partial_prefills", "seed",
                     "api_server_count"),
                    int),
    **dict.fromkeys(("gpu_memory_utilization", "swap_space"), float),
    **dict.fromkeys(("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager"),
                    bool),
}
_TYPE_WORDS = {int: ("a whole number", "64"), float: ("a number", "0.9"),
               bool: ("true or false", "true")}


def flag_type_error(name: str, value: Any, option: str = "--param") -> str | None:
    """What is wrong with ``value`` for the vLLM flag ``name`` (None: nothing, or a
    flag whose type autotune does not know, which vLLM itself will check); the example
    is written for ``option``, the CLI option the value came from."""
    want = FLAG_TYPES.get(name)
    if want is None:
        return None
    ok = (isinstance(value, bool) if want is bool
          else isinstance(value, int | float) and not isinstance(value, bool)
          and (want is float or float(value).is_integer()))
    if ok:
        return None
    word, example = _TYPE_WORDS[want]
    flag = "--" + name.replace("_", "-")
    return (f"{name}={value!r}: vLLM {flag} takes {word}, e.g. {option} {name}={example}")
_PARAM_KEYS = {"type", "low", "high", "step", "log", "choices"}
_TOP_KEYS = {"name", "description", "profile", "attention_heads", "fixed", "parameters",
             "baseline", "rules"}


# Optuna's stepped floats carry binary noise (0.8500000000000001): a suggested value, and
# a stored one compared with it, is rounded to this many digits.
FLOAT_DIGITS = 10


def canonical_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every float rounded as a suggestion is, so that a config read back
    from storage equals the one suggested or queued."""
    return {k: round(v, FLOAT_DIGITS) if isinstance(v, float) else v
            for k, v in params.items()}


class SpaceError(AutotuneError, ValueError):
    """A search-space file is unreadable or describes an impossible space."""


class _Suggester(Protocol):  # the part of optuna.Trial a space needs
    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1,
                    log: bool = False) -> int: ...
    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float: ...
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()

    def bounds(self) -> tuple[float, float]:
        """``low`` and ``high`` of an int or float parameter (the loader sets both)."""
        if self.low is None or self.high is None:
            # Only a Param built by hand can lack them (a space file is refused first):
            # a programming error, so the TypeError float(None) would have raised.
            raise TypeError(f"parameter {self.name!r} ({self.type}) has no low/high")
        return self.low, self.high

    def suggest(self, trial: _Suggester) -> Any:
        if self.type == "int":
            lo, hi = self.bounds()
            return trial.suggest_int(self.name, int(lo), int(hi),
                                     step=int(self.step or 1), log=self.log)
        if self.type == "float":
            lo, hi = self.bounds()
            value = trial.suggest_float(self.name, float(lo), float(hi),
                                        step=self.step, log=self.log)
            return round(value, FLOAT_DIGITS) if self.step else value
        if self.type == "bool":
            return trial.suggest_categorical(self.name, [False, True])
        return trial.suggest_categorical(self.name, list(self.choices))

    def grid(self, points: int = 4) -> list[Any]:
        """Values for a grid search: all choices, every step, or ``points`` spaced."""
        if self.type == "bool":
            return [False, True]
        if self.type == "categorical":
            return list(self.choices)
        low, high = self.bounds()
        lo, hi = float(low), float(high)
        if self.step:
            n = int(math.floor((hi - lo) / self.step + 1e-9)) + 1
            if n <= max(points, 8):
                vals = [round(lo + i * self.step, FLOAT_DIGITS) for i in range(n)]
                return [int(v) for v in vals] if self.type == "int" else vals
        if self.log:
            vals = list(_geomspace(lo, hi, points))
        else:
            vals = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
        if self.step:
            vals = [round(lo + round((v - lo) / self.step) * self.step, FLOAT_DIGITS) for v in vals]
        if self.type == "int":
            vals = [int(round(v)) for v in vals]
        return sorted(set(vals))

    def contains(self, value: Any) -> bool:
        if self.type == "bool":
            return isinstance(value, bool)
        if self.type == "categorical":
            return value in self.choices
        try:
            v = float(value)
        except (TypeError, ValueError):
            return False
        lo, hi = self.bounds()
        return float(lo) - 1e-9 <= v <= float(hi) + 1e-9


def _geomspace(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


@dataclass(frozen=True)
class RuleContext:
    gpus: int | None
    attention_heads: int | None


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    # Returns None when the config obeys the rule, else why not.
    check: Callable[[Mapping[str, Any], RuleContext], str | None]


def _tp_divides_heads(cfg: Mapping[str, Any], ctx: RuleContext) -> str | None:
    tp = int(cfg.get("tensor_parallel_size", 1))
    if ctx.attention_heads and ctx.attention_heads % tp:
        return f"tensor_parallel_size={tp} does not divide {ctx.attention_heads} attention heads"
    return None


def _tp_fits_gpus(cfg: Mapping[str, Any], ctx: RuleContext) -> str | None:
    tp = int(cfg.get("tensor_parallel_size", 1)) * int(cfg.get("pipeline_parallel_size", 1))
    if ctx.gpus is not None and tp > ctx.gpus:
        return f"tensor_parallel_size={tp} needs more than the {ctx.gpus} GPUs given (--gpus)"
    return None


def _batched_tokens_cover_model_len(cfg: Mapping[str, Any], ctx: RuleContext) -> str | None:
    mbt, mml = cfg.get("max_num_batched_tokens"), cfg.get("max_model_len")
    if mbt is None or mml is None or cfg.get("enable_chunked_prefill", True):
        return None
    if int(mbt) < int(mml):
        return (f"max_num_batched_tokens={mbt} < max_model_len={mml} without chunked prefill: "
                "vLLM refuses to start")
    return None


RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule("tp_divides_heads", "tensor_parallel_size divides the attention heads",
             _tp_divides_heads),
        Rule("tp_fits_gpus", "tensor_parallel_size is at most --gpus", _tp_fits_gpus),
        Rule("batched_tokens_cover_model_len",
             "max_num_batched_tokens >= max_model_len unless chunked prefill is on",
             _batched_tokens_cover_model_len),
    )
}


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


@dataclass(frozen=True)
class SearchSpace:
    name: str
    params: dict[str, Param]
    fixed: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    rules: tuple[str, ...] = tuple(RULES)
    attention_heads: int | None = None
    profile: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    path: str | None = None

    # -- loading ---------------------------------------------------------------------
    @classmethod
    def load(cls, path_or_name: str | Path) -> SearchSpace:
        """Load a YAML file, or a name from ``search_spaces/`` (repo, then cwd)."""
        path = resolve(path_or_name)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise SpaceError(f"{path}: malformed YAML{where}: {problem}") from None
        except OSError as exc:
            raise SpaceError(f"{path}: cannot read: {exc.strerror}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<space>") -> SearchSpace:
        def fail(key: str, problem: str) -> SpaceError:
            return SpaceError(f"{source}: {key}: {problem}")

        if not isinstance(data, dict):
            raise SpaceError(f"{source}: expected a mapping with 'parameters', "
                             f"got {type(data).__name__}")
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise fail(sorted(unknown)[0], f"unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
        raw_params = data.get("parameters")
        if not isinstance(raw_params, dict) or not raw_params:
            raise fail("parameters", "must be a non-empty mapping of parameter name to spec")
        params = {name: _parse_param(name, spec, fail) for name, spec in raw_params.items()}

        fixed = data.get("fixed") or {}
        if not isinstance(fixed, dict):
            raise fail("fixed", "must be a mapping of flag to value")
        for key in fixed:
            if key not in VLLM_FLAGS:
                raise fail(f"fixed.{key}", f"unknown vLLM flag; known: {', '.join(VLLM_FLAGS)}")
            if key in params:
                raise fail(f"fixed.{key}", "is also a searched parameter; keep one")

        baseline = data.get("baseline") or {}
        if not isinstance(baseline, dict):
            raise fail("baseline", "must be a mapping of parameter to value")
        for key, value in baseline.items():
            if key not in params:
                raise fail(f"baseline.{key}", "is not a parameter of this space")
            if not params[key].contains(value):
                raise fail(f"baseline.{key}", f"value {value!r} is outside the parameter's range")

        rules = data.get("rules", list(RULES))
        if not isinstance(rules, list):
            raise fail("rules", "must be a list of rule names")
        for rule in rules:
            if rule not in RULES:
                raise fail("rules", f"unknown rule {rule!r}; known: {', '.join(RULES)}")

        heads = data.get("attention_heads")
        if heads is not None and (not isinstance(heads, int) or heads <= 0):
            raise fail("attention_heads", f"must be a positive integer, got {heads!r}")
        profile = data.get("profile") or {}
        if not isinstance(profile, dict):
            raise fail("profile", "must be a mapping with hardware, model and gpus")
        name = str(data.get("name") or Path(source).stem)
        return cls(name=name, params=params, fixed=dict(fixed), baseline=dict(baseline),
                   rules=tuple(rules), attention_heads=heads, profile=dict(profile),
                   description=str(data.get("description", "")), path=source)

    # -- trials -> configs -----------------------------------------------------------
    def suggest(self, trial: _Suggester) -> dict[str, Any]:
        """Sample every parameter on an Optuna trial."""
        return {name: p.suggest(trial) for name, p in self.params.items()}

    def server_flags(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The vLLM flags of a trial: fixed flags plus the sampled server parameters."""
        flags = dict(self.fixed)
        flags.update({k: v for k, v in params.items() if k not in CLIENT_PARAMS})
        return flags

    def violations(self, params: Mapping[str, Any], *, gpus: int | None,
                   attention_heads: int | None = None) -> list[Violation]:
        ctx = RuleContext(gpus=gpus, attention_heads=attention_heads or self.attention_heads)
        cfg = self.server_flags(params)
        out = []
        for name in self.rules:
            msg = RULES[name].check(cfg, ctx)
            if msg is not None:
                out.append(Violation(name, msg))
        return out

    def for_configs(self, *, gpus: int | None, attention_heads: int | None = None
                    ) -> SearchSpace:
        """The space a trial samples: server parameters only (each trial searches its
        own rate), and no tensor-parallel size that a rule forbids on ``gpus`` GPUs, so
        no sample is spent on a config that can never launch."""
        params = {k: v for k, v in self.params.items() if k != "request_rate"}
        tp = params.get("tensor_parallel_size")
        if tp is not None:
            ctx = RuleContext(gpus=gpus, attention_heads=attention_heads or self.attention_heads)
            tp_rules = [RULES[r] for r in self.rules if r in ("tp_fits_gpus", "tp_divides_heads")]
            values = list(tp.choices) if tp.type == "categorical" else tp.grid(points=64)
            ok = [v for v in values
                  if all(rule.check({"tensor_parallel_size": v}, ctx) is None
                         for rule in tp_rules)]
            if not ok:
                raise SpaceError(f"{self.path or self.name}: no tensor_parallel_size in "
                                 f"{values} fits {gpus} GPUs and {ctx.attention_heads} "
                                 "attention heads: widen the choices or pass --gpus")
            if ok != values or tp.type != "categorical":
                params["tensor_parallel_size"] = Param("tensor_parallel_size", "categorical",
                                                       choices=tuple(ok))
        baseline = {k: v for k, v in self.baseline.items()
                    if k in params and params[k].contains(v)}
        return replace(self, params=params, baseline=baseline)

    def baseline_params(self) -> dict[str, Any]:
        """The vLLM-defaults trial; parameters it leaves out take their range's middle."""
        out = {}
        for name, p in self.params.items():
            if name in self.baseline:
                out[name] = self.baseline[name]
            elif p.type == "bool":
                out[name] = False
            elif p.type == "categorical":
                out[name] = p.choices[0]
            else:
                g = p.grid(3)
                out[name] = g[len(g) // 2]
        return out

    def grid(self, points: int = 4) -> dict[str, list[Any]]:
        return {name: p.grid(points) for name, p in self.params.items()}

    def configs(self, limit: int) -> list[dict[str, Any]] | None:
        """Every config of a finite space (categorical, bool and stepped int
        parameters), in a fixed order; None when the space is not finite or holds
        more than ``limit`` configs."""
        axes: list[list[Any]] = []
        for p in self.params.values():
            if p.type in ("bool", "categorical"):
                axes.append(p.grid())
            elif p.type == "int":
                lo, hi, step = int(p.low or 0), int(p.high or 0), int(p.step or 1)
                if (hi - lo) // step + 1 > limit:
                    return None
                axes.append(list(range(lo, hi + 1, step)))
            else:
                return None
        if math.prod(len(a) for a in axes) > limit:
            return None
        return [dict(zip(self.params, values, strict=True))
                for values in itertools.product(*axes)]


def _parse_param(name: str, spec: Any, fail: Callable[[str, str], SpaceError]) -> Param:
    key = f"parameters.{name}"
    if name not in KNOWN_PARAMS:
        raise fail(key, f"unknown parameter; known: {', '.join(KNOWN_PARAMS)}")
    if not isinstance(spec, dict):
        raise fail(key, "must be a mapping with 'type' and a range or choices")
    extra = set(spec) - _PARAM_KEYS
    if extra:
        known = ", ".join(sorted(_PARAM_KEYS))
        raise fail(f"{key}.{sorted(extra)[0]}", f"unknown key (known: {known})")
    ptype = spec.get("type")
    if ptype not in PARAM_TYPES:
        raise fail(f"{key}.type", f"must be one of {', '.join(PARAM_TYPES)}, got {ptype!r}")
    if ptype == "bool":
        return Param(name, "bool")
    if ptype == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise fail(f"{key}.choices", "must be a non-empty list")
        if len(set(map(repr, choices))) != len(choices):
            raise fail(f"{key}.choices", "lists a value twice")
        return Param(name, "categorical", choices=tuple(choices))

    def bound(k: str) -> float:
        v = spec.get(k)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise fail(f"{key}.{k}", f"must be a number, got {v!r}")
        if ptype == "int" and not float(v).is_integer():
            raise fail(f"{key}.{k}", f"must be an integer for an int parameter, got {v!r}")
        return v

    low, high = bound("low"), bound("high")
    step, log = spec.get("step"), spec.get("log", False)
    if not low < high:
        raise fail(key, f"empty range: low={low} must be below high={high}")
    if not isinstance(log, bool):
        raise fail(f"{key}.log", f"must be true or false, got {log!r}")
    if log and low <= 0:
        raise fail(f"{key}.low", f"log scale needs low > 0, got {low}")
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int | float) or step <= 0:
            raise fail(f"{key}.step", f"must be a positive number, got {step!r}")
        if log:
            raise fail(f"{key}.step", "cannot be combined with log: true (Optuna refuses it)")
        if step > high - low:
            raise fail(f"{key}.step", f"step {step} is larger than the range {low}..{high}")
    return Param(name, ptype, low=low, high=high, step=step, log=log)


def search_dirs() -> list[Path]:
    """Where names are looked up: the repo's ``search_spaces/``, then the cwd's."""
    package = Path(__file__).resolve().parents[1]  # autotune/, this file's package's parent
    dirs = [package.parent / "search_spaces", package / "search_spaces",
            Path.cwd() / "search_spaces"]
    seen: list[Path] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def available() -> list[str]:
    names: set[str] = set()
    for d in search_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def resolve(path_or_name: str | Path) -> Path:
    p = Path(path_or_name)
    if p.suffix in (".yaml", ".yml") or p.parent != Path("."):
        if not p.is_file():
            raise SpaceError(f"{p}: search-space file not found")
        return p
    for d in search_dirs():
        for cand in (d / f"{p}.yaml", d / f"{p}.yml"):
            if cand.is_file():
                return cand
    if p.is_file():
        return p
    raise SpaceError(f"{path_or_name}: no such search space; give a YAML path or one of: "
                     f"{', '.join(available()) or '(none found)'}")


def vllm_args(flags: Mapping[str, Any]) -> list[str]:
    """``{'max_num_seqs': 128, 'enable_chunked_prefill': False}`` ->
    ``['--max-num-seqs', '128', '--no-enable-chunked-prefill']`` (model excluded);
    :func:`autotune.core.flags.config_to_argv`, the one renderer."""
    return config_to_argv(flags)


def serve_command(flags: Mapping[str, Any], *, port: int | None = None) -> str:
    """The ``vllm serve MODEL ...`` line a user runs to deploy ``flags``."""
    argv = serve_argv(flags) + (["--port", str(port)] if port is not None else [])
    return command_line(argv)
