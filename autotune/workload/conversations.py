"""Multi-turn chat traffic and shared system prompts, with their shared prefixes declared.

Real chat traffic resends the conversation so far with every new message, and most
requests of a deployment start with the same system prompt; a server with prefix caching
skips the prefill of what it has seen.  This module builds such requests and declares,
in ``Request.prefix``, exactly which token prefixes they share (see the comment there),
so that a simulated prefix cache can reuse what a real one would.

**Multi-turn** (``sample_conversations``, ``load_conversations``): turn ``k`` (0-based) of
a ShareGPT conversation sends, as plain text for the completions endpoint::

    User: {message 0}
    Assistant: {reply 0}
    ...
    User: {message k}
    Assistant:

i.e. ``"User: {m}\\nAssistant:"`` per message, each earlier one followed by
``" {reply}\\n"``, so turn ``k``'s text is turn ``k - 1``'s text with
``" {reply k-1}\\nUser: {message k}\\nAssistant:"`` appended.  Its output length is the
token count of the dataset's reply ``k``, counted as ``sample_sharegpt`` counts replies.
The replies resent are the dataset's, not the server's: the load generator does not keep
the text the server generated.  A real chat client resends the server's own reply, so in
real traffic the reply part of the history is the server's tokens (which the server
cached while generating them); the lengths and the shared structure are the same, only
the text differs.

**System prompt** (``add_system_prompt``, ``with_system_prompt``): one (or a few) system
prompts of ``S`` tokens of random words followed by ``"\\n"``, put before every prompt,
with ``S`` chosen so that it is ``share`` of all prompt tokens (vLLM ``auto_tune.sh``'s
MIN_CACHE_HIT_PCT, ``vllm bench serve``'s prefix-repetition dataset).

**Token-safe boundaries.**  A tokenizer may merge tokens across the place where one text
ends and the next begins, and then the shorter prompt is not a token prefix of the longer
one.  Nothing here is assumed: every declared segment is computed from the real
encodings (``Tokenizer.encode``) of both prompts, as the longest common token prefix.
With the template above the boundary falls after ``"Assistant:"`` followed by a space,
and after the system prompt's ``"\\n"``; on the tokenizers tried (tekken, byte-level BPE)
the previous prompt is an exact token prefix almost always, and the few that are not
(a prompt that begins with a newline, say) declare the shorter common part and are
counted in the notes.

Tokens are those of the text as sent to the completions endpoint (no special tokens).  On
the chat endpoint the server wraps the whole text in one user message of the model's chat
template: its opening tokens shift every prompt alike (the shared prefixes stay shared,
a few tokens later), and its closing tokens follow the text, so the last few tokens of a
turn's prompt are not part of the next turn's prompt on the server.

**Roles.**  ``Conversation`` holds the messages' texts only.  ShareGPT V3 records are
chunks of longer chats, and a chunk that does not open the chat usually starts with the
assistant's reply to a message in the previous chunk.  Roles alternate within a record,
and on the shipped file a record with an even number of messages starts with the user
(11,129 of 11,152) and one with an odd number starts with a reply or a system message
(6,376 of 6,393); so a record with an odd number of messages is read from its second
(``first_user_message``).  About 0.2 % of records are read with the roles swapped (and a
few records repeat a role inside, which the texts alone cannot show).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from autotune.workload.sources import (
    DEFAULT_MAX_MODEL_LEN,
    MIN_TOKENS,
    Conversation,
    Request,
    Workload,
    exact_prompts,
    read_sharegpt,
)
from autotune.workload.tokenizer import Tokenizer, WorkloadError

__all__ = [
    "BLOCK_SIZE",
    "ConversationStats",
    "SystemPromptStats",
    "add_system_prompt",
    "chat_prompt",
    "common_prefix_len",
    "first_user_message",
    "load_conversations",
    "message_pairs",
    "prefix_share",
    "sample_conversations",
    "with_system_prompt",
]

# vLLM's default KV block size: the prefix cache reuses whole blocks only.
BLOCK_SIZE = 16

_USER = "User: "
_ASSISTANT = "\nAssistant:"
SYSTEM_KEY = "system"  # system prompt j is the prefix key f"system/{j}"


# ------------------------------------------------------------------------ the template


def first_user_message(conv: Conversation) -> int:
    """Index of the conversation's first user message: 0 for an even number of messages,
    1 for an odd number (the record starts with a reply or a system message; see the
    module's notes on roles)."""
    return len(conv.turns) % 2


def message_pairs(conv: Conversation) -> list[tuple[str, str]]:
    """(user message, the dataset's reply) of every turn, in order."""
    t = conv.turns[first_user_message(conv) :]
    return [(t[i], t[i + 1]) for i in range(0, len(t) - 1, 2)]


def chat_prompt(pairs: Sequence[tuple[str, str]], k: int) -> str:
    """Turn ``k``'s prompt: messages and replies 0..k-1, then message ``k``, as
    ``"User: m\\nAssistant: r\\n"`` ... ``"User: m_k\\nAssistant:"``."""
    parts: list[str] = []
    for i in range(k + 1):
        if i:
            parts.append(f" {pairs[i - 1][1]}\n")
        parts.append(f"{_USER}{pairs[i][0]}{_ASSISTANT}")
    return "".join(parts)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


# ------------------------------------------------------------------------- multi-turn


@dataclass(frozen=True)
class ConversationStats:
    """How a multi-turn sample was drawn: what was examined and why turns were left out.

    A turn left out takes every later turn of its conversation with it (they resend it),
    and each of those is counted under the same reason.
    """

    available: int  # records with >= 2 messages (the pool sample_sharegpt shuffles too)
    examined: int  # records looked at, in shuffled order
    conversations: int  # kept: those with >= 1 usable turn
    turns: int  # requests made
    too_short: int  # turns from one whose reply (or, on turn 0, message) has < MIN_TOKENS
    too_long: int  # turns from one over max_prompt_len or with prompt + reply > max_model_len
    over_max_turns: int  # turns past max_turns
    cut_to_num_prompts: int  # turns of the last conversation left off to give num_prompts
    reply_first: int  # kept conversations read from their second message (odd count)
    not_token_prefix: int  # turns whose previous prompt is not an exact token prefix

    @property
    def mean_turns(self) -> float:
        return self.turns / self.conversations if self.conversations else 0.0


class _Keys:
    """Unique conversation names (ShareGPT repeats some ids for different chats)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def name(self, conv_id: str) -> str:
        base = conv_id or "conversation"
        name, n = base, 1
        while name in self.used:
            n += 1
            name = f"{base}#{n}"
        self.used.add(name)
        return name


def _conversation_turns(
    name: str,
    pairs: Sequence[tuple[str, str]],
    *,
    tokenizer: Tokenizer,
    max_model_len: int,
    max_prompt_len: int | None,
) -> tuple[list[Request], str | None, int]:
    """The usable turns of one conversation, why the rest were left out (None: none
    was), and how many turns' previous prompt was not an exact token prefix."""
    out: list[Request] = []
    prev_ids: list[int] = []
    prev_prefix: tuple[tuple[str, int], ...] = ()
    text = ""
    not_prefix = 0
    for k, (message, reply) in enumerate(pairs):
        output = tokenizer.count(reply)
        if output < MIN_TOKENS or (k == 0 and tokenizer.count(message) < MIN_TOKENS):
            return out, "too_short", not_prefix
        text += (f" {pairs[k - 1][1]}\n" if k else "") + f"{_USER}{message}{_ASSISTANT}"
        ids = tokenizer.encode(text)
        n = len(ids)
        if (max_prompt_len is not None and n > max_prompt_len) or n + output > max_model_len:
            return out, "too_long", not_prefix
        if k:
            common = common_prefix_len(prev_ids, ids)
            not_prefix += common < len(prev_ids)
            # The previous turn's segments, clipped to what is really common: every block
            # of the shared part is then named by the same key as in the previous turn.
            inherited = tuple((key, min(t, common)) for key, t in prev_prefix if min(t, common))
        else:
            inherited = ()
        prefix = (*inherited, (f"{name}/{k}", n))
        out.append(
            Request(
                prompt=text,
                prompt_tokens=n,
                output_tokens=output,
                prefix=prefix,
                conversation=name,
                turn=k,
            )
        )
        prev_ids, prev_prefix = ids, prefix
    return out, None, not_prefix


def sample_conversations(
    conversations: Sequence[Conversation],
    *,
    tokenizer: Tokenizer,
    num_conversations: int | None = None,
    num_prompts: int | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_prompt_len: int | None = None,
    max_turns: int | None = None,
    seed: int = 0,
) -> tuple[list[Request], ConversationStats]:
    """Multi-turn requests from ShareGPT conversations, every turn of a conversation in
    order, conversation after conversation.

    Shuffles the records with >= 2 messages with ``random.Random(seed)``, as
    ``sample_sharegpt`` does (the same order for the same seed), and takes conversations
    in that order until ``num_conversations`` have a usable turn, or until
    ``num_prompts`` requests are made (the last conversation is cut to give exactly
    that many).  Give exactly one of the two.  A conversation ends before its first turn
    that fails a filter: a reply of < MIN_TOKENS tokens (or a first message of fewer,
    vLLM's filter on the prompt; later prompts carry the history), a prompt over
    ``max_prompt_len`` (default none: histories grow) or a prompt plus reply over
    ``max_model_len``.  A conversation with one usable turn is a one-turn conversation.

    Each request is ``conversation`` = the record's id (``#2``, ``#3`` appended to ids
    the dataset repeats), ``turn`` = k, and ``prefix`` = the previous turn's segments,
    cut to the longest common token prefix of the two prompts' encodings, then
    ``(f"{conversation}/{k}", prompt_tokens)``: its own whole prompt, which the next
    turn names.
    """
    _check_counts(num_conversations, num_prompts, max_turns)
    pool = [c for c in conversations if len(c.turns) >= 2]
    random.Random(seed).shuffle(pool)
    keys = _Keys()
    out: list[Request] = []
    dropped = {"too_short": 0, "too_long": 0}
    examined = kept = over_max_turns = cut = reply_first = not_prefix = 0
    for conv in pool:
        if num_conversations is not None and kept >= num_conversations:
            break
        if num_prompts is not None and len(out) >= num_prompts:
            break
        examined += 1
        pairs = message_pairs(conv)
        if max_turns is not None and len(pairs) > max_turns:
            over_max_turns += len(pairs) - max_turns
            pairs = pairs[:max_turns]
        if num_prompts is not None and len(pairs) > num_prompts - len(out):
            cut += len(pairs) - (num_prompts - len(out))
            pairs = pairs[: num_prompts - len(out)]
        turns, why, bad = _conversation_turns(keys.name(conv.id), pairs, tokenizer=tokenizer,
                                              max_model_len=max_model_len,
                                              max_prompt_len=max_prompt_len)
        if why is not None:
            dropped[why] += len(pairs) - len(turns)
        not_prefix += bad
        if turns:
            kept += 1
            reply_first += first_user_message(conv)
            out.extend(turns)
    stats = ConversationStats(
        available=len(pool), examined=examined, conversations=kept, turns=len(out),
        too_short=dropped["too_short"], too_long=dropped["too_long"],
        over_max_turns=over_max_turns, cut_to_num_prompts=cut, reply_first=reply_first,
        not_token_prefix=not_prefix)
    return out, stats


def _check_counts(num_conversations: int | None, num_prompts: int | None,
                  max_turns: int | None) -> None:
    if (num_conversations is None) == (num_prompts is None):
        raise WorkloadError("give either a number of conversations or a number of prompts")
    wanted = num_conversations if num_conversations is not None else num_prompts
    assert wanted is not None
    if wanted < 1:
        what = "conversations" if num_conversations is not None else "prompts"
        raise WorkloadError(f"number of {what} must be >= 1, got {wanted}")
    if max_turns is not None and max_turns < 1:
        raise WorkloadError(f"max turns must be >= 1, got {max_turns}")


def load_conversations(
    path: str | Path | None = None,
    *,
    tokenizer: Tokenizer,
    num_conversations: int | None = None,
    num_prompts: int | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_prompt_len: int | None = None,
    max_turns: int | None = None,
    seed: int = 0,
) -> Workload:
    """A multi-turn ShareGPT workload (``sample_conversations`` on ``read_sharegpt``).

    Fewer conversations or prompts than asked gives what there is, with a note; none is
    an error.
    """
    if max_model_len < 2 * MIN_TOKENS:
        raise WorkloadError(f"max_model_len must be >= {2 * MIN_TOKENS}, got {max_model_len}")
    conversations, read_stats = read_sharegpt(path)
    requests, st = sample_conversations(
        conversations,
        tokenizer=tokenizer,
        num_conversations=num_conversations,
        num_prompts=num_prompts,
        max_model_len=max_model_len,
        max_prompt_len=max_prompt_len,
        max_turns=max_turns,
        seed=seed,
    )
    limits = f"max_model_len={max_model_len}" + (
        f", max prompt {max_prompt_len}" if max_prompt_len is not None else ""
    )
    if not requests:
        raise WorkloadError(f"no usable conversation turns in {read_stats.path} with {limits}")
    notes = read_stats.notes()
    notes.append(
        f"sampled {st.conversations:,} conversations, {st.turns:,} turns (seed {seed}) from "
        f"{st.examined:,} of {st.available:,} records; turns left out, each with the later "
        f"turns of its conversation: {st.too_short:,} with < {MIN_TOKENS} tokens, "
        f"{st.too_long:,} over {limits}"
        + (f", {st.over_max_turns:,} past {max_turns} turns" if max_turns is not None else "")
        + (f", {st.cut_to_num_prompts:,} past {num_prompts:,} prompts" if st.cut_to_num_prompts
           else "")
    )
    notes.append(
        'turn k sends the conversation so far as plain text ("User: ...\\nAssistant: ...\\n" '
        'per earlier turn, then "User: ...\\nAssistant:"), output length = tokens of the '
        "dataset's reply k; the history resends the dataset's replies, not the server's "
        "(a real chat client resends the server's own, so real prefix hits on the reply "
        "part differ slightly)"
    )
    if st.reply_first:
        notes.append(
            f"{st.reply_first:,} conversation(s) start with the assistant's reply (an odd "
            "number of messages: a chunk of a longer chat); read from their second message"
        )
    if st.not_token_prefix:
        notes.append(
            f"{st.not_token_prefix:,} turn(s) do not start with the previous prompt's exact "
            "tokens (the tokenizer merged across the boundary); they declare the common part"
        )
    asked, what = (
        (num_conversations, "conversations")
        if num_conversations is not None
        else (num_prompts, "prompts")
    )
    got = st.conversations if num_conversations is not None else st.turns
    if asked is not None and got < asked:
        notes.append(
            f"asked for {asked:,} {what} but {read_stats.path} has only {got:,} usable "
            f"with {limits}; using {got:,}"
        )
    source = (
        f"sharegpt multi-turn ({st.conversations:,} conversations, {st.turns:,} turns, "
        f"mean turns {st.mean_turns:.1f})"
    )
    return Workload(
        requests=requests, source=source, tokenizer=tokenizer.name, notes=notes
    )


# ---------------------------------------------------------------------- system prompt


@dataclass(frozen=True)
class SystemPromptStats:
    """What ``add_system_prompt`` did."""

    asked_share: float
    tokens: int  # S: the system prompt's tokens (the target rounded to whole blocks)
    target_tokens: float  # share / (1 - share) * mean prompt tokens, before rounding
    texts: tuple[str, ...]  # system prompt j (prefix key f"system/{j}")
    counts: tuple[int, ...]  # their real token counts (S unless the tokenizer could not)
    share: float  # system prompt tokens / all prompt tokens of the kept requests
    kept: int
    too_long: int  # requests dropped: prompt + output over max_model_len (+ later turns)
    not_token_safe: int  # requests whose boundary merged tokens (see add_system_prompt)


def _check_share(share: float) -> None:
    try:
        ok = 0 <= float(share) < 1  # NaN is not
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise WorkloadError(
            f"system prompt share must be in [0, 1) (the part of all prompt tokens the "
            f"system prompt makes up), got {share!r}"
        )


def add_system_prompt(
    requests: Sequence[Request],
    *,
    share: float,
    tokenizer: Tokenizer,
    max_model_len: int | None,
    seed: int = 0,
    num_system_prompts: int = 1,
    block_size: int = BLOCK_SIZE,
) -> tuple[list[Request], SystemPromptStats]:
    """Put a shared system prompt before every request's prompt.

    ``S`` = ``share / (1 - share)`` times the mean prompt tokens of ``requests``, rounded
    to whole ``block_size`` blocks (at least one; a prefix cache reuses whole blocks
    only, so the shared part then ends on a block boundary), so that the system prompt
    is about ``share`` of all prompt tokens.  Each system prompt is random words with
    exactly ``S - 1`` tokens (``exact_prompts``, drawn from ``seed``) and a ``"\\n"``.
    With ``num_system_prompts`` > 1, each conversation (or each request without one)
    gets one of them at random (``seed``); every turn of a conversation gets the same.

    The new prefix is ``(f"system/{j}", S)`` followed by the request's segments, keys
    unchanged, ``S`` tokens further.  Both are checked on the real encodings: the new
    prompt must start with the system prompt's tokens and continue with the old
    prompt's; where the tokenizer merged across the boundary, the system segment is the
    common part and the old segments are cut to what still matches (or dropped if the
    system prompt itself is cut), counted in ``not_token_safe``.

    ``prompt_tokens`` becomes the new prompt's real count.  With ``max_model_len`` (None:
    no check), a request that no longer fits is dropped with its conversation's later
    turns, and counted; the kept requests' real share is in the stats.  ``share`` 0
    changes nothing; outside [0, 1) it is a ``WorkloadError``.
    """
    _check_share(share)
    if num_system_prompts < 1 or block_size < 1:
        raise WorkloadError(f"number of system prompts ({num_system_prompts}) and block size "
                            f"({block_size}) must be >= 1")
    if share == 0:
        return list(requests), SystemPromptStats(
            asked_share=0.0, tokens=0, target_tokens=0.0, texts=(), counts=(), share=0.0,
            kept=len(requests), too_long=0, not_token_safe=0)
    keys, s, target, texts = _system_texts(requests, share=share, tokenizer=tokenizer,
                                           seed=seed, n=num_system_prompts,
                                           block_size=block_size)
    sys_ids = [tokenizer.encode(t) for t in texts]
    pick = random.Random(seed)
    chosen: dict[str, int] = {}
    dropped_from: dict[str, int] = {}  # conversation -> first turn dropped
    out: list[Request] = []
    too_long = unsafe = shared = total = 0
    for r in requests:
        conv = r.conversation
        if conv is not None and conv in dropped_from and r.turn >= dropped_from[conv]:
            too_long += 1
            continue
        if conv is None:
            j = pick.randrange(num_system_prompts)
        elif conv in chosen:
            j = chosen[conv]
        else:
            j = chosen[conv] = pick.randrange(num_system_prompts)
        head = sys_ids[j]
        text = texts[j] + r.prompt
        ids = tokenizer.encode(text)
        if max_model_len is not None and len(ids) + r.output_tokens > max_model_len:
            too_long += 1
            if conv is not None:
                dropped_from[conv] = min(r.turn, dropped_from.get(conv, r.turn))
            continue
        n_sys = common_prefix_len(head, ids)
        prefix, merged = _shifted_prefix(r, keys[j], head, ids, tokenizer)
        unsafe += merged
        shared += n_sys
        total += len(ids)
        out.append(replace(r, prompt=text, prompt_tokens=len(ids), prefix=prefix))
    stats = SystemPromptStats(
        asked_share=float(share), tokens=s, target_tokens=target, texts=texts,
        counts=tuple(len(i) for i in sys_ids), share=shared / total if total else 0.0,
        kept=len(out), too_long=too_long, not_token_safe=unsafe)
    return out, stats


def _system_texts(requests: Sequence[Request], *, share: float, tokenizer: Tokenizer,
                  seed: int, n: int, block_size: int
                  ) -> tuple[list[str], int, float, tuple[str, ...]]:
    """The system prompts' keys, their length S (whole blocks), the length asked for,
    and their texts (``S - 1`` tokens of random words and a newline each)."""
    if not requests:
        raise WorkloadError("no requests to put a system prompt before")
    keys = [f"{SYSTEM_KEY}/{j}" for j in range(n)]
    taken = {key for r in requests for key, _ in r.prefix}
    if taken.intersection(keys):
        raise WorkloadError(
            f"prefix key {sorted(taken.intersection(keys))[0]!r} is already used by a request"
        )
    mean = sum(r.prompt_tokens for r in requests) / len(requests)
    target = share / (1 - share) * mean
    s = max(block_size, block_size * round(target / block_size))
    words, _ = exact_prompts(tokenizer, [s - 1] * n, np.random.default_rng(seed))
    return keys, s, target, tuple(w + "\n" for w in words)


def _shifted_prefix(r: Request, key: str, head: Sequence[int], ids: Sequence[int],
                    tokenizer: Tokenizer) -> tuple[tuple[tuple[str, int], ...], bool]:
    """The prefix of ``r`` behind a system prompt (``head``, its token ids) in the new
    prompt ``ids``: the system segment, then ``r``'s own segments shifted, each cut to
    what the encodings still share; and whether the tokenizer merged across a boundary."""
    n_sys = common_prefix_len(head, ids)
    if n_sys < len(head):
        return (((key, n_sys),) if n_sys else ()), True
    same = common_prefix_len(ids[n_sys:], tokenizer.encode(r.prompt)) if r.prefix else 0
    merged = bool(r.prefix) and same < max(t for _, t in r.prefix)
    return ((key, n_sys),) + tuple(
        (k, n_sys + min(t, same)) for k, t in r.prefix if min(t, same)), merged


def with_system_prompt(
    workload: Workload,
    *,
    share: float,
    tokenizer: Tokenizer,
    max_model_len: int | None,
    seed: int = 0,
    num_system_prompts: int = 1,
    block_size: int = BLOCK_SIZE,
) -> Workload:
    """``workload`` with a shared system prompt (``add_system_prompt``), its source and
    notes saying so.  ``tokenizer`` must be the one that counted the workload."""
    _check_share(share)
    if share == 0:
        return workload
    if tokenizer.name != workload.tokenizer:
        raise WorkloadError(
            f"the workload was counted with {workload.tokenizer}, not {tokenizer.name}: "
            "add the system prompt with the same tokenizer"
        )
    requests, st = add_system_prompt(
        workload.requests,
        share=share,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        seed=seed,
        num_system_prompts=num_system_prompts,
        block_size=block_size,
    )
    if not requests:
        raise WorkloadError(
            f"no request fits max_model_len={max_model_len} with a {st.tokens}-token "
            "system prompt"
        )
    many = f"{num_system_prompts} system prompts" if num_system_prompts > 1 else "system prompt"
    notes = list(workload.notes)
    notes.append(
        f"a shared {many} of {st.tokens:,} tokens (random words, seed {seed}) before every "
        f"prompt: asked for {share:.1%} of prompt tokens ({st.target_tokens:,.0f} tokens, "
        f"rounded to whole {block_size}-token blocks), got {st.share:.1%}"
    )
    if any(c != st.tokens for c in st.counts):
        notes.append(
            f"the tokenizer could not make every system prompt exactly {st.tokens} tokens: "
            f"{', '.join(str(c) for c in st.counts)}; the prefixes declare the real counts"
        )
    if st.too_long:
        notes.append(
            f"dropped {st.too_long:,} request(s) that no longer fit max_model_len="
            f"{max_model_len} (with the later turns of their conversations)"
        )
    if st.not_token_safe:
        notes.append(
            f"{st.not_token_safe:,} request(s) merge tokens across the system prompt's end; "
            "they declare only the prefix they really share"
        )
    return Workload(
        requests=requests,
        source=f"{workload.source} + {many} ({st.tokens:,} tokens, {share:.0%} of prompt "
        "tokens)",
        tokenizer=workload.tokenizer,
        notes=notes,
    )


# ----------------------------------------------------------------------- measurement


def prefix_share(requests: Sequence[Request], *, block_size: int = BLOCK_SIZE) -> float:
    """The share of all prompt tokens a perfect (unbounded) prefix cache would skip,
    sending ``requests`` in list order.

    Uses the block model of ``Request.prefix``: block i (tokens ``[b i, b i + b)``, only
    whole blocks) is named by the key of the request's first segment with at least
    ``b (i + 1)`` tokens, and is a hit when an earlier request named block i with the
    same key.  Each request skips its leading run of hits (up to its first miss).  The
    first request to name a prefix computes it, so a prefix that only one request names
    counts nothing.  ``block_size`` 1 counts tokens.
    """
    if block_size < 1:
        raise WorkloadError(f"block size must be >= 1 token, got {block_size}")
    seen: set[tuple[str, int]] = set()
    skipped = total = 0
    for r in requests:
        total += r.prompt_tokens
        blocks: list[tuple[str, int]] = []
        seg = 0
        for i in range(r.prompt_tokens // block_size):
            end = block_size * (i + 1)
            while seg < len(r.prefix) and r.prefix[seg][1] < end:
                seg += 1
            if seg == len(r.prefix):
                break
            blocks.append((r.prefix[seg][0], i))
        hits = 0
        while hits < len(blocks) and blocks[hits] in seen:
            hits += 1
        skipped += hits * block_size
        seen.update(blocks)
    return skipped / total if total else 0.0
