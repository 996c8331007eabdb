"""The request pool of a one-config command (ceiling, calibrate): ShareGPT, synthetic
requests, or a user's own file (``--dataset PATH``)."""

from __future__ import annotations

from autotune.workload.dataset import load_dataset
from autotune.workload.sources import Workload, load_sharegpt, synthetic_workload
from autotune.workload.tokenizer import load_tokenizer

# The named sources; anything else given as --dataset is a file's path.
NAMED: tuple[str, ...] = ("sharegpt", "synthetic")


def is_file_dataset(dataset: str) -> bool:
    return dataset not in NAMED


def pool_workload(*, dataset: str, tokenizer_path: str | None, url: str | None,
                  model: str | None, total: int, seed: int, context: int, input_len: int,
                  output_len: int) -> Workload:
    """``total`` ShareGPT pairs that fit ``context``, synthetic requests around
    ``input_len``/``output_len`` tokens, or every request of the file ``dataset`` (in
    its order: a trace's requests are replayed as logged)."""
    tok = load_tokenizer(tokenizer_path, server_url=url, model=model)
    if dataset == "sharegpt":
        return load_sharegpt(tokenizer=tok, num_prompts=total, max_model_len=context,
                             seed=seed)
    if dataset == "synthetic":
        return synthetic_workload(tok, num_prompts=total, input_len=input_len,
                                  output_len=output_len, distribution="lognormal",
                                  input_spread=0.5, output_spread=0.5, seed=seed)
    return load_dataset(dataset, tokenizer=tok, max_model_len=context, seed=seed)
