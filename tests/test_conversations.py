"""Multi-turn ShareGPT conversations and shared system prompts: the prompts really share
the token prefixes they declare, under real tokenizers (tekken, a byte-level BPE)."""

from __future__ import annotations

import math
import random
import re
from collections import defaultdict
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import autotune.workload.sources as wl
from autotune.workload.conversations import (
    BLOCK_SIZE,
    add_system_prompt,
    chat_prompt,
    first_user_message,
    load_conversations,
    message_pairs,
    prefix_share,
    sample_conversations,
    with_system_prompt,
)
from autotune.workload.sources import (
    Conversation,
    Request,
    Workload,
    WorkloadError,
    default_sharegpt_path,
    load_sharegpt,
    read_sharegpt,
)
from autotune.workload.tokenizer import Tokenizer, load_tokenizer

LINES = [
    "User: The quick brown fox jumps over the lazy dog.\nAssistant: It does, every day.",
    "A load test sends requests at a fixed rate and measures latency.",
    "The water in the city is good, and the people live near the school.",
    "She said that they will write a new word in the book each day.",
]


@pytest.fixture(scope="module")
def tekken() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A real byte-level BPE ``tokenizer.json``, small: trained on a few lines."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(LINES * 20, trainer=trainer)
    path = tmp_path_factory.mktemp("model") / "tokenizer.json"
    tok.save(str(path))
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def conversations() -> tuple[Conversation, ...]:
    return read_sharegpt()[0]


@pytest.fixture(scope="module")
def multi(tekken: Tokenizer, conversations) -> list[Request]:
    requests, _ = sample_conversations(
        conversations, tokenizer=tekken, num_conversations=150, seed=7
    )
    return requests


FIRST = 2_000_000  # above every code point + 1000


class MergingTokenizer(Tokenizer):
    """Characters, except that ": " and "\\n\\n" are one token each (it merges across the
    template's boundary after "Assistant:", and after a system prompt's "\\n"), and the
    text's first character is a token of its own kind (as SentencePiece's dummy prefix
    space makes a text's first word differ from the same word inside a text)."""

    name = "test: characters with ': ' and '\\n\\n' merged"
    _PAIRS = {": ": 1, "\n\n": 2}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            pair = self._PAIRS.get(text[i : i + 2])
            if pair is not None:
                ids.append(pair)
                i += 2
            else:
                ids.append((FIRST if i == 0 else 1000) + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        back = {v: k for k, v in self._PAIRS.items()}
        return "".join(back[i] if i in back else chr(i - (FIRST if i >= FIRST else 1000))
                       for i in ids)


def assert_prefixes_real(requests: Sequence[Request], tok: Tokenizer) -> None:
    """Every declared segment is a true common token prefix of every prompt naming its
    key, under ``tok``, and the segments are in order and within the prompt."""
    claims: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)
    for r in requests:
        ids = tok.encode(r.prompt)
        assert r.prompt_tokens == len(ids)
        ns = [n for _, n in r.prefix]
        assert ns == sorted(ns)
        assert all(0 < n <= r.prompt_tokens for n in ns)
        for key, n in r.prefix:
            claims[key].append((n, ids))
    for key, named in claims.items():
        longest, ref = max(named, key=lambda c: c[0])
        for n, ids in named:
            assert ids[:n] == ref[:n], f"{key}: {n} tokens are not those of the others"


def by_conversation(requests: Sequence[Request]) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = defaultdict(list)
    for r in requests:
        assert r.conversation is not None
        out[r.conversation].append(r)
    return out


def record_of(name: str, conversations: Sequence[Conversation]) -> list[Conversation]:
    base = re.sub(r"#\d+$", "", name)
    return [c for c in conversations if c.id == base]


# ------------------------------------------------------------------------ multi-turn


