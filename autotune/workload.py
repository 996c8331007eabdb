"""Request sources: ShareGPT, synthetic length distributions, fixed prompts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """One request to send: the prompt and how many tokens to ask for."""

    prompt: str
    prompt_tokens: int
    output_tokens: int


@dataclass
class Workload:
    requests: list[Request]
    source: str  # e.g. "sharegpt (ShareGPT_V3_unfiltered_cleaned_split.json)"
    tokenizer: str  # which tokenizer counted the tokens, said in every output
    notes: list[str] = field(default_factory=list)  # e.g. "file ended early: ..."
