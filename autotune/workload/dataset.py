"""Your own traffic: requests read from a JSON-lines file, a CSV file or an OpenAI request log.

``load_dataset`` reads the file line by line and keeps requests in file order (a trace's
order: it is never shuffled).  Bad input is refused with one line that names the file,
the line and the field; nothing bad is dropped silently.  What is skipped or changed
(blank lines, prompts built from a token count, counts that disagree with the tokenizer)
is counted and said in ``Workload.notes``.

``describe_workload`` summarises any ``Workload`` (lengths, conversations, shared
prefixes, arrivals) for a description command.  See docs/workload.md.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any, Literal, TypedDict

import numpy as np

from autotune.workload.shared_blocks import BLOCK, MAX_HASHES, SharedBlocks, prefix_of
from autotune.workload.sources import Request, Workload, exact_prompts
from autotune.workload.tokenizer import Tokenizer, WorkloadError

__all__ = [
    "FIELDS",
    "FORMATS",
    "ArrivalSummary",
    "ConversationSummary",
    "DatasetFormat",
    "LengthSummary",
    "WorkloadSummary",
    "describe_workload",
    "load_dataset",
]

DatasetFormat = Literal["jsonl", "csv"]
FORMATS: tuple[str, ...] = ("jsonl", "csv")
# File name endings -> format; ``.gz`` after any of them is read through gzip.
_SUFFIXES: dict[str, DatasetFormat] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}

# Field names and their aliases, the docs' name first (errors quote a key as the file
# writes it).  Keys are matched case-insensitively with spaces and hyphens as
# underscores, so the columns of the public traces read as they are: Azure's
# (TIMESTAMP, ContextTokens, GeneratedTokens), BurstGPT's (Timestamp, Request tokens,
# Response tokens).
PROMPT_TEXT = ("prompt", "text", "input")
PROMPT_COUNT = (
    "prompt_tokens", "input_tokens", "input_len", "input_length", "prompt_len",
    "prompt_tokens_count", "context_tokens", "contexttokens", "request_tokens",
)
OUTPUT_COUNT = (
    "output_tokens", "output_len", "output_length", "output_tokens_count",
    "generated_tokens", "generatedtokens", "response_tokens",
)
# A request's cap, not what was generated: used only when no count is given and no
# usage was logged.  max_completion_tokens first: OpenAI's replacement for max_tokens.
OUTPUT_CAP = ("max_completion_tokens", "max_tokens")
TIMESTAMP = ("timestamp", "arrival_time")
# When the request was created, as an API response or a log says it: an arrival time
# only where no timestamp is given (a log may hold both, a little apart).
CREATED = ("created",)
CONVERSATION = ("conversation_id", "session_id")
FIELDS: dict[str, tuple[str, ...]] = {
    "prompt": PROMPT_TEXT,
    "prompt_tokens": PROMPT_COUNT,
    "output_tokens": OUTPUT_COUNT + OUTPUT_CAP,
    "timestamp": TIMESTAMP + CREATED,
    "conversation_id": CONVERSATION,
}

# Rows tokenized and built at a time: counts go to the tokenizer in batches (a server's
# /tokenize in parallel) while memory stays bounded by the requests kept.
_BATCH = 1024
# A given prompt count that differs from the tokenizer's by more than this (relative and
# absolute) is worth a note: the file was probably counted with another tokenizer.
_DIFF_REL = 0.10
_DIFF_ABS = 8
# The csv module refuses fields over 128 Ki characters by default, shorter than a long
# prompt; 16 Mi (~4M tokens) still stops an unclosed quote from swallowing the file.
_CSV_FIELD_LIMIT = 1 << 24
_ISO_FRACTION = re.compile(r"(\d\d:\d\d:\d\d)[.,](\d+)")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# ----------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class _At:
    """Where a value came from, for the one-line error that names it."""

    file: str
    line: int

    def error(self, what: str) -> WorkloadError:
        # Keys come from the file: a quoted CSV header can hold a newline.
        text = f"{self.file} line {self.line}: {what}".replace("\r", "\\r").replace("\n", "\\n")
        return WorkloadError(text)


def _show(value: Any) -> str:
    """A value as an error quotes it: short, on one line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _norm(key: Any) -> str:
    return str(key).strip().lower().replace(" ", "_").replace("-", "_")


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


