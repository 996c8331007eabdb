"""Token counting with a real tokenizer: the model's, the server's, or an offline stand-in.

``load_tokenizer`` picks, in this order:

1. a local ``tokenizer.json`` (or a model folder holding one), read with ``tokenizers``;
2. the server's own ``POST /tokenize`` (vLLM has it), when the server answers it;
3. Mistral's ``tekken_240911.json`` from the ``mistral-common`` wheel, a 131k-vocabulary
   BPE that stands in for the model's tokenizer offline.

Every tokenizer carries a ``name`` that says which one it is; outputs print it, so a
count is never an unexplained estimate.  Counts are of the text alone: special tokens
(BOS/EOS) that a server adds around a prompt are not included.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx

from autotune.core.errors import AutotuneError

TEKKEN_FILE = "tekken_240911.json"
_TEKKEN_NAME = "mistral-common tekken_240911 (offline stand-in for the model's tokenizer)"


class WorkloadError(AutotuneError, ValueError):
    """A workload (dataset file, tokenizer, lengths) could not be built as asked."""


class TokenizerError(WorkloadError):
    """A tokenizer could not be loaded or a tokenizer server did not answer properly."""


class Tokenizer(ABC):
    """Text <-> token ids.  ``name`` says which tokenizer this is, for every output."""

    name: str

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Counts of many texts; implementations batch or parallelise this."""
        return [self.count(t) for t in texts]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts; implementations batch or parallelise this."""
        return [self.encode(t) for t in texts]

    def close(self) -> None:
        """Release connections; a no-op for local tokenizers."""
        return None

    def __enter__(self) -> Tokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer  # heavy: only for tokenizer.json

        self.path = Path(path)
        try:
            self._tok = _RustTokenizer.from_file(str(self.path))
        except Exception as exc:  # the Rust side raises a bare Exception
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TokenizerError(f"cannot read tokenizer file {self.path}: {first}") from None
        self.name = f"tokenizer.json at {self.path}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.encode_many(texts)]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encs]


def default_tekken_path() -> Path:
    """``tekken_240911.json`` inside the installed ``mistral-common`` package."""
    import mistral_common  # heavy: only for its shipped tekken file

    return Path(mistral_common.__file__).parent / "data" / TEKKEN_FILE


@lru_cache(maxsize=4)
def _load_tekkenizer(path: str) -> Any:
    # Loading the 19 MB vocabulary takes ~2 s: once per process and file.
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    try:
        return Tekkenizer.from_file(path)
    except (AssertionError, ValueError, KeyError, OSError) as exc:
        raise TokenizerError(f"cannot read tekken tokenizer file {path}: {exc}") from None


class TekkenTokenizer(Tokenizer):
    """A Mistral tekken tokenizer file, through mistral-common's ``Tekkenizer``."""

    def __init__(self, path: str | Path | None = None, *, name: str | None = None) -> None:
        self.path = Path(path) if path is not None else default_tekken_path()
        if not self.path.is_file():
            raise TokenizerError(f"tekken tokenizer file not found: {self.path}")
        self._tok = _load_tekkenizer(str(self.path))
        if name is None:
            name = _TEKKEN_NAME if path is None else f"tekken file at {self.path}"
        self.name = name

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, bos=False, eos=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def server_root(url: str) -> str:
    """``http://h:8000/v1/`` -> ``http://h:8000``: vLLM serves /tokenize at the root."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


class ServerTokenizer(Tokenizer):
    """The server's own tokenizer over ``POST /tokenize`` and ``POST /detokenize``.

    Counts are cached per text (bounded), and ``count_many`` sends up to
    ``max_parallel`` requests at a time over one connection pool.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
        max_parallel: int = 8,
        cache_size: int = 100_000,
    ) -> None:
        self.root = server_root(url)
        self.model = model
        self.max_parallel = max(1, max_parallel)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.root,
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=self.max_parallel),
        )
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.max_model_len: int | None = None  # the server's, learned from /tokenize
        suffix = f" (model {model})" if model else ""
        self.name = f"server /tokenize at {self.root}{suffix}"

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.model:
            body = {"model": self.model, **body}
        where = f"{self.root}{path}"
        try:
            resp = self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise TokenizerError(f"cannot reach {where}: {exc or type(exc).__name__}") from None
        if resp.status_code == 404:
            raise TokenizerError(f"{where} does not exist (HTTP 404): the server has no {path}")
        if resp.status_code != 200:
            text = " ".join(resp.text.split())[:200]
            raise TokenizerError(f"{where} answered HTTP {resp.status_code}: {text}")
        try:
            data = resp.json()
        except ValueError:
            raise TokenizerError(f"{where} answered something that is not JSON") from None
        if not isinstance(data, dict):
            raise TokenizerError(f"{where} answered JSON that is not an object")
        return data

    def encode(self, text: str) -> list[int]:
        data = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise TokenizerError(f"{self.root}/tokenize answered without a 'tokens' list")
        if isinstance(data.get("max_model_len"), int):
            self.max_model_len = data["max_model_len"]
        self._remember(text, len(tokens))
        return [int(t) for t in tokens]

    def decode(self, ids: Sequence[int]) -> str:
        data = self._post("/detokenize", {"tokens": [int(i) for i in ids]})
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise TokenizerError(f"{self.root}/detokenize answered without a 'prompt' string")
        return prompt

    def count(self, text: str) -> int:
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        return len(self.encode(text))

    def count_many(self, texts: Sequence[str]) -> list[int]:
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if len(missing) > 1 and self.max_parallel > 1:
            with ThreadPoolExecutor(max_workers=self.max_parallel) as pool:
                counts = dict(zip(missing, pool.map(self.count, missing), strict=True))
        else:
            counts = {t: self.count(t) for t in missing}
        return [counts[t] if t in counts else self.count(t) for t in texts]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        if len(texts) > 1 and self.max_parallel > 1:
            with ThreadPoolExecutor(max_workers=self.max_parallel) as pool:
                return list(pool.map(self.encode, texts))
        return [self.encode(t) for t in texts]

    def _remember(self, text: str, n: int) -> None:
        with self._lock:
            self._cache[text] = n
            self._cache.move_to_end(text)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def probe(self) -> None:
        """Raise ``TokenizerError`` unless the server tokenizes a short text."""
        self.encode("Hello")

    def close(self) -> None:
        self._client.close()