@pytest.mark.parametrize("which", ["tekken", "bpe"])
def test_each_turn_resends_the_previous_prompt_as_an_exact_token_prefix(
    which: str, request: pytest.FixtureRequest, conversations
) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    # The small BPE spends many tokens per word: a longer context keeps later turns.
    requests, st = sample_conversations(conversations, tokenizer=tok, num_conversations=100,
                                        max_model_len=8192, seed=11)
    assert st.conversations == 100 and st.turns == len(requests)
    assert st.mean_turns > 1.8  # ShareGPT is multi-turn: later turns are most requests
    assert_prefixes_real(requests, tok)
    chained = 0
    for turns in by_conversation(requests).values():
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.prompt.startswith(prev.prompt)
            # The template's boundary is token-safe here: the previous prompt is named
            # whole, and its tokens really are this prompt's first tokens.
            assert (f"{prev.conversation}/{prev.turn}", prev.prompt_tokens) in cur.prefix
            assert tok.encode(cur.prompt)[: prev.prompt_tokens] == tok.encode(prev.prompt)
            assert cur.prefix[: len(prev.prefix)] == prev.prefix
            chained += 1
        last = turns[-1]
        assert last.prefix[-1] == (f"{last.conversation}/{last.turn}", last.prompt_tokens)
    assert chained > 60
    assert st.not_token_prefix == 0


def test_turns_ids_and_output_lengths_follow_the_dataset(
    tekken: Tokenizer, multi: list[Request], conversations
) -> None:
    groups = by_conversation(multi)
    assert len(groups) == 150
    # Conversations are sent one after another, each turn in order.
    order = [r.conversation for r in multi]
    assert order == sorted(order, key=order.index)
    for name, turns in groups.items():
        assert [r.turn for r in turns] == list(range(len(turns)))
        (conv,) = [c for c in record_of(name, conversations)
                   if chat_prompt(message_pairs(c), 0) == turns[0].prompt]
        pairs = message_pairs(conv)
        for r in turns:
            message, reply = pairs[r.turn]
            assert r.prompt == chat_prompt(pairs, r.turn)
            assert r.prompt.endswith(f"User: {message}\nAssistant:")
            assert r.output_tokens == tekken.count(reply)
            if r.turn:
                assert f"Assistant: {pairs[r.turn - 1][1]}\nUser: " in r.prompt
    assert sum(1 for t in groups.values() if len(t) > 1) > 75


def test_the_first_user_message_rule_matches_the_files_roles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    roles: list[tuple[str, ...]] = []
    plain = wl._as_conversation

    def spy(obj):  # the reader keeps texts only: note the roles next to them
        conv = plain(obj)
        if conv is not None:
            roles.append(tuple(t.get("from", "") for t in obj["conversations"]))
        return conv

    monkeypatch.setattr(wl, "_as_conversation", spy)
    with default_sharegpt_path().open(encoding="utf-8", errors="replace", newline="") as f:
        convs, _, _ = wl._RecordReader(f).read()
    assert len(convs) == len(roles) > 17000
    pairs = right = 0
    for conv, rs in zip(convs, roles, strict=True):
        if len(conv.turns) < 2:
            continue
        pairs += 1
        start = first_user_message(conv)
        right += rs[start] in ("human", "user") and rs[start + 1] == "gpt"
    assert right / pairs > 0.995
    # Reading every record from its first message would swap a third of them.
    starts_with_user = sum(rs[0] in ("human", "user") for c, rs in zip(convs, roles,
                                                                        strict=True)
                           if len(c.turns) >= 2)
    assert starts_with_user / pairs < 0.7