# ----------------------------------------------------------------------------- values


def _whole(value: Any, name: str, at: _At) -> int:
    """A token count: a whole number >= 1 (JSON 128, 128.0 or "128"; CSV "128")."""
    fix = "give a whole number >= 1"
    number: float | int
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise at.error(f"{name}: {_show(value)} is not a whole number; {fix}")
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise at.error(f"{name}: {_show(value)} is not a whole number; {fix}") from None
    else:
        number = value
    if isinstance(number, float):
        if not (math.isfinite(number) and number.is_integer()):
            raise at.error(f"{name}: {_show(value)} is not a whole number; {fix}")
        number = int(number)
    if number < 0:
        raise at.error(f"{name}: {_show(value)} is negative; {fix}")
    if number == 0:
        raise at.error(f"{name}: 0 tokens; {fix} (a request has at least one)")
    return number


def _iso_micros(text: str) -> int | None:
    """Microseconds since the epoch of an ISO-8601 time (a time without a zone is UTC):
    whole numbers, so gaps between times are exact."""
    s = text.strip()
    if s[-1:] in ("Z", "z"):
        s = s[:-1] + "+00:00"
    # Python 3.10 reads only 3 or 6 fraction digits; logs write 1 to 9 (Azure: 7).
    s = _ISO_FRACTION.sub(lambda m: f"{m[1]}.{(m[2] + '000000')[:6]}", s, count=1)
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return (dt - _EPOCH) // timedelta(microseconds=1)


def _timestamp(value: Any, name: str, at: _At) -> tuple[float, bool]:
    """(time, is ISO): a number of seconds, or an ISO-8601 time in microseconds."""
    fix = "give seconds (1714567890.25) or an ISO-8601 time (2024-05-01T12:00:00.25Z)"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise at.error(f"{name}: {_show(value)} is not a time; {fix}")
    if isinstance(value, str):
        try:
            seconds = float(value.strip())
        except ValueError:
            micros = _iso_micros(value)
            if micros is None:
                raise at.error(f"{name}: {_show(value)} is not a time; {fix}") from None
            return float(micros), True  # exact: under 2**53
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise at.error(f"{name}: {_show(value)} is not a time; {fix}")
    return seconds, False


# ---------------------------------------------------------------------------- records


class _Record:
    """One line's fields, found by any alias whatever the key's case or spacing.

    ``levels`` are searched in order: a logged request's own fields, then the object
    around it (where a log keeps the timestamp or the session id).
    """

    def __init__(self, levels: Sequence[Mapping[Any, Any]], at: _At, *, log: bool = False,
                 response: Mapping[str, Any] | None = None,
                 usage: tuple[str, Mapping[str, Any]] | None = None) -> None:
        self.at = at
        self.log = log  # a logged API request (wrapped, or with messages/usage)
        self.response = response
        self.usage = usage  # (where, the usage object)
        self._levels = [{_norm(k): (str(k), v) for k, v in lv.items()} for lv in levels]

    def get(self, aliases: Sequence[str]) -> tuple[str, Any] | None:
        """(key as written, value) of the first alias present and not blank.  Two
        aliases with different values contradict each other: an error."""
        hits = [
            hit
            for level in self._levels
            for alias in aliases
            if (hit := level.get(alias)) is not None and not _blank(hit[1])
        ]
        if not hits:
            return None
        first = hits[0]
        for other in hits[1:]:
            if other[1] != first[1]:
                raise self.at.error(
                    f"{first[0]}: both {first[0]} ({_show(first[1])}) and {other[0]} "
                    f"({_show(other[1])}) are given; keep one"
                )
        return first


def _dict(value: Any) -> Mapping[str, Any] | None:
    return value if isinstance(value, dict) else None


