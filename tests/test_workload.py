"""Workloads: the tolerant ShareGPT reader, vLLM-style sampling, synthetic and fixed prompts.

Real files (the shipped truncated ShareGPT and hand-made ones) and real tokenizers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import autotune.workload.sources as wl
from autotune.workload.sources import (
    ReadStats,
    WorkloadError,
    build_workload,
    default_sharegpt_path,
    fixed_prompt_workload,
    load_sharegpt,
    read_sharegpt,
    sample_lengths,
    synthetic_workload,
)
from autotune.workload.tokenizer import TekkenTokenizer, Tokenizer, load_tokenizer

SHIPPED_BYTES = 125_509_632
LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A load test sends requests at a fixed rate and measures latency.",
    "The water in the city is good, and the people live near the school.",
    "She said that they will write a new word in the book each day.",
]


def train_tokenizer_json(folder: Path) -> Path:
    """A real byte-level BPE ``tokenizer.json``, small: trained on a few lines."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(LINES * 20, trainer=trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tekken() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(train_tokenizer_json(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def shipped() -> tuple[tuple[wl.Conversation, ...], ReadStats]:
    return read_sharegpt()  # parsed once for the whole module (and cached per process)


def record(i: int, prompt: str, reply: str, *extra: str) -> dict:
    turns = [prompt, reply, *extra]
    roles = ["human", "gpt"] * len(turns)
    return {
        "id": f"c{i}",
        "conversations": [{"from": r, "value": v} for r, v in zip(roles, turns, strict=False)],
    }


def sample_records(n: int) -> list[dict]:
    # Non-ASCII text on purpose: byte offsets must not be character offsets.
    return [
        record(i, f"Question {i}: héllo wörld, 中文 {'and more words ' * (i + 2)}?",
               f"Answer {i} 😀 {'the reply goes on ' * (i + 3)}.")
        for i in range(n)
    ]


