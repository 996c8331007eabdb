"""One flag renderer: a config becomes vLLM argv here and nowhere else.

The launcher, the recommendation's command and the deployment plan all render flags
with :func:`config_to_argv`, and print argv with :func:`command_line`, so the command
a user copies is exactly the one that was launched and measured.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

# Client-side knobs of a config: the load generator's, never vLLM's.
# Parameters of the load generator, not of the server: never a server flag.
CLIENT_PARAMS = ("request_rate", "max_concurrency")


def config_key(config: Mapping[str, Any]) -> str:
    """One server config as a string, the same for the same server flags whatever their
    order or the client parameters (rate cap, concurrency) beside them: the one key by
    which the report, the recommendation and the twin tell configs apart."""
    return json.dumps({k: v for k, v in config.items() if k not in CLIENT_PARAMS},
                      sort_keys=True, default=str)


def flag_value(value: Any) -> str:
    """How a value is written on vLLM's command line: whole floats as integers (vLLM
    parses ``--max-num-batched-tokens 16384.0`` as an error), other floats in the
    shortest form that reads back to the same number (never ``1.638e+04``)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"flag value must be finite, got {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def config_to_argv(config: Mapping[str, Any]) -> list[str]:
    """``{"max_num_seqs": 8, "enable_chunked_prefill": False}`` ->
    ``["--max-num-seqs", "8", "--no-enable-chunked-prefill"]``.

    Keys become ``--kebab-case``; ``True``/``False`` become ``--flag``/``--no-flag``
    (vLLM declares its boolean engine args with ``argparse.BooleanOptionalAction``);
    ``None`` and client-side keys are skipped; lists repeat values after one flag;
    dicts go as compact JSON.  ``model`` is not a flag here: the launcher places it.
    """
    argv: list[str] = []
    for key, value in config.items():
        if value is None or key == "model" or key in CLIENT_PARAMS:
            continue
        flag = "--" + str(key).strip("-").replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            argv.append(flag)
            argv.extend(flag_value(v) for v in value)
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, flag_value(value)]
    return argv


def serve_argv(config: Mapping[str, Any], *, prefix: Sequence[str] = ("vllm", "serve"),
               model_as_flag: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The argv that serves ``config``: ``prefix``, the model (positional, or as
    ``--model`` for prefixes such as ``python -m vllm.entrypoints.openai.api_server``),
    ``extra`` launch arguments, then the config's flags."""
    model = str(config.get("model") or "MODEL")
    placed = ["--model", model] if model_as_flag else [model]
    return [*prefix, *placed, *extra, *config_to_argv(config)]


def command_line(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """A shell line for ``argv`` with ``env`` set in front, every word quoted as the
    shell needs (``shlex.join``): pasting it runs exactly ``argv``."""
    head = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted((env or {}).items()))
    return (head + " " if head else "") + shlex.join([str(a) for a in argv])