def _json_record(obj: dict[str, Any], at: _At) -> _Record:
    """A JSON line as a record: a plain one, or a logged request (its body under
    ``request`` or ``body``, or at the top with ``messages``) with its ``response``."""
    inner = _dict(obj.get("request")) or _dict(obj.get("body"))
    response = _dict(obj.get("response"))
    # The usage as OpenAI's API, its Batch output (response.body) or a proxy logs it.
    response_body = _dict(response.get("body")) if response is not None else None
    usage: tuple[str, Mapping[str, Any]] | None = None
    for where, holder in (("response", response), ("response.body", response_body),
                          ("", obj)):
        found = _dict(holder.get("usage")) if holder is not None else None
        if found is not None:
            usage = (f"{where}.usage" if where else "usage", found)
            break
    if response is not None and response_body is not None and "created" not in response:
        response = response_body  # where the Batch output keeps ``created``
    levels = [inner, obj] if inner is not None else [obj]
    log = inner is not None or response is not None or "messages" in obj
    return _Record(levels, at, log=log, response=response, usage=usage)


class _Lines:
    """The file's lines, decoded one at a time so that a bad byte names its line."""

    def __init__(self, f: Iterable[bytes], file: str) -> None:
        self._f = f
        self._file = file
        self.read = 0  # lines read so far
        self.blank = 0  # of those, blank ones (or blank CSV rows)

    def __iter__(self) -> Iterator[tuple[int, str]]:
        for raw in self._f:
            self.read += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _At(self._file, self.read).error(
                    f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of "
                    "the line); save the file as UTF-8"
                ) from None
            if self.read == 1 and text.startswith("\ufeff"):  # a BOM, as Excel writes
                text = text[1:]
            yield self.read, text


def _jsonl_records(lines: _Lines, file: str) -> Iterator[_Record]:
    for no, text in lines:
        if not text.strip():
            lines.blank += 1
            continue
        at = _At(file, no)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise at.error(
                f"not valid JSON ({exc.msg} at column {exc.colno}); each line must hold one "
                "JSON object"
            ) from None
        if not isinstance(obj, dict):
            raise at.error(f"{_show(obj)} is not a JSON object; each line must hold one")
        yield _json_record(obj, at)


def _csv_records(lines: _Lines, file: str) -> Iterator[_Record]:
    texts = (text for _, text in lines)
    reader = csv.reader(texts, strict=True)  # a stray quote is an error, not a guess
    header: list[str] | None = None
    while True:
        start = lines.read + 1  # a quoted field may span lines: name the row's first
        try:
            row = next(reader, None)
        except csv.Error as exc:
            msg = str(exc)
            if "field limit" in msg:
                msg = f"a field runs past {_CSV_FIELD_LIMIT:,} characters (an unclosed quote?)"
            elif "end of data" in msg:
                msg = f"{msg} (a quote opened here is never closed)"
            raise _At(file, start).error(f"not valid CSV: {msg}") from None
        if row is None:
            break
        if not any(cell.strip() for cell in row):
            lines.blank += 1
            continue
        at = _At(file, start)
        if header is None:
            header = row
            _check_header(header, at)
            continue
        if len(row) != len(header):
            raise at.error(
                f"{len(row)} fields but the header names {len(header)} columns; quote "
                'fields that hold commas ("a, b")'
            )
        yield _Record([dict(zip(header, row, strict=True))], at)
    if header is None:
        raise _At(file, max(lines.read, 1)).error(
            "no header row; the first row must name the columns (prompt or prompt_tokens, "
            "output_tokens)"
        )


def _check_header(header: list[str], at: _At) -> None:
    """The columns must name a prompt and an output length, each once."""
    seen: dict[str, str] = {}
    for name in header:
        key = _norm(name)
        if key and key in seen:
            raise at.error(f"{name}: the header names column {seen[key]!r} twice")
        seen[key] = name
    cols = ", ".join(_show(h) for h in header)
    if not any(a in seen for a in PROMPT_TEXT + PROMPT_COUNT):
        raise at.error(
            f"prompt: no prompt column (the header has {cols}); name one prompt (text) or "
            "prompt_tokens (a count)"
        )
    if not any(a in seen for a in OUTPUT_COUNT + OUTPUT_CAP):
        raise at.error(
            f"output_tokens: no output column (the header has {cols}); name one output_tokens"
        )


# ------------------------------------------------------------------------ chat prompts


