"""``autotune workload PATH``: what a traffic file holds, beside ShareGPT's, and which of
it the simulator models.

The description is ``workload.dataset.describe_workload``'s (lengths, conversations,
shared prefixes, arrivals), taken of the file and of a ShareGPT sample counted with the
same tokenizer, so the two read side by side.  Pure but for the file reads: the CLI
prints :func:`lines`, writes the JSON and draws the plot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.workload.dataset import WorkloadSummary, describe_workload, load_dataset
from autotune.workload.sources import Workload, load_sharegpt
from autotune.workload.tokenizer import Tokenizer

# What the simulator does with each part of a description, said with it.
MODELLED: dict[str, str] = {
    "lengths": "modelled: every request's prompt and output tokens drive the simulated "
               "prefill and decode",
    "conversations": "modelled in closed loops (ceiling --by users|concurrency): a user "
                     "sends a conversation's turns in order, each after the previous "
                     "reply; in open loops each turn arrives on its own",
    "prefixes": "modelled by the simulator's prefix cache (enable_prefix_caching): cached "
                "full blocks skip prefill, up to the KV cache's capacity, with eviction; "
                "a file's shared prefixes are found by hashing its prompts' 16-token "
                "blocks, as vLLM's cache does (prompts given only as a token count share "
                "nothing)",
    "arrivals": "replayed exactly by ceiling --by speed (the trace's own times, sped up or "
                "slowed down); other commands draw Poisson or gamma arrivals "
                "(--burstiness) at a rate",
}


@dataclass(frozen=True)
class Traffic:
    """A file's description and, for comparison, a ShareGPT sample's."""

    ours: WorkloadSummary
    sharegpt: WorkloadSummary | None
    notes: tuple[str, ...]
    prompt_lengths: tuple[int, ...]
    output_lengths: tuple[int, ...]
    sharegpt_prompt_lengths: tuple[int, ...]
    sharegpt_output_lengths: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"workload": dict(self.ours), "sharegpt": (None if self.sharegpt is None
                                                         else dict(self.sharegpt)),
                "notes": list(self.notes), "simulator": dict(MODELLED)}


def describe_traffic(path: str, *, tokenizer: Tokenizer, max_model_len: int,
                     compare: int = 2000, seed: int = 0) -> Traffic:
    """Read ``path`` (every request) and ``compare`` ShareGPT first turns (none: no
    comparison) and describe both."""
    ours = load_dataset(path, tokenizer=tokenizer, max_model_len=max_model_len, seed=seed)
    theirs: Workload | None = None
    if compare > 0:
        theirs = load_sharegpt(tokenizer=tokenizer, num_prompts=compare,
                               max_model_len=max_model_len, seed=seed)
    return Traffic(
        ours=describe_workload(ours),
        sharegpt=None if theirs is None else describe_workload(theirs),
        notes=tuple(ours.notes),
        prompt_lengths=tuple(r.prompt_tokens for r in ours.requests),
        output_lengths=tuple(r.output_tokens for r in ours.requests),
        sharegpt_prompt_lengths=(() if theirs is None
                                 else tuple(r.prompt_tokens for r in theirs.requests)),
        sharegpt_output_lengths=(() if theirs is None
                                 else tuple(r.output_tokens for r in theirs.requests)))


def _len(s: Any) -> str:
    return (f"mean {s['mean']:.0f}, p50 {s['p50']:.0f}, p90 {s['p90']:.0f}, "
            f"p99 {s['p99']:.0f}, max {s['max']}")


def lines(t: Traffic) -> list[str]:
    """The description as the terminal prints it: each part, ShareGPT's beside it, and
    what the simulator does with it."""
    o, s = t.ours, t.sharegpt
    out = [f"{o['source']}: {o['requests']:,} requests, tokens counted with "
           f"{o['tokenizer']}"]
    for key, name in (("prompt_tokens", "prompt tokens"), ("output_tokens", "output tokens")):
        out.append(f"{name}: {_len(o[key])}")  # type: ignore[literal-required]
        if s is not None:
            out.append(f"  ShareGPT ({s['requests']:,} first turns): "
                       f"{_len(s[key])}")  # type: ignore[literal-required]
    out.append(f"  simulator: {MODELLED['lengths']}")
    c = o["conversations"]
    if c["conversations"]:
        out.append(f"conversations: {c['conversations']:,}, {c['turns_mean']:.2f} turns on "
                   f"average (at most {c['turns_max']}), {c['single_requests']:,} requests "
                   "on their own")
    else:
        out.append("conversations: none (every request on its own; ShareGPT's first turns "
                   "are too)")
    out.append(f"  simulator: {MODELLED['conversations']}")
    out.append(f"shared prefixes: {o['shared_prefix_share']:.1%} of prompt tokens declared "
               "shared")
    out.append(f"  simulator: {MODELLED['prefixes']}")
    a = o["arrivals"]
    if a is None:
        out.append("arrivals: no timestamps (the file cannot be replayed as a trace)")
    else:
        rate = "-" if a["rate_per_s"] is None else f"{a['rate_per_s']:.3g} req/s"
        cv = "-" if a["gap_cv"] is None else f"{a['gap_cv']:.2f}"
        out.append(f"arrivals: {a['requests']:,} over {a['span_s']:.0f} s, {rate} on "
                   f"average; gaps' coefficient of variation {cv} (1 = Poisson, above = "
                   "burstier)")
    out.append(f"  simulator: {MODELLED['arrivals']}")
    out += [f"note: {n}" for n in t.notes]
    return out
