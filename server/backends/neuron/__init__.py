"""Neuron backend (trn1): transformers-neuronx graph with our NKI low-rank MLP. Imports the SDK lazily."""

from __future__ import annotations

from pathlib import Path

from server.config import Config, ConfigError

INSTALL_HINT = ("backend neuron needs the AWS Neuron SDK 2.25 (neuronx-cc, torch-neuronx, transformers-neuronx) "
                "from AWS's Neuron pip repository on a trn1 host or the Neuron DLC image; see docs/DEPLOY.md")


def require_neuron_sdk() -> None:
    """Raise a one-line ConfigError unless the real (not PyPI placeholder) Neuron SDK imports."""
    try:
        import neuronxcc  # noqa: F401
        import transformers_neuronx  # noqa: F401
    except Exception as exc:  # PyPI placeholders raise ImportError("WRONG PACKAGE ...") on import
        raise ConfigError(f"{INSTALL_HINT} ({exc.__class__.__name__}: {str(exc).splitlines()[0][:80]})") from None


def create_neuron_runner(cfg: Config, model_dir: Path, compressed: Path | None):
    """The Neuron runner; fails with one clear line where the SDK is absent."""
    require_neuron_sdk()
    from server.backends.neuron.runner import NeuronRunner

    return NeuronRunner(cfg, model_dir, compressed)