def _chat_text(messages: Any, name: str, at: _At) -> tuple[str, bool]:
    """(prompt, had non-text parts): each message as ``role: text``, blank-line separated.

    That is what the load generator sends as one user message; a model's chat template
    adds its own few tokens per message, which no count here includes.  An assistant's
    tool calls count as their function name and arguments; images and audio are dropped.
    """
    if not isinstance(messages, list) or not messages:
        raise at.error(f"{name}: {_show(messages)} is not a list of messages; give a non-empty "
                       "list of {\"role\": ..., \"content\": ...}")
    parts: list[str] = []
    dropped = False
    for i, msg in enumerate(messages, 1):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise at.error(f"{where}: {_show(msg)} is not a message with a role; give "
                           "{\"role\": ..., \"content\": ...}")
        content = msg.get("content")
        texts: list[str] = []
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif isinstance(part, str):
                    texts.append(part)
                else:
                    dropped = True
        elif content is not None:
            raise at.error(f"{where}.content: {_show(content)} is not text or a list of parts")
        for call in msg.get("tool_calls") or ():
            fn = _dict(call.get("function")) if isinstance(call, dict) else None
            if fn is not None:
                texts.append(f"{fn.get('name', '')} {fn.get('arguments', '')}".strip())
        parts.append(f"{msg['role']}: {' '.join(t for t in texts if t)}")
    return "\n\n".join(parts), dropped


# ----------------------------------------------------------------------------- reading


@dataclass
class _Row:
    """One request as read, before its prompt is counted or built."""

    line: int
    text: str | None  # the prompt; None: build one of ``given`` tokens
    text_field: str
    given: int | None  # the prompt's token count as the file gives it
    given_field: str
    output: int
    output_field: str
    arrival: float | None
    conversation: str | None
    turn: int