def find_tokenizer_file(path: str | Path) -> Path:
    """The tokenizer file at ``path``: the file itself, or ``tokenizer.json`` in a folder.

    A model folder with only Mistral's ``tekken.json`` is accepted too.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise WorkloadError(f"tokenizer path does not exist: {p}")
    if p.is_dir():
        for candidate in ("tokenizer.json", "tekken.json"):
            if (p / candidate).is_file():
                return p / candidate
        raise WorkloadError(
            f"no tokenizer.json in {p}: give the model folder that holds it or the file itself"
        )
    return p


def tokenizer_from_path(path: str | Path) -> Tokenizer:
    p = find_tokenizer_file(path)
    if "tekken" in p.name and p.suffix == ".json":
        return TekkenTokenizer(p)
    return HFTokenizer(p)


def load_tokenizer(
    path: str | Path | None = None,
    server_url: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
) -> Tokenizer:
    """The best tokenizer available: ``path``, else the server's /tokenize, else tekken.

    A server that does not answer /tokenize is not an error: the offline stand-in is used
    and its ``name`` says why.  A bad ``path`` is an error (``WorkloadError``).
    """
    if path is not None:
        return tokenizer_from_path(path)
    reason = ""
    if server_url:
        server = ServerTokenizer(server_url, model=model, api_key=api_key)
        try:
            server.probe()
            return server
        except TokenizerError as exc:
            server.close()
            reason = str(exc)
    if not reason:
        return TekkenTokenizer()
    return TekkenTokenizer(name=f"{_TEKKEN_NAME[:-1]}; the server's was not usable: {reason})")