def write_array(path: Path, records: list[dict]) -> str:
    text = json.dumps(records, indent=2, ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return text


# ------------------------------------------------------------- the shipped file


def test_shipped_file_is_truncated_and_every_complete_record_is_kept(shipped) -> None:
    conversations, stats = shipped
    path = default_sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    with path.open("rb") as f:
        f.seek(-200, 2)
        assert not f.read().rstrip().endswith(b"]")  # really cut: no closing bracket
    assert stats.file_bytes == SHIPPED_BYTES == path.stat().st_size
    assert stats.records == len(conversations) == 17_671
    assert stats.multi_turn == 17_400
    assert stats.corrupt == 0
    assert stats.ended_early
    assert SHIPPED_BYTES - 10_000 < stats.end_byte < SHIPPED_BYTES
    with path.open("rb") as f:  # the last complete record really ends there
        f.seek(stats.end_byte - 1)
        assert f.read(1) == b"}"
    assert conversations[0].id == "QWJhYvA_0"
    assert conversations[0].turns[0].startswith("Summarize the main ideas of Jeff Walker")


def test_shipped_file_is_parsed_once_per_process(shipped) -> None:
    again = read_sharegpt(default_sharegpt_path())
    assert again is shipped


def test_notes_say_once_how_many_were_read_and_that_the_file_ended_early(tekken) -> None:
    w = load_sharegpt(tokenizer=tekken, num_prompts=50)
    early = [n for n in w.notes if "ended early" in n]
    assert len(early) == 1 and f"{SHIPPED_BYTES:,}" in early[0]
    assert sum("17,671 complete conversations" in n for n in w.notes) == 1
    assert w.source == "sharegpt (ShareGPT_V3_unfiltered_cleaned_split.json)"
    assert w.tokenizer == tekken.name
    assert len(w.requests) == 50


# ------------------------------------------------------------ hand-made files


@pytest.mark.parametrize("chunk", [7, 64, 1 << 23])
def test_hand_made_truncated_file(tmp_path: Path, monkeypatch, chunk: int) -> None:
    # Small read chunks put records across buffer boundaries.
    monkeypatch.setattr(wl, "_CHUNK_CHARS", chunk)
    records = sample_records(5)
    text = write_array(tmp_path / "full.json", records)
    cut_at = text.index("the reply goes on", text.index('"c4"'))  # inside record 5's string
    path = tmp_path / "cut.json"
    path.write_bytes(text[:cut_at].encode())
    conversations, stats = read_sharegpt(path)
    assert [c.id for c in conversations] == ["c0", "c1", "c2", "c3"]
    assert conversations[2].turns == tuple(t["value"] for t in records[2]["conversations"])
    assert stats.ended_early and stats.corrupt == 0 and stats.records == 4
    end_of_c3 = text.index('"c4"')
    end_of_c3 = text.rindex("}", 0, text.rindex("{", 0, end_of_c3)) + 1
    assert stats.end_byte == len(text[:end_of_c3].encode())
    assert stats.end_byte != end_of_c3  # non-ASCII before it: bytes, not characters
    assert any("ended early" in n for n in stats.notes())


def test_complete_file_has_no_early_end_note(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    write_array(path, sample_records(3))
    conversations, stats = read_sharegpt(path)
    assert len(conversations) == 3 and not stats.ended_early and stats.corrupt == 0
    assert not any("ended early" in n for n in stats.notes())


def test_cut_after_a_whole_record_is_still_an_early_end(tmp_path: Path) -> None:
    text = json.dumps(sample_records(3), indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex("}") + 1] + ",\n")  # missing the closing bracket
    conversations, stats = read_sharegpt(path)
    assert len(conversations) == 3 and stats.ended_early


@pytest.mark.parametrize("chunk", [16, 1 << 23])
def test_corrupt_middle_records_are_skipped_and_counted(
    tmp_path: Path, monkeypatch, chunk: int
) -> None:
    monkeypatch.setattr(wl, "_CHUNK_CHARS", chunk)
    parts = [json.dumps(r, indent=2) for r in sample_records(6)]
    parts[2] = parts[2].replace('"from": "gpt",', '"from" "gpt",')  # bad JSON
    parts[4] = json.dumps({"id": "not-a-conversation", "text": "hello"})  # wrong shape
    path = tmp_path / "corrupt.json"
    path.write_text("[\n" + ",\n".join(parts) + "\n]\n")
    conversations, stats = read_sharegpt(path)
    assert [c.id for c in conversations] == ["c0", "c1", "c3", "c5"]
    assert stats.corrupt == 2 and not stats.ended_early
    assert any("skipped 2 corrupt" in n for n in stats.notes())


def test_corrupt_last_record_of_a_closed_file(tmp_path: Path) -> None:
    parts = [json.dumps(r) for r in sample_records(3)]
    parts[2] = parts[2][:-5] + "!!!}"
    path = tmp_path / "bad_last.json"
    path.write_text("[" + ", ".join(parts) + "]")
    conversations, stats = read_sharegpt(path)
    assert [c.id for c in conversations] == ["c0", "c1"]
    assert stats.corrupt == 1 and not stats.ended_early


def test_json_lines_file_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "dump.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in sample_records(4)) + "\n")
    conversations, stats = read_sharegpt(path)
    assert len(conversations) == 4 and not stats.ended_early


@pytest.mark.parametrize(
    "content",
    [
        "",
        "   \n",
        '[\n  {"id": "a", "conversations": [{"from": "human", "value": "hel',
        "hello, this is not JSON",
        '[{"id": "x", "text": "no conversations key"}]',
    ],
)
def test_file_without_a_complete_record_is_an_error_naming_it(tmp_path: Path, content) -> None:
    path = tmp_path / "nothing.json"
    path.write_text(content)
    with pytest.raises(WorkloadError) as err:
        read_sharegpt(path)
    assert str(path) in str(err.value) and "no complete conversation record" in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_path_and_directory_are_errors(tmp_path: Path, tekken) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(WorkloadError, match="dataset file not found") as err:
        load_sharegpt(missing, tokenizer=tekken, num_prompts=1)
    assert str(missing) in str(err.value)
    with pytest.raises(WorkloadError, match="is a directory") as err:
        read_sharegpt(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_changed_file_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "grows.json"
    write_array(path, sample_records(2))
    first, _ = read_sharegpt(path)
    write_array(path, sample_records(3))
    second, _ = read_sharegpt(path)
    assert len(first) == 2 and len(second) == 3


# ------------------------------------------------------------------- sampling


def test_sampling_is_deterministic_by_seed_and_follows_vllms_order(tekken, shipped) -> None:
    a = load_sharegpt(tokenizer=tekken, num_prompts=40, seed=0)
    b = load_sharegpt(tokenizer=tekken, num_prompts=40, seed=0)
    c = load_sharegpt(tokenizer=tekken, num_prompts=40, seed=1)
    assert a.requests == b.requests
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    # vLLM: keep >= 2 turns, random.seed(seed); random.shuffle(data); take in order.
    pool = [conv for conv in shipped[0] if len(conv.turns) >= 2]
    random.seed(0)
    random.shuffle(pool)
    prompts = {r.prompt for r in a.requests}
    first_usable = next(conv for conv in pool if conv.turns[0] in prompts)
    assert a.requests[0].prompt == first_usable.turns[0]
    assert pool.index(first_usable) < 5  # the order, not merely the set, is vLLM's


def test_filters_hold_on_the_real_file(tekken) -> None:
    w = load_sharegpt(tokenizer=tekken, num_prompts=300, max_model_len=512, seed=3)
    assert len(w.requests) == 300
    for r in w.requests:
        assert r.prompt_tokens >= 4 and r.output_tokens >= 4
        assert r.prompt_tokens + r.output_tokens <= 512
    for r in w.requests[:20]:
        assert r.prompt_tokens == tekken.count(r.prompt)
    assert any("over max_model_len=512" in n for n in w.notes)


def test_filters_drop_exactly_the_bad_pairs(tmp_path: Path, tekken) -> None:
    long_text = "word " * 300
    records = [
        record(0, "Hi", "A reply long enough to count here."),  # prompt < 4
        record(1, "Please explain how the load test works.", "Yes."),  # reply < 4
        record(2, long_text, long_text),  # prompt + reply > max_model_len
        record(3, "What is the time to first token of a request?", "It is the delay."),
        record(4, "One turn only, with no reply at all", ""),
        record(5, "Tell me about goodput and why it matters.", "Goodput counts good work."),
    ]
    records[4]["conversations"] = records[4]["conversations"][:1]
    path = tmp_path / "filters.json"
    write_array(path, records)
    w = load_sharegpt(path, tokenizer=tekken, num_prompts=10, max_model_len=400)
    assert sorted(r.prompt for r in w.requests) == sorted(
        [records[3]["conversations"][0]["value"], records[5]["conversations"][0]["value"]]
    )
    assert any("asked for 10 prompts" in n and "only 2 usable" in n for n in w.notes)
    assert w.source == f"sharegpt ({path})"
    # A fixed output length replaces the reply's and skips the reply's minimum.
    fixed = load_sharegpt(path, tokenizer=tekken, num_prompts=10, max_model_len=400,
                          fixed_output_len=100)
    assert {r.output_tokens for r in fixed.requests} == {100}
    assert len(fixed.requests) == 3  # record 1 ("Yes.") now counts


def test_no_usable_pairs_is_an_error(tmp_path: Path, tekken) -> None:
    path = tmp_path / "short.json"
    write_array(path, [record(0, "Hi", "Yo"), record(1, "Ok", "Sure thing, here it is.")])
    with pytest.raises(WorkloadError) as err:
        load_sharegpt(path, tokenizer=tekken, num_prompts=5, max_model_len=1000)
    assert str(err.value).startswith(f"no usable prompt/reply pairs in {path}")
    assert "max_model_len=1000" in str(err.value)


def test_sharegpt_bad_arguments(tekken) -> None:
    with pytest.raises(WorkloadError, match="number of prompts"):
        load_sharegpt(tokenizer=tekken, num_prompts=0)
    with pytest.raises(WorkloadError, match="max_model_len"):
        load_sharegpt(tokenizer=tekken, num_prompts=1, max_model_len=3)


# ------------------------------------------------------------------ synthetic


@pytest.mark.parametrize("distribution,spread", [("fixed", 0.0), ("uniform", 0.5),
                                                 ("lognormal", 0.8)])
def test_synthetic_prompts_have_exactly_the_drawn_token_count(
    tekken, distribution: str, spread: float
) -> None:
    w = synthetic_workload(tekken, num_prompts=60, input_len=200, output_len=50,
                           distribution=distribution, input_spread=spread,
                           output_spread=spread, seed=7)
    rng = np.random.default_rng(7)
    drawn = sample_lengths(200, 60, distribution=distribution, spread=spread, rng=rng)
    assert [r.prompt_tokens for r in w.requests] == drawn.tolist()
    assert [tekken.count(r.prompt) for r in w.requests] == drawn.tolist()
    assert all(r.output_tokens >= 1 for r in w.requests)
    assert len({tuple(r.prompt.split()[:5]) for r in w.requests}) > 50  # no shared prefix
    assert not any("could not" in n for n in w.notes)
    assert w.tokenizer == tekken.name


@pytest.mark.parametrize("n_tokens", [1, 2, 7, 513])
def test_synthetic_exact_under_another_tokenizer(hf_tok, n_tokens: int) -> None:
    w = synthetic_workload(hf_tok, num_prompts=10, input_len=n_tokens, output_len=8)
    assert [hf_tok.count(r.prompt) for r in w.requests] == [n_tokens] * 10
    assert [r.prompt_tokens for r in w.requests] == [n_tokens] * 10
    assert {r.output_tokens for r in w.requests} == {8}


def test_synthetic_is_deterministic_by_seed(tekken) -> None:
    kw = dict(num_prompts=20, input_len=64, output_len=16, distribution="lognormal",
              input_spread=0.5, output_spread=0.5)
    assert synthetic_workload(tekken, seed=1, **kw).requests == synthetic_workload(
        tekken, seed=1, **kw).requests
    assert synthetic_workload(tekken, seed=1, **kw).requests != synthetic_workload(
        tekken, seed=2, **kw).requests


def test_length_distribution_moments() -> None:
    rng = np.random.default_rng(0)
    logn = sample_lengths(500, 20_000, distribution="lognormal", spread=0.5, rng=rng)
    assert abs(logn.mean() / 500 - 1) < 0.02
    assert abs(logn.std() / logn.mean() - 0.5) < 0.03
    assert logn.min() >= 1
    uni = sample_lengths(300, 20_000, distribution="uniform", spread=0.2, rng=rng)
    assert uni.min() == 240 and uni.max() == 360
    assert abs(uni.mean() / 300 - 1) < 0.01
    assert abs(uni.std() - 120 / np.sqrt(12)) < 2
    wide = sample_lengths(3, 5_000, distribution="lognormal", spread=3.0, rng=rng)
    assert wide.min() >= 1
    fixed = sample_lengths(12.4, 5, distribution="fixed", rng=rng)
    assert fixed.tolist() == [12] * 5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(distribution="normal"), "unknown length distribution"),
        (dict(input_spread=-0.1, distribution="uniform"), "spread must be >= 0"),
        (dict(input_spread=1.5, distribution="uniform"), "uniform spread must be <= 1"),
        (dict(input_len=0), "mean length must be >= 1"),
        (dict(num_prompts=0), "number of prompts"),
    ],
)
def test_synthetic_bad_arguments(tekken, kwargs: dict, match: str) -> None:
    args = dict(num_prompts=3, input_len=10, output_len=10) | kwargs
    with pytest.raises(WorkloadError, match=match):
        synthetic_workload(tekken, **args)