class _Reader:
    """Turns records into requests, in file order, keeping what the notes report."""

    def __init__(self, file: str, *, tokenizer: Tokenizer, max_model_len: int, seed: int) -> None:
        self.file = file
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.rng = np.random.default_rng(seed)
        self.requests: list[Request] = []
        self._pending: list[_Row] = []
        self.rows = 0  # requests read (kept + pending)
        self.chat = 0
        self.non_text = 0
        self.capped = 0  # logged requests whose output length is their max_tokens cap
        self.built = 0  # prompts built from a count
        self.built_off: list[int] = []  # |count - target| of those not built exactly
        self.disagree = 0
        self.worst: tuple[float, int, int, int] | None = None  # (rel, line, given, counted)
        # Timestamps: all lines or none, one kind, in file order.
        self._first_ts: tuple[float, bool, int] | None = None  # (time, iso, line)
        self._prev_ts: tuple[float, int] | None = None
        self._no_ts_line: int | None = None
        self.turns: dict[str, int] = {}
        self.shared = SharedBlocks()  # the blocks the prompts' texts share

    # -- one record -------------------------------------------------------------------

    def add(self, rec: _Record) -> None:
        at = rec.at
        text, text_field, given, given_field = self._prompt(rec)
        output, output_field = self._output(rec)
        if text is None:
            assert given is not None
            self._check_fits(given, given_field, output, output_field, at)
        arrival = self._arrival(rec)
        conversation, turn = self._conversation(rec)
        self._pending.append(_Row(at.line, text, text_field, given, given_field, output,
                                  output_field, arrival, conversation, turn))
        self.rows += 1
        if len(self._pending) >= _BATCH:
            self.flush()

    def _prompt(self, rec: _Record) -> tuple[str | None, str, int | None, str]:
        at = rec.at
        text: str | None = None
        text_field = "prompt"
        messages = rec.get(("messages",))
        if messages is not None:  # a chat request: its messages are the prompt
            text, dropped = _chat_text(messages[1], messages[0], at)
            text_field = messages[0]
            self.chat += 1
            self.non_text += dropped
            rec.log = True
        else:
            hit = rec.get(PROMPT_TEXT)
            if hit is not None:
                text_field, value = hit
                if not isinstance(value, str):
                    raise at.error(f"{text_field}: {_show(value)} is not text; give the prompt "
                                   "as a string, or its length as prompt_tokens")
                text = value
        given: int | None = None
        given_field = "prompt_tokens"
        hit = rec.get(PROMPT_COUNT)
        if hit is not None:
            given_field, value = hit
            given = _whole(value, given_field, at)
        elif rec.usage is not None and not _blank(rec.usage[1].get("prompt_tokens")):
            given_field = f"{rec.usage[0]}.prompt_tokens"
            given = _whole(rec.usage[1]["prompt_tokens"], given_field, at)
        if text is None and given is None:
            raise at.error(
                "prompt: missing; give the prompt text (prompt, text or input), its length "
                "(prompt_tokens, input_tokens or input_len) or chat messages"
            )
        return text, text_field, given, given_field

    def _output(self, rec: _Record) -> tuple[int, str]:
        at = rec.at
        hit = rec.get(OUTPUT_COUNT)
        if hit is not None:
            return _whole(hit[1], hit[0], at), hit[0]
        # What a logged request generated beats its cap: replaying a cap of 4096 for a
        # 200-token reply would offer many times the real decode load.
        if rec.usage is not None and not _blank(rec.usage[1].get("completion_tokens")):
            name = f"{rec.usage[0]}.completion_tokens"
            return _whole(rec.usage[1]["completion_tokens"], name, at), name
        for alias in OUTPUT_CAP:  # in order, not both: clients often send both, equal
            hit = rec.get((alias,))
            if hit is not None:
                self.capped += rec.log
                return _whole(hit[1], hit[0], at), hit[0]
        raise at.error(
            "output_tokens: missing; give output_tokens (or output_len, max_tokens)"
            + (", or log the response's usage.completion_tokens" if rec.log else "")
        )

    def _check_fits(self, prompt: int, prompt_field: str, output: int, output_field: str,
                    at: _At) -> None:
        if prompt + output > self.max_model_len:
            raise at.error(
                f"{prompt_field}: {prompt:,} prompt tokens + {output_field} {output:,} = "
                f"{prompt + output:,}, over max_model_len {self.max_model_len:,}; shorten "
                "the request or raise --max-model-len"
            )

    def _arrival(self, rec: _Record) -> float | None:
        at = rec.at
        hit = rec.get(TIMESTAMP) or rec.get(CREATED)
        if hit is None and rec.response is not None and not _blank(rec.response.get("created")):
            hit = ("response.created", rec.response["created"])
        if hit is None:
            if self._first_ts is not None:
                raise at.error(
                    f"timestamp: missing, but line {self._first_ts[2]} has one; give every "
                    "line a timestamp or none"
                )
            self._no_ts_line = self._no_ts_line or at.line
            return None
        name, value = hit
        stamp, iso = _timestamp(value, name, at)
        unit = 1e6 if iso else 1.0  # ISO times are in microseconds
        if self._no_ts_line is not None:
            raise at.error(
                f"{name}: line {self._no_ts_line} has no timestamp but this line has one; "
                "give every line a timestamp or none"
            )
        if self._first_ts is None:
            self._first_ts = (stamp, iso, at.line)
        elif self._first_ts[1] != iso:
            kinds = ("a number of seconds", "an ISO-8601 time")
            raise at.error(
                f"{name}: {_show(value)} is {kinds[iso]} but line {self._first_ts[2]}'s is "
                f"{kinds[not iso]}; write every timestamp the same way"
            )
        # In file order, not per conversation: a replay sends requests in file order, so
        # a file out of order (often logs of several servers concatenated) is refused.
        if self._prev_ts is not None and stamp < self._prev_ts[0]:
            raise at.error(
                f"{name}: {_show(value)} is {(self._prev_ts[0] - stamp) / unit:.6g} s before line "
                f"{self._prev_ts[1]}'s; a trace must be in arrival order: sort it by time"
            )
        self._prev_ts = (stamp, at.line)
        return (stamp - self._first_ts[0]) / unit

    def _conversation(self, rec: _Record) -> tuple[str | None, int]:
        hit = rec.get(CONVERSATION)
        if hit is None:
            return None, 0
        name, value = hit
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise rec.at.error(f"{name}: {_show(value)} is not an id; give a string or a "
                               "whole number")
        key = str(value).strip()
        turn = self.turns.get(key, 0)
        self.turns[key] = turn + 1
        return key, turn

    # -- a batch ----------------------------------------------------------------------

    def flush(self) -> None:
        """Count or build the pending prompts and keep their requests, in file order."""
        rows, self._pending = self._pending, []  # a second flush after an error: no-op
        if not rows:
            return
        texts = [r for r in rows if r.text is not None]
        ids = self.tok.encode_many([r.text for r in texts if r.text is not None])
        ids_of = {id(r): i for r, i in zip(texts, ids, strict=True)}
        to_build = [r for r in rows if r.text is None]
        built_of: dict[int, tuple[str, int]] = {}
        if to_build:
            targets = [r.given or 1 for r in to_build]
            made, got = exact_prompts(self.tok, targets, self.rng)
            self.built += len(to_build)
            for r, t, prompt, n in zip(to_build, targets, made, got, strict=True):
                built_of[id(r)] = (prompt, n)
                if n != t:
                    self.built_off.append(abs(n - t))
        for r in rows:
            at = _At(self.file, r.line)
            if r.text is not None:
                prompt, n = r.text, len(ids_of[id(r)])
                self._check_fits(n, r.text_field, r.output, r.output_field, at)
                if r.given is not None:
                    self._compare(r.given, n, r.line)
            else:
                prompt, n = built_of[id(r)]
            self.requests.append(Request(
                prompt=prompt, prompt_tokens=n, output_tokens=r.output,
                conversation=r.conversation, turn=r.turn, arrival_s=r.arrival,
            ))
            self.shared.add(ids_of.get(id(r)))

    def _compare(self, given: int, counted: int, line: int) -> None:
        diff = abs(given - counted)
        if diff > _DIFF_ABS and diff > _DIFF_REL * max(given, counted):
            self.disagree += 1
            rel = diff / max(given, counted)
            if self.worst is None or rel > self.worst[0]:
                self.worst = (rel, line, given, counted)


