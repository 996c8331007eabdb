"""The request pool of a one-config command (ceiling, calibrate): ShareGPT (first turns,
or whole conversations with ``--multi-turn``), synthetic requests, or a user's own file
(``--dataset PATH``), with a shared system prompt when ``--prefix-share`` asks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autotune.workload.conversations import load_conversations, with_system_prompt
from autotune.workload.dataset import load_dataset
from autotune.workload.sources import Workload, load_sharegpt, synthetic_workload
from autotune.workload.tokenizer import WorkloadError, load_tokenizer

# The named sources; anything else given as --dataset is a file's path.
NAMED: tuple[str, ...] = ("sharegpt", "synthetic")


def is_file_dataset(dataset: str) -> bool:
    return dataset not in NAMED


@dataclass(frozen=True, kw_only=True)
class PoolOptions:
    """Where a command's requests come from: ``--dataset`` (sharegpt, synthetic or a
    file's path), ``--multi-turn`` and ``--prefix-share``, checked when built."""

    dataset: str = "sharegpt"
    multi_turn: bool = False
    prefix_share: float = 0.0

    def __post_init__(self) -> None:
        check_shape(self.dataset, multi_turn=self.multi_turn, prefix_share=self.prefix_share)
        if is_file_dataset(self.dataset) and not Path(self.dataset).is_file():
            raise WorkloadError(f"--dataset {self.dataset}: no such file; give sharegpt, "
                                "synthetic, or the path of a JSONL or CSV file of requests")

    def spec(self) -> dict[str, object]:
        """For a stored study spec: what a worker needs to build the same pool."""
        # A worker may start in another folder: a file is stored by its absolute path.
        dataset = (str(Path(self.dataset).resolve()) if is_file_dataset(self.dataset)
                   else self.dataset)
        return {"dataset": dataset, "multi_turn": self.multi_turn,
                "prefix_share": self.prefix_share}


def check_shape(dataset: str, *, multi_turn: bool, prefix_share: float) -> None:
    """Refuse, in one line, a pool these options cannot build (before anything runs)."""
    if multi_turn and dataset != "sharegpt":
        raise WorkloadError("--multi-turn builds conversations from ShareGPT's; a file's "
                            "conversations come from its conversation_id column")
    if not 0.0 <= prefix_share < 1.0:
        raise WorkloadError(f"--prefix-share must be at least 0 and under 1 (the share of "
                            f"prompt tokens in a shared system prompt), got {prefix_share:g}")


def pool_workload(*, dataset: str, tokenizer_path: str | None, url: str | None,
                  model: str | None, total: int, seed: int, context: int, input_len: int,
                  output_len: int, multi_turn: bool = False,
                  prefix_share: float = 0.0) -> Workload:
    """``total`` ShareGPT pairs that fit ``context`` (whole conversations, each turn
    resending the history, with ``multi_turn``), synthetic requests around
    ``input_len``/``output_len`` tokens, or every request of the file ``dataset`` (in
    its order: a trace's requests are replayed as logged); with ``prefix_share``, one
    system prompt shared by every request makes that share of the prompt tokens."""
    check_shape(dataset, multi_turn=multi_turn, prefix_share=prefix_share)
    tok = load_tokenizer(tokenizer_path, server_url=url, model=model)
    if dataset == "sharegpt" and multi_turn:
        wl = load_conversations(tokenizer=tok, num_prompts=total, max_model_len=context,
                                seed=seed)
    elif dataset == "sharegpt":
        wl = load_sharegpt(tokenizer=tok, num_prompts=total, max_model_len=context,
                           seed=seed)
    elif dataset == "synthetic":
        wl = synthetic_workload(tok, num_prompts=total, input_len=input_len,
                                output_len=output_len, distribution="lognormal",
                                input_spread=0.5, output_spread=0.5, seed=seed)
    else:
        wl = load_dataset(dataset, tokenizer=tok, max_model_len=context, seed=seed)
    if prefix_share > 0:
        wl = with_system_prompt(wl, share=prefix_share, tokenizer=tok,
                                max_model_len=context, seed=seed)
    return wl
