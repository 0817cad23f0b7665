"""Config loading and the CLI's one-line errors (exit code 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.cli import main
from server.config import ConfigError, load_config


def test_default_config_loads():
    cfg = load_config()
    assert cfg.model.source == "gguf" and cfg.backend == "torch" and cfg.engine.max_num_seqs >= 1


def test_override_applies(tmp_path):
    cfg = load_config(None, {"server.port": 9001, "engine.max_num_seqs": 3})
    assert cfg.server.port == 9001 and cfg.engine.max_num_seqs == 3


@pytest.mark.parametrize("yaml_text, fragment", [
    ("model: {name: x, source: gguf, path: /x.gguf}\nengine: {max_num_seqs: lots}\n", "engine.max_num_seqs"),
    ("model: {name: x, source: gguf, path: /x.gguf}\nengin: {}\n", "engin: unknown key"),
    ("model: {name: x, source: safetensors}\n", "needs `path`"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_bad_config_names_the_key(tmp_path, yaml_text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert fragment in str(err.value)


def test_cli_bad_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: x, source: gguf, path: /nonexistent/model.gguf}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.path" in err[0] and "/nonexistent/model.gguf" in err[0]


def test_cli_missing_package_exits_2(tmp_path, capsys):
    path = tmp_path / "pkg.yaml"
    path.write_text("model: {name: x, source: gguf, package: no-such-dist-xyz, resource: a.gguf}\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "no-such-dist-xyz" in capsys.readouterr().err


def test_neuron_backend_without_sdk_is_one_line(tmp_path, tiny_model_dir):
    path = tmp_path / "neuron.yaml"
    path.write_text(f"model: {{name: x, source: safetensors, path: {tiny_model_dir}}}\nbackend: neuron\n")
    proc = subprocess.run([sys.executable, "-c", "from server.cli import main; import sys; "
                           f"sys.exit(main(['serve', '--config', '{path}', '--port', '0']))"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "Neuron SDK" in last and "Traceback" not in proc.stderr