def _open_binary(path: Path) -> gzip.GzipFile | IO[bytes]:
    """The file's bytes, through gzip for ``.gz``."""
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rb")
    return path.open("rb")


def _format_of(path: Path, file_format: str | None, file: str) -> DatasetFormat:
    if file_format is not None:
        if file_format not in FORMATS:
            raise WorkloadError(
                f"unknown dataset format {file_format!r}; use one of {', '.join(FORMATS)}"
            )
        return "csv" if file_format == "csv" else "jsonl"
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes[-1:] == [".gz"]:
        suffixes = suffixes[:-1]
    ending = suffixes[-1] if suffixes else ""
    fmt = _SUFFIXES.get(ending)
    if fmt is not None:
        return fmt
    hint = (
        " (a ShareGPT .json file is read by --dataset sharegpt; rename JSON lines to .jsonl)"
        if ending == ".json"
        else ""
    )
    shown = repr(ending) if ending else "none"
    raise WorkloadError(
        f"{file}: unknown dataset file ending {shown}; give a .jsonl, .ndjson or .csv file, "
        f"optionally .gz{hint}"
    )


def load_dataset(
    path: str | Path,
    *,
    tokenizer: Tokenizer,
    max_model_len: int,
    num_prompts: int | None = None,
    seed: int = 0,
    file_format: DatasetFormat | None = None,
) -> Workload:
    """The requests of a user's file, in file order: JSON lines (plain records or an
    OpenAI chat request log) or CSV with a header row; the format is the file's ending
    (``.jsonl``/``.ndjson``/``.csv``, optionally ``.gz``) unless ``file_format`` says.

    Reads line by line and stops after ``num_prompts`` requests (None: the whole file).
    A prompt given only as a token count is built of random words with exactly that
    many tokens (``seed`` picks them); a prompt given as text is counted with
    ``tokenizer``, and that count is kept.  Any bad line is a ``WorkloadError`` naming
    the file, the line and the field; so is a request over ``max_model_len``.
    """
    file = str(path)
    p = Path(path).expanduser()
    fmt = _format_of(p, file_format, file)
    if num_prompts is not None and num_prompts < 1:
        raise WorkloadError(f"number of prompts must be >= 1, got {num_prompts}")
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len must be >= 2, got {max_model_len}")
    if not p.exists():
        raise WorkloadError(f"dataset file not found: {file}")
    if p.is_dir():
        raise WorkloadError(f"dataset path {file} is a directory: give the file itself")
    reader = _Reader(file, tokenizer=tokenizer, max_model_len=max_model_len, seed=seed)
    old_limit = csv.field_size_limit()
    stopped = False
    lines: _Lines | None = None
    try:
        csv.field_size_limit(max(old_limit, _CSV_FIELD_LIMIT))
        with _open_binary(p) as f:
            lines = _Lines(f, file)
            records = _jsonl_records(lines, file) if fmt == "jsonl" else _csv_records(lines, file)
            try:
                for rec in records:
                    reader.add(rec)
                    if num_prompts is not None and reader.rows >= num_prompts:
                        stopped = True  # before the loop pulls (reads) one more line
                        break
            except WorkloadError as late:
                # Pending rows come before this line: an error among them is the first.
                try:
                    reader.flush()
                except WorkloadError as early:
                    raise early from None
                raise late from None
            reader.flush()
    except OSError as exc:
        raise WorkloadError(
            f"cannot read dataset file {file}: {exc.strerror or exc}"
        ) from None
    except (EOFError, zlib.error) as exc:  # a .gz file cut short or corrupt
        line = lines.read + 1 if lines is not None else 1
        raise WorkloadError(f"{file} line {line}: the gzip data is broken ({exc})") from None
    finally:
        csv.field_size_limit(old_limit)
    assert lines is not None
    n = len(reader.requests)
    if n == 0:
        what = "a header row but no request" if fmt == "csv" else "no request"
        raise WorkloadError(f"{file}: {what} (the file is empty or its lines are blank)")
    label: str = fmt
    if reader.chat:
        label = ("openai chat log" if reader.chat == n
                 else f"jsonl with {reader.chat:,} openai chat request(s)")
    requests = _declare_shared(reader.requests, reader.shared, tokenizer)
    notes = _notes(reader, file, lines, stopped, num_prompts, seed)
    first = "the first " if stopped else ""
    return Workload(
        requests=requests,
        source=f"dataset {file} ({label}, {n:,} requests of {first}{lines.read:,} lines)",
        tokenizer=tokenizer.name,
        notes=notes,
    )


