"""Your own traffic: JSON lines, CSV and OpenAI request logs read into a Workload.

Small files written in tmp_path, read with the real offline tokenizer (mistral-common's
tekken).  Every bad input must give one line naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from autotune.workload import dataset
from autotune.workload.arrivals import arrival_offsets
from autotune.workload.dataset import describe_workload, load_dataset
from autotune.workload.sources import Request, Workload
from autotune.workload.tokenizer import Tokenizer, WorkloadError, load_tokenizer

BIG = 1 << 20  # a max_model_len no small test reaches


@pytest.fixture(scope="module")
def tekken() -> Tokenizer:
    return load_tokenizer()


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_csv(path: Path, rows: list[list[Any]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def load(path: Path, tok: Tokenizer, **kw: Any) -> Workload:
    kw.setdefault("max_model_len", BIG)
    return load_dataset(path, tokenizer=tok, **kw)


def error_of(path: Path, tok: Tokenizer, **kw: Any) -> str:
    with pytest.raises(WorkloadError) as info:
        load(path, tok, **kw)
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg, msg
    return msg


# --------------------------------------------------------------------------- formats


def test_jsonl_prompt_text_is_counted_and_output_aliases_are_read(
    tmp_path: Path, tekken: Tokenizer
) -> None:
    prompts = ["Tell me a story about a lighthouse.", "What is 2 + 2?",
               "Résumé: naïve café, 東京 and emoji 🚀 in one prompt."]
    path = write_jsonl(tmp_path / "my.jsonl", [
        {"prompt": prompts[0], "output_tokens": 120},
        {"prompt": prompts[1], "max_tokens": 5, "extra": "ignored"},
        {"Prompt": prompts[2], "Output-Len": "64"},  # any case, hyphens, a count as text
    ])
    w = load(path, tekken)
    assert [r.prompt for r in w.requests] == prompts
    assert [r.prompt_tokens for r in w.requests] == [tekken.count(p) for p in prompts]
    assert [r.output_tokens for r in w.requests] == [120, 5, 64]
    assert all(r.arrival_s is None and r.conversation is None for r in w.requests)
    assert w.source == f"dataset {path} (jsonl, 3 requests of 3 lines)"
    assert w.tokenizer == tekken.name


@pytest.mark.parametrize("alias", ["prompt_tokens", "input_tokens", "input_len"])
@pytest.mark.parametrize("n_tokens", [1, 7, 513])
def test_a_prompt_token_count_builds_a_prompt_of_exactly_that_many_tokens(
    tmp_path: Path, tekken: Tokenizer, alias: str, n_tokens: int
) -> None:
    path = write_jsonl(tmp_path / "counts.ndjson",
                       [{alias: n_tokens, "output_len": 9} for _ in range(12)])
    w = load(path, tekken)
    assert [tekken.count(r.prompt) for r in w.requests] == [n_tokens] * 12
    assert [r.prompt_tokens for r in w.requests] == [n_tokens] * 12
    assert {r.output_tokens for r in w.requests} == {9}
    if n_tokens > 4:  # random words: the built prompts share no prefix
        assert len({tuple(r.prompt.split()[:3]) for r in w.requests}) > 6
    assert any("12 prompt(s) given only as a token count" in n for n in w.notes)
    assert not any("could not hit" in n for n in w.notes)


def test_built_prompts_follow_the_seed(tmp_path: Path, tekken: Tokenizer) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt_tokens": 40, "output_tokens": 4}] * 5)
    a, b, c = (load(path, tekken, seed=s) for s in (1, 1, 2))
    assert a.requests == b.requests
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    assert "seed 2" in " ".join(c.notes)


def test_text_wins_over_a_given_count_and_a_big_difference_is_said(
    tmp_path: Path, tekken: Tokenizer
) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 10
    real = tekken.count(text)
    path = write_jsonl(tmp_path / "both.jsonl", [
        {"prompt": text, "prompt_tokens": real + 1, "output_tokens": 8},  # close: no note
        {"prompt": text, "prompt_tokens": real * 2, "output_tokens": 8},  # far off: noted
    ])
    w = load(path, tekken)
    assert [r.prompt_tokens for r in w.requests] == [real, real]
    (note,) = [n for n in w.notes if "differs from the tokenizer" in n]
    assert note.startswith("1 prompt(s)")
    assert f"line 2: {real * 2:,} given, {real:,} counted" in note


def test_csv_reads_like_jsonl_with_quoted_commas_and_newlines(
    tmp_path: Path, tekken: Tokenizer
) -> None:
    rows = [
        {"prompt": "Plain prompt", "output_tokens": 10, "timestamp": 5.0,
         "conversation_id": "c1"},
        {"prompt": 'Commas, "quotes" and\na newline', "output_tokens": 20, "timestamp": 5.5,
         "conversation_id": "c1"},
        {"prompt": "Third", "output_tokens": 30, "timestamp": 7.0, "conversation_id": "c2"},
    ]
    jl = load(write_jsonl(tmp_path / "x.jsonl", rows), tekken)
    header = ["prompt", "output_tokens", "timestamp", "conversation_id"]
    cv = load(write_csv(tmp_path / "x.csv", [header] + [[r[h] for h in header] for r in rows]),
              tekken)
    assert cv.requests == jl.requests
    assert [r.arrival_s for r in cv.requests] == [0.0, 0.5, 2.0]
    assert [(r.conversation, r.turn) for r in cv.requests] == [("c1", 0), ("c1", 1), ("c2", 0)]
    # The header is line 1 and the quoted newline takes two lines: 5 lines in all.
    assert cv.source == f"dataset {tmp_path / 'x.csv'} (csv, 3 requests of 5 lines)"


def test_csv_with_a_bom_counts_and_text_in_one_file(tmp_path: Path, tekken: Tokenizer) -> None:
    path = tmp_path / "mixed.csv"
    path.write_text("\ufeffprompt,prompt_tokens,max_tokens\nHello world,,16\n,33,8\n",
                    encoding="utf-8")
    w = load(path, tekken)
    assert [r.prompt for r in w.requests][0] == "Hello world"
    assert [r.prompt_tokens for r in w.requests] == [tekken.count("Hello world"), 33]
    assert tekken.count(w.requests[1].prompt) == 33


def test_public_trace_columns_read_as_they_are(tmp_path: Path, tekken: Tokenizer) -> None:
    azure = write_csv(tmp_path / "AzureLLMInferenceTrace_conv.csv", [
        ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
        ["2023-11-16 18:15:46.6805900", 374, 44],
        ["2023-11-16 18:15:50.9951690", 396, 109],
    ])
    w = load(azure, tekken)
    assert [(r.prompt_tokens, r.output_tokens) for r in w.requests] == [(374, 44), (396, 109)]
    assert [r.arrival_s for r in w.requests] == [0.0, pytest.approx(4.314579, abs=1e-9)]
    burst = write_csv(tmp_path / "BurstGPT.csv", [
        ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"],
        [5, "ChatGPT", 472, 18, 490, "Conversation log"],
        [45, "ChatGPT", 1087, 231, 1318, "Conversation log"],
    ])
    w = load(burst, tekken)
    assert [(r.prompt_tokens, r.output_tokens, r.arrival_s) for r in w.requests] == [
        (472, 18, 0.0), (1087, 231, 40.0)]


def test_gzip_file_reads_the_same(tmp_path: Path, tekken: Tokenizer) -> None:
    records = [{"prompt": f"Question number {i}?", "output_tokens": i + 1} for i in range(5)]
    plain = load(write_jsonl(tmp_path / "t.jsonl", records), tekken)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "t.jsonl").read_bytes()))
    assert load(gz, tekken).requests == plain.requests


# ------------------------------------------------------------------------ openai logs


def test_openai_chat_log(tmp_path: Path, tekken: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": [{"type": "text", "text": "Another?"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    joined = "system: You are terse.\n\nuser: Name a prime.\n\nassistant: 7\n\nuser: Another?"
    path = write_jsonl(tmp_path / "log.jsonl", [
        # As a proxy logs it: request and response side by side.
        {"request": {"model": "m", "messages": msgs, "max_tokens": 4096},
         "response": {"created": 1714567890, "usage": {"prompt_tokens": 30,
                                                       "completion_tokens": 3}}},
        # OpenAI Batch style: the request under "body", no usage: the cap is the length.
        {"custom_id": "r2", "body": {"messages": msgs[:2], "max_completion_tokens": 50,
                                     "max_tokens": 60}, "timestamp": 1714567891.5},
        # The bare request with its usage beside it.
        {"messages": msgs[1:2], "max_tokens": 100, "usage": {"completion_tokens": 12},
         "created": 1714567892},
    ])
    w = load(path, tekken)
    assert [r.prompt for r in w.requests] == [joined, "system: You are terse.\n\nuser: Name "
                                              "a prime.", "user: Name a prime."]
    assert [r.prompt_tokens for r in w.requests] == [tekken.count(r.prompt) for r in w.requests]
    # What was generated beats the cap; max_completion_tokens beats max_tokens.
    assert [r.output_tokens for r in w.requests] == [3, 50, 12]
    assert [r.arrival_s for r in w.requests] == [0.0, 1.5, 2.0]
    assert w.source == f"dataset {path} (openai chat log, 3 requests of 3 lines)"
    notes = " | ".join(w.notes)
    assert "1 logged request(s) have no usage.completion_tokens" in notes
    assert "1 chat request(s) had images or audio" in notes


# --------------------------------------------------------------- conversations, time


def test_conversations_and_turns_in_file_order(tmp_path: Path, tekken: Tokenizer) -> None:
    ids: list[Any] = ["a", "b", "a", None, 7, "b", "a", 7]
    path = write_jsonl(tmp_path / "conv.jsonl", [
        {"prompt": f"turn {i}", "output_tokens": 4,
         **({} if c is None else {"session_id" if i % 2 else "conversation_id": c})}
        for i, c in enumerate(ids)])
    w = load(path, tekken)
    assert [(r.conversation, r.turn) for r in w.requests] == [
        ("a", 0), ("b", 0), ("a", 1), (None, 0), ("7", 0), ("b", 1), ("a", 2), ("7", 1)]
    assert any("3 conversation(s)" in n and "up to 3 turns" in n for n in w.notes)


def test_shared_prefixes_are_found_in_the_prompt_texts(tmp_path: Path,
                                                       tekken: Tokenizer) -> None:
    """A system prompt before every question, and a conversation whose second turn
    resends the first: each request declares the 16-token blocks it shares (as vLLM's
    chained block hashes would find them), one key per block whoever holds it."""
    from autotune.sim.scheduler import block_ids

    system = "You are a careful assistant for a hardware store. " * 12
    first = system + "User: Which drill for concrete walls?\nAssistant:"
    second = first + " A hammer drill with masonry bits.\nUser: And for tiles?\nAssistant:"
    path = write_jsonl(tmp_path / "shared.jsonl", [
        {"prompt": system + "User: Do you sell paint?", "output_tokens": 8},
        {"prompt": first, "output_tokens": 8, "conversation_id": "c"},
        {"prompt": "Completely unrelated words about the sea and its tides.",
         "output_tokens": 8},
        {"prompt": second, "output_tokens": 8, "conversation_id": "c"},
    ])
    w = load(path, tekken)
    sys_blocks = len(tekken.encode(system)) // 16 - 1  # the boundary may merge tokens
    depth = [max((t for _, t in r.prefix), default=0) // 16 for r in w.requests]
    assert depth[0] >= sys_blocks and depth[1] >= sys_blocks
    assert depth[2] == 0  # shares nothing
    assert depth[3] >= len(tekken.encode(first)) // 16 - 1  # the history it resends
    ids = [set(block_ids(r.prefix, r.prompt_tokens, 16)) for r in w.requests]
    assert len(ids[0] & ids[1] & ids[3]) >= sys_blocks  # the system prompt: same keys
    assert len(ids[1] & ids[3]) > len(ids[0] & ids[3])  # the history shared on top
    assert any("share their first tokens" in n for n in w.notes)
    assert describe_workload(w)["shared_prefix_share"] > 0.5


def test_a_file_s_shared_prefixes_reach_the_simulated_prefix_cache(
        tmp_path: Path, tekken: Tokenizer) -> None:
    """The simulator with prefix caching hits what a file's prompts share, and nothing
    without caching or with prompts that share nothing."""
    from autotune.sim import EngineConfig, load_hardware, load_model, simulate

    system = "Answer in one short sentence, in plain English, for a curious child. " * 20
    rng = np.random.default_rng(0)
    words = ["river", "cloud", "engine", "violin", "garden", "planet", "copper", "lantern"]
    questions = [" ".join(rng.choice(words, 12)) + "?" for _ in range(60)]
    shared = write_jsonl(tmp_path / "shared.jsonl", [
        {"prompt": system + q, "output_tokens": 4} for q in questions])
    alone = write_jsonl(tmp_path / "alone.jsonl", [
        {"prompt": q + " " + system[::-1], "output_tokens": 4} for q in questions])
    model = load_model("tiny")

    def hit_rate(path: Path, caching: bool) -> float:
        reqs = load(path, tekken).requests
        cfg = EngineConfig.from_flags({"model": "tiny", "max_model_len": 2048,
                                       "enable_prefix_caching": caching})
        res = simulate(cfg, load_hardware("cpu-tiny"), model, reqs,
                       arrival_offsets(len(reqs), 2.0, seed=0))
        return res.prefix_cache_hits / max(res.prefix_cache_queries, 1)

    assert hit_rate(shared, True) > 0.5
    assert hit_rate(shared, False) == 0.0
    assert hit_rate(alone, True) == 0.0


@pytest.mark.parametrize("stamps,expected", [
    ([1000.5, 1001.0, 1001.0, 1003.25], [0.0, 0.5, 0.5, 2.75]),  # equal times are fine
    (["1700000000", "1700000000.125", "1700000060"], [0.0, 0.125, 60.0]),
    (["2024-05-01T12:00:00Z", "2024-05-01T14:00:00.5+02:00", "2024-05-01 12:00:01.2500000",
      "2024-05-01T12:01:00.000001"], [0.0, 0.5, 1.25, 60.000001]),
])
def test_timestamps_become_seconds_from_the_first(
    tmp_path: Path, tekken: Tokenizer, stamps: list[Any], expected: list[float]
) -> None:
    key = ["timestamp", "arrival_time"]
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt_tokens": 5, "output_tokens": 5, key[i % 2]: s} for i, s in enumerate(stamps)])
    w = load(path, tekken)
    assert [r.arrival_s for r in w.requests] == pytest.approx(expected, abs=1e-9)


# ----------------------------------------------------------------- stopping, reading


def test_num_prompts_stops_early_and_says_so(tmp_path: Path, tekken: Tokenizer) -> None:
    lines = [json.dumps({"prompt": f"prompt {i}", "output_tokens": 3}) for i in range(10)]
    path = tmp_path / "early.jsonl"
    # Everything after the first 10 requests is broken: it must never be parsed.
    path.write_text("\n".join(lines[:4] + [""] + lines[4:] + ["{not json", "[1, 2]"]) + "\n")
    w = load(path, tekken, num_prompts=10)
    assert [r.prompt for r in w.requests] == [f"prompt {i}" for i in range(10)]
    assert w.source == f"dataset {path} (jsonl, 10 requests of the first 11 lines)"
    assert any("stopped after --num-prompts 10" in n for n in w.notes)
    assert any("skipped 1 blank line" in n for n in w.notes)
    with pytest.raises(WorkloadError, match="line 12: not valid JSON"):
        load(path, tekken, num_prompts=11)


class CountingFile:
    """A binary file that counts the lines taken from it."""

    def __init__(self, path: Path) -> None:
        self._f = path.open("rb")
        self.lines = 0

    def __iter__(self) -> CountingFile:
        return self

    def __next__(self) -> bytes:
        line = next(self._f)
        self.lines += 1
        return line

    def __enter__(self) -> CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


@pytest.mark.parametrize("ext", ["jsonl", "csv"])
def test_reading_is_incremental(
    tmp_path: Path, tekken: Tokenizer, monkeypatch: pytest.MonkeyPatch, ext: str
) -> None:
    path = tmp_path / f"huge.{ext}"
    n_lines = 200_000
    if ext == "jsonl":
        body = "".join(f'{{"prompt_tokens": {i % 50 + 1}, "output_tokens": 8}}\n'
                       for i in range(n_lines))
    else:
        body = "prompt_tokens,output_tokens\n" + "".join(f"{i % 50 + 1},8\n"
                                                         for i in range(n_lines))
    path.write_text(body)
    opened: list[CountingFile] = []

    def counting_open(p: Path) -> CountingFile:
        opened.append(CountingFile(p))
        return opened[0]

    monkeypatch.setattr(dataset, "_open_binary", counting_open)
    w = load(path, tekken, num_prompts=10)
    assert len(w.requests) == 10
    header = 1 if ext == "csv" else 0
    assert opened[0].lines == 10 + header  # not one line more than the requests kept
    assert [r.prompt_tokens for r in w.requests] == list(range(1, 11))


# ------------------------------------------------------------------------- bad input

# (file name, content, line, field): the one-line error must begin "<path> line N: field".
BAD: list[tuple[str, str, int, str]] = [
    ("bad.jsonl", '{"prompt": "a", "output_tokens": 4}\n{"prompt": "b", "output_tokens": 4\n',
     2, "not valid JSON"),
    ("bad.jsonl", '{"prompt": "a", "output_tokens": 4}\n\n[1, 2]\n', 3, "a list is not"),
    ("bad.jsonl", '{"prompt": "a", "output_tokens": 4}\n{"prompt": "b"}\n', 2, "output_tokens:"),
    ("bad.jsonl", '{"output_tokens": 4}\n', 1, "prompt:"),
    ("bad.jsonl", '{"prompt": "", "output_tokens": 4}\n', 1, "prompt:"),
    ("bad.jsonl", '{"prompt": 12, "output_tokens": 4}\n', 1, "prompt: 12 is not text"),
    ("bad.jsonl", '{"prompt": "a", "output_tokens": -3}\n', 1, "output_tokens: -3 is negative"),
    ("bad.jsonl", '{"prompt": "a", "max_tokens": 12.5}\n', 1, "max_tokens: 12.5 is not a whole"),
    ("bad.jsonl", '{"prompt": "a", "output_len": "many"}\n', 1, "output_len: 'many' is not"),
    ("bad.jsonl", '{"prompt": "a", "output_tokens": true}\n', 1, "output_tokens: true is not"),
    ("bad.jsonl", '{"prompt": "a", "output_tokens": 0}\n', 1, "output_tokens: 0 tokens"),
    ("bad.jsonl", '{"input_len": -1, "output_tokens": 2}\n', 1, "input_len: -1 is negative"),
    ("bad.jsonl", '{"prompt": "a", "output_tokens": 2, "output_len": 3}\n', 1,
     "output_tokens: both output_tokens (2) and output_len (3)"),
    ("bad.jsonl", '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": 10}\n'
                  '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": 12}\n'
                  '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": 11.5}\n',
     3, "timestamp: 11.5 is 0.5 s before line 2's"),
    ("bad.jsonl", '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": "2024-05-01T12:00:01Z"}\n'
                  '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": "2024-05-01T12:00:00Z"}\n',
     2, "timestamp: '2024-05-01T12:00:00Z' is 1 s before line 1's"),
    ("bad.jsonl", '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": 10}\n'
                  '{"prompt_tokens": 5, "output_tokens": 2}\n', 2, "timestamp: missing"),
    ("bad.jsonl", '{"prompt_tokens": 5, "output_tokens": 2}\n'
                  '{"prompt_tokens": 5, "output_tokens": 2, "arrival_time": 3}\n', 2,
     "arrival_time: line 1 has no timestamp"),
    ("bad.jsonl", '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": "yesterday"}\n', 1,
     "timestamp: 'yesterday' is not a time"),
    ("bad.jsonl", '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": 1714567890}\n'
                  '{"prompt_tokens": 5, "output_tokens": 2, "timestamp": "2024-05-01T12:00Z"}\n',
     2, "timestamp: '2024-05-01T12:00Z' is an ISO-8601 time but line 1's is a number"),
    ("bad.jsonl", '{"prompt_tokens": 5, "output_tokens": 2, "session_id": [1]}\n', 1,
     "session_id: a list is not an id"),
    ("bad.jsonl", '{"prompt_tokens": 60, "output_tokens": 2}\n'
                  '{"prompt_tokens": 90, "output_len": 20}\n', 2,
     "prompt_tokens: 90 prompt tokens + output_len 20 = 110, over max_model_len 100"),
    ("bad.jsonl", '{"prompt": "x", "output_tokens": 101}\n', 1, "prompt: 1 prompt tokens"),
    ("bad.jsonl", '{"messages": "hi", "max_tokens": 3}\n', 1, "messages: 'hi' is not a list"),
    ("bad.jsonl", '{"messages": [{"content": "hi"}], "max_tokens": 3}\n', 1, "messages[1]:"),
    ("bad.jsonl", '{"request": {"messages": [{"role": "user", "content": "hi"}]}}\n', 1,
     "output_tokens: missing; give output_tokens (or output_len, max_tokens), or log the "
     "response's usage.completion_tokens"),
    ("bad.csv", "prompt,output_tokens\nhello,4\nhi,there,4\n", 3, "3 fields but the header"),
    ("bad.csv", "prompt,output_tokens\nhello,4\nhi,-4\n", 3, "output_tokens: '-4' is negative"),
    ("bad.csv", "prompt,tokens\nhello,4\n", 1, "output_tokens: no output column"),
    ("bad.csv", "id,max_tokens\n1,4\n", 1, "prompt: no prompt column"),
    ("bad.csv", "prompt,Prompt,max_tokens\na,b,4\n", 1, "Prompt: the header names column"),
    ("bad.csv", 'prompt,max_tokens\n"an open quote,4\nmore,5\n', 2, "not valid CSV"),
    ("bad.csv", "prompt,max_tokens,conversation_id\nhi,4,a\nhi,,a\n", 3,
     "output_tokens: missing"),
]


@pytest.mark.parametrize("name,content,line,field", BAD,
                         ids=[f"{i}-{b[3][:30]}" for i, b in enumerate(BAD)])
def test_bad_input_is_one_line_naming_file_line_and_field(
    tmp_path: Path, tekken: Tokenizer, name: str, content: str, line: int, field: str
) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    msg = error_of(path, tekken, max_model_len=100)
    assert msg.startswith(f"{path} line {line}: {field}"), msg


def test_non_utf8_bytes_name_their_line(tmp_path: Path, tekken: Tokenizer) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "output_tokens": 2}\n{"prompt": "caf\xe9", '
                     b'"output_tokens": 2}\n')
    msg = error_of(path, tekken)
    assert msg.startswith(f"{path} line 2: not UTF-8 text (byte 0xe9"), msg


def test_the_first_bad_line_is_named_even_when_found_later(
    tmp_path: Path, tekken: Tokenizer
) -> None:
    # Line 2's prompt is too long only once counted (in a batch); line 4 is not JSON.
    path = tmp_path / "order.jsonl"
    path.write_text('{"prompt": "short", "output_tokens": 2}\n'
                    + json.dumps({"prompt": "word " * 200, "output_tokens": 2}) + "\n"
                    + '{"prompt": "short", "output_tokens": 2}\n{oops\n')
    msg = error_of(path, tekken, max_model_len=100)
    assert msg.startswith(f"{path} line 2: prompt: "), msg
    assert "over max_model_len 100" in msg


@pytest.mark.parametrize("name,content,needle", [
    ("empty.jsonl", "", "no request"),
    ("blank.jsonl", "\n  \n\n", "no request"),
    ("header.csv", "prompt,output_tokens\n", "a header row but no request"),
    ("empty.csv", "", "line 1: no header row"),
    ("notes.txt", "hello\n", "unknown dataset file ending '.txt'"),
    ("noext", "hello\n", "unknown dataset file ending none"),
    ("share.json", "[]", "--dataset sharegpt"),
])
def test_file_level_errors_are_one_line_naming_the_file(
    tmp_path: Path, tekken: Tokenizer, name: str, content: str, needle: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    msg = error_of(path, tekken)
    assert str(path) in msg and needle in msg, msg


def test_missing_file_directory_and_bad_arguments(tmp_path: Path, tekken: Tokenizer) -> None:
    missing = tmp_path / "nope.jsonl"
    assert error_of(missing, tekken) == f"dataset file not found: {missing}"
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    assert "is a directory" in error_of(folder, tekken)
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a", "output_tokens": 1}])
    assert "number of prompts must be >= 1" in error_of(ok, tekken, num_prompts=0)
    assert "unknown dataset format 'xml'" in error_of(ok, tekken, file_format="xml")
    # A format given by name reads a file whatever its ending.
    odd = tmp_path / "traffic.log"
    odd.write_text("prompt,output_tokens\nhi,3\n")
    assert load(odd, tekken, file_format="csv").requests[0].output_tokens == 3


def test_broken_gzip_is_one_line(tmp_path: Path, tekken: Tokenizer) -> None:
    path = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(b'{"prompt": "a", "output_tokens": 2}\n' * 1000)
    path.write_bytes(data[: len(data) // 2])
    msg = error_of(path, tekken)
    assert msg.startswith(f"{path} line ") and "gzip" in msg, msg


# -------------------------------------------------------------------------- describe


def req(prompt_tokens: int, output_tokens: int = 1, **kw: Any) -> Request:
    return Request(prompt="p", prompt_tokens=prompt_tokens, output_tokens=output_tokens, **kw)


def test_describe_lengths_conversations_and_prefixes() -> None:
    # Prompt lengths 1..101: the median is 51, p90 91, p99 100 exactly.
    reqs = [req(n, output_tokens=2 * n) for n in range(1, 102)]
    s = describe_workload(Workload(reqs, source="s", tokenizer="t"))
    assert s["requests"] == 101
    assert s["prompt_tokens"] == {"mean": 51.0, "p50": 51.0, "p90": 91.0, "p99": 100.0,
                                  "max": 101}
    assert s["output_tokens"]["p50"] == 102.0 and s["output_tokens"]["max"] == 202
    assert s["conversations"] == {"conversations": 0, "turns_mean": None, "turns_max": None,
                                  "single_requests": 101}
    assert s["shared_prefix_share"] == 0.0 and s["arrivals"] is None

    reqs = [
        req(100, prefix=(("sys", 40), ("conv-a", 80)), conversation="a", turn=0),
        req(300, prefix=(("sys", 40),), conversation="a", turn=1),
        req(100, conversation="b"),
        req(50, prefix=(("big", 90),)),  # a prefix longer than the prompt counts as it all
    ]
    s = describe_workload(Workload(reqs, source="s", tokenizer="t"))
    assert s["conversations"] == {"conversations": 2, "turns_mean": 1.5, "turns_max": 2,
                                  "single_requests": 1}
    assert s["shared_prefix_share"] == pytest.approx((80 + 40 + 0 + 50) / 550)


@pytest.mark.parametrize("process,burstiness,cv", [
    ("constant", 1.0, 0.0), ("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)])
def test_describe_arrival_burstiness(process: Any, burstiness: float, cv: float) -> None:
    # Gamma gaps of shape k have a coefficient of variation of 1/sqrt(k).
    times = arrival_offsets(20_000, 8.0, process=process, burstiness=burstiness, seed=3)
    reqs = [req(10, arrival_s=float(t)) for t in times]
    arr = describe_workload(Workload(reqs, source="s", tokenizer="t"))["arrivals"]
    assert arr is not None and arr["requests"] == 20_000
    assert arr["rate_per_s"] == pytest.approx(8.0, rel=1e-9)
    assert arr["gap_cv"] == pytest.approx(cv, abs=0.06)


def test_describe_edge_cases() -> None:
    one = describe_workload(Workload([req(5, arrival_s=0.0)], source="s", tokenizer="t"))
    assert one["arrivals"] == {"requests": 1, "span_s": 0.0, "rate_per_s": None, "gap_cv": None}
    with pytest.raises(WorkloadError, match="no requests"):
        describe_workload(Workload([], source="s", tokenizer="t"))


def test_describe_a_loaded_dataset(tmp_path: Path, tekken: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 300, size=200).tolist()
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt_tokens": n, "output_tokens": 7, "timestamp": i * 0.25,
         "conversation_id": f"c{i % 40}"} for i, n in enumerate(lens)])
    s = describe_workload(load(path, tekken))
    assert s["prompt_tokens"]["max"] == max(lens)
    assert s["prompt_tokens"]["mean"] == pytest.approx(sum(lens) / len(lens))
    assert s["conversations"]["conversations"] == 40 and s["conversations"]["turns_max"] == 5
    arr = s["arrivals"]
    assert arr is not None and arr["rate_per_s"] == pytest.approx(4.0)
    assert arr["gap_cv"] == pytest.approx(0.0, abs=1e-9)
