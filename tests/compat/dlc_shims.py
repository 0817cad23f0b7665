"""pytest plugin for the compat job (.ci/run: `-p dlc_shims` with tests/compat on PYTHONPATH).

Only the tests' own reference models need it: they load Hugging Face models with transformers 5's
`dtype=` keyword, which 4.48 calls `torch_dtype=` (and passes on to the model's __init__, a
TypeError). The serving code loads no model through from_pretrained (server/models/loader.py reads
the config and the safetensors itself), so this shim hides nothing the Neuron DLC would run into.
"""

from __future__ import annotations

import functools

import transformers
from transformers.modeling_utils import PreTrainedModel

if int(transformers.__version__.split(".")[0]) < 5:
    _from_pretrained = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(_from_pretrained)
    def _from_pretrained_dtype(cls, *args, **kwargs):
        if "dtype" in kwargs and "torch_dtype" not in kwargs:
            kwargs["torch_dtype"] = kwargs.pop("dtype")
        return _from_pretrained(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(_from_pretrained_dtype)