def _declare_shared(requests: list[Request], shared: SharedBlocks, tok: Tokenizer
                    ) -> list[Request]:
    """``requests`` with the prefixes their texts share declared (``Request.prefix``),
    for the simulator's prefix cache; the shared ones are tokenised again, which costs
    less than keeping every prompt's block hashes while the file is read."""
    at = [i for i, d in enumerate(shared.depth) if d]
    if not at:
        return requests
    out = list(requests)
    for i, ids in zip(at, tok.encode_many([requests[i].prompt for i in at]), strict=True):
        out[i] = replace(requests[i], prefix=prefix_of(ids, shared.depth[i]))
    return out


def _notes(reader: _Reader, file: str, lines: _Lines, stopped: bool, num_prompts: int | None,
           seed: int) -> list[str]:
    n = len(reader.requests)
    notes = [f"read {n:,} requests in file order from {file}, lines 1 to {lines.read:,}"]
    if stopped:
        notes.append(f"stopped after --num-prompts {num_prompts:,} requests; the rest of "
                     f"{file} was not read")
    if lines.blank:
        notes.append(f"skipped {lines.blank:,} blank line(s)")
    if reader.built:
        notes.append(
            f"{reader.built:,} prompt(s) given only as a token count: built of random words "
            f"with that many tokens (seed {seed})"
        )
    if reader.built_off:
        notes.append(
            f"{len(reader.built_off):,} built prompt(s) could not hit their count exactly; "
            f"they differ by up to {max(reader.built_off)} token(s) and carry their real count"
        )
    if reader.worst is not None:
        _, line, given, counted = reader.worst
        notes.append(
            f"{reader.disagree:,} prompt(s) have a token count in the file that differs from "
            f"the tokenizer's by over {_DIFF_REL:.0%} (most at line {line}: {given:,} given, "
            f"{counted:,} counted); the tokenizer's count is kept, as it counts the text "
            "sent: give the model's tokenizer if these differ a lot (chat templates add a "
            "few tokens per message)"
        )
    if reader.capped:
        notes.append(
            f"{reader.capped:,} logged request(s) have no usage.completion_tokens: their "
            "output length is their max_tokens cap, more than they likely generated"
        )
    if reader.non_text:
        notes.append(f"{reader.non_text:,} chat request(s) had images or audio; only their "
                     "text is sent")
    if reader.turns:
        longest = max(reader.turns.values())
        notes.append(f"{len(reader.turns):,} conversation(s), turns in file order "
                     f"(up to {longest:,} turns)")
    if reader.shared.shared:
        notes.append(f"{reader.shared.shared:,} prompt(s) share their first tokens with "
                     f"another (found by hashing {BLOCK}-token blocks, as vLLM's prefix "
                     "cache does): declared shared, for the simulator's prefix cache")
    if reader.shared.full:
        notes.append(f"over {MAX_HASHES:,} distinct token blocks: the later prompts' "
                     "sharing was looked for among those only")
    arrivals = [r.arrival_s for r in reader.requests if r.arrival_s is not None]
    if arrivals:
        span = arrivals[-1]
        rate = f", {(len(arrivals) - 1) / span:.3g} req/s" if span > 0 else ""
        notes.append(f"arrival times from the file's timestamps: {span:.6g} s from the first "
                     f"to the last request{rate}")
    return notes


