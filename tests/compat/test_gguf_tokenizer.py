"""The converted SmolLM2 tokenizer says what its GGUF says, under transformers 5 (the main venv) and
4.48 (the Neuron DLC's, .ci/run's compat venv): 4.48 alone got BOS, eos/pad and the byte-level
decoder wrong before server/models/source.py repaired them."""

from __future__ import annotations

import importlib.metadata

from server.engine.structured import token_bytes
from server.models.source import _converter_suffix, _gguf_scalars, gguf_path
from server.runtime import eos_token_ids, load_tokenizer


def test_special_tokens_and_bos_follow_the_gguf(default_config, smol_dir):
    meta = _gguf_scalars(gguf_path(default_config.model))
    tok = load_tokenizer(smol_dir)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.add_bos_token"] is False
    assert tok.bos_token_id == meta["tokenizer.ggml.bos_token_id"] == 1
    assert tok.eos_token_id == meta["tokenizer.ggml.eos_token_id"] == 2  # <|im_end|>, not <|im_start|>
    assert tok.pad_token_id == meta["tokenizer.ggml.padding_token_id"]
    assert tok.encode("Hello world") == tok.encode("Hello world", add_special_tokens=False)  # no BOS
    assert eos_token_ids(smol_dir, tok) == {2}


def test_token_bytes_are_byte_level(smol_dir):
    """llguidance (structured output, logprob bytes) reads the tokenizer as byte-level BPE: 'Ġ' is a space."""
    tok = load_tokenizer(smol_dir)
    ids = tok.encode(' {"x": "é"}', add_special_tokens=False)
    assert b"".join(token_bytes(tok, i) for i in ids) == ' {"x": "é"}'.encode()
    assert tok.decode(ids) == ' {"x": "é"}'


def test_each_transformers_major_converts_into_its_own_folder(smol_dir):
    """4.48 cannot load the tokenizer 5.x saves (and the reverse loads a different one): no shared folder."""
    major = importlib.metadata.version("transformers").split(".")[0]
    assert _converter_suffix() == ("" if major == "5" else f"-transformers{major}")
    assert smol_dir.name.endswith(_converter_suffix())