def test_turns_that_do_not_fit_end_their_conversation_and_are_counted(
    tekken: Tokenizer, conversations
) -> None:
    requests, st = sample_conversations(conversations, tokenizer=tekken,
                                        num_conversations=120, max_model_len=700,
                                        max_turns=4, seed=3)
    assert all(r.prompt_tokens + r.output_tokens <= 700 for r in requests)
    assert st.too_long > 0 and st.too_short > 0 and st.over_max_turns > 0
    assert all(len(t) <= 4 for t in by_conversation(requests).values())
    # Every turn of every record looked at is a request or counted under one reason.
    pool = [c for c in conversations if len(c.turns) >= 2]
    random.Random(3).shuffle(pool)
    looked_at = sum(len(message_pairs(c)) for c in pool[: st.examined])
    assert looked_at == (st.turns + st.too_short + st.too_long + st.over_max_turns
                         + st.cut_to_num_prompts)
    assert_prefixes_real(requests, tekken)


def test_num_prompts_gives_exactly_that_many_requests(tekken: Tokenizer,
                                                      conversations) -> None:
    a, st = sample_conversations(conversations, tokenizer=tekken, num_prompts=101, seed=5)
    b, _ = sample_conversations(conversations, tokenizer=tekken, num_prompts=101, seed=5)
    c, _ = sample_conversations(conversations, tokenizer=tekken, num_prompts=101, seed=6)
    assert len(a) == 101 and a == b and a != c
    assert st.turns == 101
    with pytest.raises(WorkloadError, match="either"):
        sample_conversations(conversations, tokenizer=tekken)
    with pytest.raises(WorkloadError, match="either"):
        sample_conversations(conversations, tokenizer=tekken, num_prompts=5,
                             num_conversations=5)


def test_repeated_dataset_ids_get_distinct_conversation_names(tekken: Tokenizer) -> None:
    chat = ("Tell me about the sea and the ships.", "The sea is wide and ships sail it.")
    convs = [Conversation(id="same", turns=chat), Conversation(id="same", turns=chat[::-1])]
    requests, _ = sample_conversations(convs, tokenizer=tekken, num_conversations=2)
    names = {r.conversation for r in requests}
    assert len(names) == 2 and "same" in names
    keys = [r.prefix[-1][0] for r in requests]
    assert len(set(keys)) == 2


def test_a_tokenizer_that_merges_across_the_boundary_declares_only_the_common_part() -> None:
    tok = MergingTokenizer()
    turns = ("Hello there, friend", "Hi! How can I help?", "Tell me a story", "Once upon")
    requests, st = sample_conversations([Conversation(id="c", turns=turns)], tokenizer=tok,
                                        num_conversations=1)
    assert [r.turn for r in requests] == [0, 1]
    prev, cur = requests
    assert cur.prompt.startswith(prev.prompt)
    # "Assistant:" ends turn 0 with ':'; turn 1 has "Assistant: Hi!", where ': ' is one.
    assert st.not_token_prefix == 1
    assert cur.prefix == (("c/0", prev.prompt_tokens - 1), ("c/1", cur.prompt_tokens))
    assert_prefixes_real(requests, tok)
    assert tok.decode(tok.encode(cur.prompt)) == cur.prompt


def test_load_conversations_says_what_it_built(tekken: Tokenizer) -> None:
    w = load_conversations(tokenizer=tekken, num_conversations=40, seed=1)
    m = re.fullmatch(r"sharegpt multi-turn \((\d+) conversations, (\d+) turns, "
                     r"mean turns (\d+\.\d)\)", w.source)
    assert m is not None, w.source
    assert int(m[1]) == 40 and int(m[2]) == len(w.requests)
    assert float(m[3]) == pytest.approx(len(w.requests) / 40, abs=0.05)
    assert w.tokenizer == tekken.name
    text = "\n".join(w.notes)
    assert "dataset's reply" in text and "User: ...\\nAssistant:" in text
    assert "start with the assistant's reply" in text


# --------------------------------------------------------------------- system prompt


@pytest.fixture(scope="module")
def single(tekken: Tokenizer) -> Workload:
    return load_sharegpt(tokenizer=tekken, num_prompts=400, seed=2)