# ---------------------------------------------------------------------------- describe


class LengthSummary(TypedDict):
    """Token lengths: numpy's linear percentiles, as the load test's metrics."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: int


class ConversationSummary(TypedDict):
    conversations: int  # distinct conversation ids
    turns_mean: float | None  # requests per conversation; None without conversations
    turns_max: int | None
    single_requests: int  # requests outside any conversation


class ArrivalSummary(TypedDict):
    requests: int  # requests with an arrival time
    span_s: float  # first to last arrival
    rate_per_s: float | None  # (requests - 1) / span; None when the span is 0
    # Coefficient of variation of the gaps between arrivals (sample std / mean): 1 for a
    # Poisson process, 0 for evenly spaced, above 1 bursty.  None under 2 gaps.
    gap_cv: float | None


class WorkloadSummary(TypedDict):
    source: str
    tokenizer: str
    requests: int
    prompt_tokens: LengthSummary
    output_tokens: LengthSummary
    conversations: ConversationSummary
    # Prompt tokens in declared shared prefixes (each prompt's longest ``prefix``
    # segment) over all prompt tokens: a token-weighted mean, 0..1.
    shared_prefix_share: float
    arrivals: ArrivalSummary | None  # None: no request has an arrival time


def _lengths(values: Sequence[int]) -> LengthSummary:
    x = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = (float(v) for v in np.percentile(x, [50, 90, 99]))
    return LengthSummary(mean=float(x.mean()), p50=p50, p90=p90, p99=p99, max=int(x.max()))


def describe_workload(workload: Workload) -> WorkloadSummary:
    """What a workload holds: lengths, conversations, shared prefixes and arrivals."""
    reqs = workload.requests
    if not reqs:
        raise WorkloadError(f"the workload {workload.source} has no requests to describe")
    turns: dict[str, int] = {}
    for r in reqs:
        if r.conversation is not None:
            turns[r.conversation] = turns.get(r.conversation, 0) + 1
    per_conv = list(turns.values())
    conversations = ConversationSummary(
        conversations=len(turns),
        turns_mean=sum(per_conv) / len(per_conv) if per_conv else None,
        turns_max=max(per_conv) if per_conv else None,
        single_requests=sum(1 for r in reqs if r.conversation is None),
    )
    total = sum(r.prompt_tokens for r in reqs)
    shared = sum(min(max((t for _, t in r.prefix), default=0), r.prompt_tokens) for r in reqs)
    times = sorted(r.arrival_s for r in reqs if r.arrival_s is not None)
    arrivals: ArrivalSummary | None = None
    if times:
        gaps = np.diff(np.asarray(times, dtype=np.float64))
        span = times[-1] - times[0]
        mean_gap = float(gaps.mean()) if gaps.size else 0.0
        cv = float(gaps.std(ddof=1)) / mean_gap if gaps.size >= 2 and mean_gap > 0 else None
        arrivals = ArrivalSummary(
            requests=len(times),
            span_s=span,
            rate_per_s=(len(times) - 1) / span if span > 0 else None,
            gap_cv=cv,
        )
    return WorkloadSummary(
        source=workload.source,
        tokenizer=workload.tokenizer,
        requests=len(reqs),
        prompt_tokens=_lengths([r.prompt_tokens for r in reqs]),
        output_tokens=_lengths([r.output_tokens for r in reqs]),
        conversations=conversations,
        shared_prefix_share=shared / total if total else 0.0,
        arrivals=arrivals,
    )