def test_fixed_prompt_workload(tekken) -> None:
    prompt = "Explain continuous batching in one paragraph."
    w = fixed_prompt_workload(prompt, tokenizer=tekken, output_len=64, num_prompts=5)
    assert len(w.requests) == 5
    assert {r.prompt for r in w.requests} == {prompt}
    assert {r.prompt_tokens for r in w.requests} == {tekken.count(prompt)}
    assert {r.output_tokens for r in w.requests} == {64}
    assert any("prefix caching" in n for n in w.notes)
    with pytest.raises(WorkloadError, match="empty"):
        fixed_prompt_workload("", tokenizer=tekken, output_len=1, num_prompts=1)
    with pytest.raises(WorkloadError, match="output length"):
        fixed_prompt_workload("x", tokenizer=tekken, output_len=0, num_prompts=1)


def test_build_workload_dispatches(tekken, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write_array(path, sample_records(4))
    share = build_workload("sharegpt", tokenizer=tekken, num_prompts=3, dataset_path=path)
    assert share.source.startswith("sharegpt") and len(share.requests) == 3
    synth = build_workload("synthetic", tokenizer=tekken, num_prompts=4, input_len=32,
                           output_len=8)
    assert [r.prompt_tokens for r in synth.requests] == [32] * 4
    fixed = build_workload("fixed", tokenizer=tekken, num_prompts=2, prompt="Hello there")
    assert fixed.source.startswith("fixed") and {r.output_tokens for r in fixed.requests} == {128}
    with pytest.raises(WorkloadError, match="needs a prompt"):
        build_workload("fixed", tokenizer=tekken, num_prompts=2)
    with pytest.raises(WorkloadError, match="unknown workload kind"):
        build_workload("sonnet", tokenizer=tekken, num_prompts=2)


def test_tekken_is_loaded_once_per_process() -> None:
    a, b = TekkenTokenizer(), load_tokenizer()
    assert a._tok is b._tok