@pytest.mark.parametrize("share", [0.1, 0.5, 0.8])
def test_system_prompt_has_s_tokens_and_makes_up_the_asked_share(
    tekken: Tokenizer, single: Workload, share: float
) -> None:
    out, st = add_system_prompt(single.requests, share=share, tokenizer=tekken,
                                max_model_len=None, seed=4)
    s = st.tokens
    assert s % BLOCK_SIZE == 0 and s >= BLOCK_SIZE
    (text,) = st.texts
    assert tekken.count(text) == s and st.counts == (s,)
    assert len(out) == len(single.requests) and st.not_token_safe == 0
    for old, new in zip(single.requests, out, strict=True):
        assert new.prompt == text + old.prompt
        assert new.prompt_tokens == old.prompt_tokens + s
        assert new.prefix[0] == ("system/0", s)
        assert new.output_tokens == old.output_tokens
    measured = s * len(out) / sum(r.prompt_tokens for r in out)
    assert measured == pytest.approx(share, abs=0.03)
    assert st.share == pytest.approx(measured)
    # A cache serves the system prompt to all but the first request.
    assert prefix_share(out) == pytest.approx(measured * (len(out) - 1) / len(out))
    assert_prefixes_real(out[:50], tekken)


def test_system_prompt_shifts_existing_segments_and_keeps_the_turns_chained(
    tekken: Tokenizer, multi: list[Request]
) -> None:
    out, st = add_system_prompt(multi, share=0.3, tokenizer=tekken, max_model_len=None,
                                seed=9)
    s = st.tokens
    assert len(out) == len(multi) and st.not_token_safe == 0
    for old, new in zip(multi, out, strict=True):
        assert new.prefix == (("system/0", s), *((k, n + s) for k, n in old.prefix))
        assert (new.conversation, new.turn) == (old.conversation, old.turn)
    for turns in by_conversation(out).values():
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.prompt.startswith(prev.prompt)
    assert_prefixes_real(out, tekken)
    assert prefix_share(out) > prefix_share(multi) > 0.3


def test_same_seed_same_system_prompt(tekken: Tokenizer, single: Workload) -> None:
    def text(seed: int) -> str:
        return add_system_prompt(single.requests[:20], share=0.4, tokenizer=tekken,
                                 max_model_len=None, seed=seed)[1].texts[0]

    assert text(1) == text(1) != text(2)


def test_each_conversation_keeps_one_of_several_system_prompts(
    tekken: Tokenizer, multi: list[Request]
) -> None:
    out, st = add_system_prompt(multi, share=0.2, tokenizer=tekken, max_model_len=None,
                                num_system_prompts=3, seed=1)
    assert len(set(st.texts)) == 3 and st.counts == (st.tokens,) * 3
    used = set()
    for turns in by_conversation(out).values():
        keys = {r.prefix[0][0] for r in turns}
        assert len(keys) == 1
        used |= keys
    assert used == {"system/0", "system/1", "system/2"}
    assert_prefixes_real(out, tekken)


def test_requests_that_no_longer_fit_are_dropped_with_their_later_turns(
    tekken: Tokenizer, multi: list[Request]
) -> None:
    out, st = add_system_prompt(multi, share=0.5, tokenizer=tekken, max_model_len=1024,
                                seed=1)
    assert st.too_long > 0 and st.kept == len(out) == len(multi) - st.too_long
    assert all(r.prompt_tokens + r.output_tokens <= 1024 for r in out)
    before = by_conversation(multi)
    for name, turns in by_conversation(out).items():
        assert [r.turn for r in turns] == list(range(len(turns)))  # a run from turn 0
        assert len(turns) <= len(before[name])
    kept = sum(r.prompt_tokens for r in out)
    assert st.share == pytest.approx(st.tokens * len(out) / kept)


