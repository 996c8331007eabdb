"""Tokenizer selection and the three real tokenizers: tokenizer.json, /tokenize, tekken."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from autotune.workload.tokenizer import (
    HFTokenizer,
    ServerTokenizer,
    TekkenTokenizer,
    TokenizerError,
    WorkloadError,
    load_tokenizer,
    server_root,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A load test sends requests at a fixed rate and measures latency.",
    "Every request has a prompt and asks for a number of output tokens.",
    "The server streams tokens back one chunk at a time.",
    "We count the time to first token and the time per output token.",
    "Goodput counts only the requests that meet the latency objective.",
    "The water in the city is good, and the people live near the school.",
    "She said that they will write a new word in the book each day.",
]


def train_tokenizer_json(folder: Path) -> Path:
    """A real byte-level BPE ``tokenizer.json`` trained on a few lines."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer_json(tmp_path_factory.mktemp("model"))


class TokenizeServer:
    """A vLLM-shaped /tokenize and /detokenize over a real tokenizer, on 127.0.0.1:0."""

    def __init__(self, tokenizer_path: Path, *, has_tokenize: bool = True) -> None:
        self.tok = RustTokenizer.from_file(str(tokenizer_path))
        self.has_tokenize = has_tokenize
        self.fail_with: int | None = None
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._lock:
                    outer.requests.append({"path": self.path, **body})
                    outer.auth.append(self.headers.get("Authorization"))
                if not outer.has_tokenize or self.path not in ("/tokenize", "/detokenize"):
                    return self._send(404, {"detail": "Not Found"})
                if outer.fail_with is not None:
                    return self._send(outer.fail_with, {"error": "boom"})
                if self.path == "/tokenize":
                    special = body.get("add_special_tokens", True)
                    ids = outer.tok.encode(body["prompt"], add_special_tokens=special).ids
                    answer = {"count": len(ids), "tokens": ids, "max_model_len": 4096}
                    return self._send(200, answer)
                return self._send(200, {"prompt": outer.tok.decode(body["tokens"])})

            def _send(self, code: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> TokenizeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def server(tokenizer_json: Path) -> Iterator[TokenizeServer]:
    with TokenizeServer(tokenizer_json) as srv:
        yield srv


@pytest.fixture
def server_without_tokenize(tokenizer_json: Path) -> Iterator[TokenizeServer]:
    with TokenizeServer(tokenizer_json, has_tokenize=False) as srv:
        yield srv


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------- selection order


def test_path_to_file_or_folder_gives_that_tokenizer_json(tokenizer_json: Path) -> None:
    ref = RustTokenizer.from_file(str(tokenizer_json))
    text = "The quick brown fox measures latency."
    for given in (tokenizer_json, tokenizer_json.parent, str(tokenizer_json.parent)):
        tok = load_tokenizer(given)
        assert isinstance(tok, HFTokenizer)
        assert str(tokenizer_json) in tok.name and "tokenizer.json" in tok.name
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
        assert tok.count(text) == len(tok.encode(text)) > 0
        assert tok.decode(tok.encode(text)) == text


def test_path_wins_over_server(tokenizer_json: Path, server: TokenizeServer) -> None:
    tok = load_tokenizer(tokenizer_json, server_url=server.url, model="m")
    assert isinstance(tok, HFTokenizer)
    assert server.requests == []  # the server was not even asked


def test_server_with_tokenize_is_used_when_no_path(server: TokenizeServer) -> None:
    url = server.url + "/v1/"
    with load_tokenizer(server_url=url, model="my-model", api_key="sk-secret-1") as tok:
        assert isinstance(tok, ServerTokenizer)
        assert tok.name == f"server /tokenize at {server.url} (model my-model)"
        assert "sk-secret-1" not in tok.name and "sk-secret-1" not in repr(tok)
        text = "Every request has a prompt."
        expected = server.tok.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == expected
        assert tok.count(text) == len(expected)
        assert tok.decode(expected) == text
        assert tok.max_model_len == 4096
    assert all(r["model"] == "my-model" for r in server.requests)
    assert all(r.get("add_special_tokens") is False for r in server.requests if "prompt" in r)
    assert set(server.auth) == {"Bearer sk-secret-1"}
    assert {r["path"] for r in server.requests} == {"/tokenize", "/detokenize"}


def test_server_without_tokenize_falls_back_to_tekken_and_says_why(
    server_without_tokenize: TokenizeServer,
) -> None:
    tok = load_tokenizer(server_url=server_without_tokenize.url)
    assert isinstance(tok, TekkenTokenizer)
    assert "tekken_240911" in tok.name and "offline stand-in" in tok.name
    assert "404" in tok.name and server_without_tokenize.url in tok.name
    assert len(server_without_tokenize.requests) == 1  # one probe, then offline


def test_unreachable_server_falls_back_to_tekken() -> None:
    url = closed_port_url()
    tok = load_tokenizer(server_url=url)
    assert isinstance(tok, TekkenTokenizer)
    assert "cannot reach" in tok.name and url in tok.name


def test_default_is_tekken_from_mistral_common() -> None:
    tok = load_tokenizer()
    assert isinstance(tok, TekkenTokenizer)
    assert tok.name == "mistral-common tekken_240911 (offline stand-in for the model's tokenizer)"
    assert tok.path.name == "tekken_240911.json" and "mistral_common" in str(tok.path)
    text = "Hello world, this is a load test of a vLLM server."
    ids = tok.encode(text)
    assert 5 < len(ids) < len(text)  # a real BPE: fewer tokens than characters
    assert tok.decode(ids) == text
    assert tok.count_many([text, "Hi"]) == [len(ids), tok.count("Hi")]


# ------------------------------------------------------------------------- errors


def test_missing_path_is_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(WorkloadError) as err:
        load_tokenizer(missing)
    msg = str(err.value)
    assert str(missing) in msg and "does not exist" in msg and "\n" not in msg


def test_folder_without_tokenizer_json_is_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WorkloadError, match="no tokenizer.json in"):
        load_tokenizer(tmp_path)


def test_file_that_is_not_a_tokenizer_is_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"hello": "world"}')
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(bad)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, WorkloadError)


def test_server_error_after_probe_raises(server: TokenizeServer) -> None:
    with load_tokenizer(server_url=server.url) as tok:
        server.fail_with = 500
        with pytest.raises(TokenizerError, match="HTTP 500"):
            tok.count("a text the cache has not seen")


# --------------------------------------------------------------- server batching


def test_server_count_many_is_parallel_correct_and_cached(server: TokenizeServer) -> None:
    texts = [f"{line} number {i}" for i, line in enumerate(CORPUS * 5)]
    texts.append(texts[0])  # a duplicate is asked once
    with ServerTokenizer(server.url, max_parallel=4) as tok:
        counts = tok.count_many(texts)
        asked = len(server.requests)
        again = tok.count_many(texts)
    expected = [len(server.tok.encode(t, add_special_tokens=False).ids) for t in texts]
    assert counts == expected == again
    assert asked == len(set(texts))
    assert len(server.requests) == asked  # the second pass came from the cache


def test_server_root_strips_v1() -> None:
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h:8000") == "http://h:8000"