def test_a_boundary_merge_after_the_system_prompt_declares_only_what_is_shared() -> None:
    tok = MergingTokenizer()
    reqs = [
        Request(prompt=p, prompt_tokens=tok.count(p), output_tokens=8,
                prefix=(("k", tok.count(p) - 2),))
        for p in ("\nLine one of the prompt", "\nLine one of the prompt, longer")
    ] + [
        Request(prompt="plain prompt", prompt_tokens=12, output_tokens=8),
        Request(prompt="Some words", prompt_tokens=10, output_tokens=8, prefix=(("w", 6),)),
    ]
    out, st = add_system_prompt(reqs, share=0.5, tokenizer=tok, max_model_len=None,
                                block_size=1)
    s = st.tokens
    assert st.counts == (s,)
    # "...\n" + "\nLine" merges into "\n\n": only S - 1 tokens of the system prompt stay.
    assert out[0].prefix == (("system/0", s - 1),) and out[1].prefix == (("system/0", s - 1),)
    assert out[2].prefix == (("system/0", s),)
    # The system prompt is whole, but "Some" no longer starts the text: its first token
    # changed, so the old segment no longer holds and is dropped.
    assert out[3].prefix == (("system/0", s),)
    assert out[3].prompt_tokens == 10 + s
    assert st.not_token_safe == 3
    assert_prefixes_real(out, tok)


@pytest.mark.parametrize("share", [-0.1, 1.0, 1.5, math.nan, math.inf, "half"])
def test_a_share_outside_0_1_is_refused_in_one_line(
    tekken: Tokenizer, single: Workload, share
) -> None:
    with pytest.raises(WorkloadError, match=r"share must be in \[0, 1\)") as err:
        add_system_prompt(single.requests, share=share, tokenizer=tekken, max_model_len=None)
    assert "\n" not in str(err.value)
    with pytest.raises(WorkloadError, match=r"share must be in \[0, 1\)"):
        with_system_prompt(single, share=share, tokenizer=tekken, max_model_len=None)


def test_share_zero_changes_nothing(tekken: Tokenizer, single: Workload) -> None:
    assert with_system_prompt(single, share=0, tokenizer=tekken, max_model_len=2048) is single
    out, st = add_system_prompt(single.requests, share=0.0, tokenizer=tekken,
                                max_model_len=2048)
    assert out == single.requests and st.tokens == 0


def test_with_system_prompt_says_what_it_did(tekken: Tokenizer, single: Workload) -> None:
    w = with_system_prompt(single, share=0.25, tokenizer=tekken, max_model_len=2048, seed=3)
    assert w.source.startswith(single.source + " + system prompt (")
    assert "25%" in w.source
    assert any("asked for 25.0% of prompt tokens" in n for n in w.notes)
    assert w.notes[: len(single.notes)] == single.notes
    with pytest.raises(WorkloadError, match="same tokenizer"):
        with_system_prompt(single, share=0.25, tokenizer=MergingTokenizer(), max_model_len=None)


# ----------------------------------------------------------------------- measurement


def test_prefix_share_counts_leading_blocks_an_earlier_request_named() -> None:
    def req(n: int, *prefix: tuple[str, int]) -> Request:
        return Request(prompt="x", prompt_tokens=n, output_tokens=1, prefix=prefix)

    assert prefix_share([req(64, ("a", 40)), req(64, ("a", 40))]) == 32 / 128
    assert prefix_share([req(64, ("a", 40)), req(64, ("a", 40))], block_size=1) == 40 / 128
    # Block 0 misses ("x" is new), so block 1's hit on "a" is not reached.
    assert prefix_share([req(64, ("a", 32)), req(64, ("x", 16), ("a", 32))]) == 0
    assert prefix_share([req(64, ("a", 32))] * 3) == 64 / 192
    assert prefix_share([]) == 0


def test_prefix_share_of_first_turns_is_zero_and_of_conversations_positive(
    single: Workload, multi: list[Request]
) -> None:
    assert prefix_share(single.requests) == 0
    assert prefix_share(multi) > 0.3
    # Turn 0 of each conversation shares nothing yet.
    assert prefix_share([r for r in multi if r.turn == 0]) == 0
