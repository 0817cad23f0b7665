"""Config loading and the CLI's one-line errors (exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server import cli
from server.backends import check_backend_available
from server.cli import main
from server.config import DEFAULT_CONFIG, ConfigError, load_config
from support import finished_children


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
    ("model:\n  name: x\n  dtype: auto\n  dtype: float32\n", "key 'dtype' appears twice in one section (lines 3 and 4)"),
])
def test_bad_config_names_the_key(tmp_path, yaml_text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert fragment in str(err.value)


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    """Each config under configs/ is valid YAML with no key given twice (a repeated key once kept the last silently)
    and a valid config."""
    assert load_config(path).model.name


def test_cli_bad_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: x, source: gguf, path: /nonexistent/model.gguf}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.path" in err[0] and "/nonexistent/model.gguf" in err[0]


def test_a_bad_flag_value_is_named_as_the_command_lines_not_the_files(tmp_path, capsys):
    assert main(["serve", "--port", "99999"]) == 2
    assert capsys.readouterr().err.strip() == ("neuronmm serve: error: the command line: server.port must be <= 65535, "
                                               "got 99999")
    path = tmp_path / "c.yaml"
    path.write_text(DEFAULT_CONFIG.read_text().replace("port: 8000", "port: 99999"))
    assert "port: 99999" in path.read_text()
    assert main(["serve", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"neuronmm serve: error: {path}: server.port must be <= 65535")


@pytest.mark.parametrize("argv, says", [
    (["serve", "--dtype", "foo"], "neuronmm serve: error: argument --dtype: invalid choice: 'foo'"),
    (["compress", "--keep-ratio", "x"], "neuronmm compress: error: argument --keep-ratio: invalid float value: 'x'"),
    (["serve", "--no-such-flag"], "neuronmm: error: unrecognized arguments: --no-such-flag"),
])
def test_a_bad_flag_is_one_line_not_the_usage(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(says) and err[0].endswith("--help)")


def test_a_config_that_is_a_folder_or_not_text_is_one_line(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="not a text"):
        load_config(binary)
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)


def test_cli_missing_package_exits_2(tmp_path, capsys):
    path = tmp_path / "pkg.yaml"
    path.write_text("model: {name: x, source: gguf, package: no-such-dist-xyz, resource: a.gguf}\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "no-such-dist-xyz" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"notagguf" * 4], ids=["empty", "foreign"])
def test_a_file_that_is_no_gguf_exits_2_with_one_line(tmp_path, capsys, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert main(["serve", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"neuronmm serve: error: model.path: {path} is not a GGUF file"), err
    assert "Traceback" not in "\n".join(err)


def _serve_child(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from server.cli import main; import sys; "
                             f"sys.exit(main(['serve', '--config', '{config}', '--port', '0']))"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def serve_children(tmp_path_factory, tiny_model_dir):
    """`neuronmm serve` in a child for each config these tests start with (each ends in a config error), all started
    at once, when the first test reads one: the second's model load (seconds) runs beside the tests between them.
    A function from the config's name to its finished child."""
    from support import tiny_config_file

    folder = tmp_path_factory.mktemp("serve")
    neuron = folder / "neuron.yaml"
    neuron.write_text(f"model: {{name: x, source: safetensors, path: {tiny_model_dir}}}\nbackend: neuron\n")
    kv = tiny_config_file(tiny_model_dir, tmp_path_factory.mktemp("kv"), kv_cache_gib=1e-6)
    procs = {"neuron": _serve_child(neuron), "tiny kv pool": _serve_child(kv)}
    yield from finished_children(procs, 120)


def test_neuron_backend_without_sdk_is_one_line(serve_children):
    proc = serve_children("neuron")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "Neuron SDK" in last and "Traceback" not in proc.stderr


def _serve_config(argv: list[str]):
    from server.cli import build_parser, serve_overrides

    return load_config(*serve_overrides(build_parser().parse_args(["serve", *argv])))


def test_vllm_style_serve_flags_map_onto_the_config(tmp_path):
    cfg = _serve_config([str(tmp_path / "m.gguf"), "--served-model-name", "chat", "chat-2", "--max-model-len", "512",
                         "--tensor-parallel-size", "2", "--chat-template", "hermes_tools", "--strict-fields",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    assert (cfg.model.source, cfg.model.path, cfg.model.name) == ("gguf", str(tmp_path / "m.gguf"), "chat")
    assert cfg.server.model_aliases == ["chat-2"] and cfg.engine.max_model_len == 512
    assert cfg.neuron.tp_degree == 2 and cfg.server.chat_template == "hermes_tools" and cfg.server.strict_fields
    assert cfg.server.reasoning_parser == "qwen3" and _serve_config([]).server.reasoning_parser is None
    folder = _serve_config([str(tmp_path)])
    assert (folder.model.source, folder.model.name) == ("safetensors", str(tmp_path))
    hub = _serve_config(["HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert (hub.model.source, hub.model.hf_id) == ("hf", "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_more_vllm_serve_flags(monkeypatch):
    assert _serve_config(["--generation-config", "vllm"]).model.generation_config == "vllm"
    assert _serve_config([]).model.generation_config == "auto"
    cfg = _serve_config(["--seed", "7", "--block-size", "32", "--no-enable-prefix-caching",
                         "--allowed-origins", '["https://a.example", "https://b.example"]',
                         "--uvicorn-log-level", "warning"])
    assert (cfg.engine.seed, cfg.engine.block_size, cfg.engine.enable_prefix_caching) == (7, 32, False)
    assert cfg.server.cors_origins == ["https://a.example", "https://b.example"] and cfg.server.log_level == "warning"
    default = _serve_config([])
    assert default.engine.enable_prefix_caching is True and default.server.cors_origins == []  # the config's
    commas = _serve_config(["--allowed-origins", "https://a.example, *"])
    assert commas.server.cors_origins == ["https://a.example", "*"]
    monkeypatch.setenv("NEURONMM_ENABLE_PREFIX_CACHING", "false")
    assert _serve_config([]).engine.enable_prefix_caching is False
    assert _serve_config(["--enable-prefix-caching"]).engine.enable_prefix_caching is True


def test_bad_allowed_origins_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _serve_config(["--allowed-origins", '["a", 3]'])
    assert "expected a JSON list of strings" in capsys.readouterr().err


def test_enforce_eager_flag():
    assert _serve_config([]).engine.enforce_eager is False  # CUDA decode steps replay captured graphs by default
    assert _serve_config(["--enforce-eager"]).engine.enforce_eager is True


def test_stream_interval_flag():
    assert _serve_config([]).server.stream_interval == 1
    assert _serve_config(["--stream-interval", "8"]).server.stream_interval == 8
    with pytest.raises(ConfigError, match="server.stream_interval"):
        _serve_config(["--stream-interval", "0"])


def test_max_prefill_tokens_while_decoding_flag(capsys):
    cap = lambda argv: _serve_config(argv).engine.max_prefill_tokens_while_decoding  # noqa: E731
    assert cap([]) == "auto"  # resolved for the runner at start-up (runtime.prefill_cap_while_decoding)
    assert cap(["--max-prefill-tokens-while-decoding", "64"]) == 64
    assert cap(["--max-prefill-tokens-while-decoding", "off"]) == "off"
    with pytest.raises(ConfigError, match="engine.max_prefill_tokens_while_decoding"):
        cap(["--max-prefill-tokens-while-decoding", "0"])
    with pytest.raises(SystemExit):
        cap(["--max-prefill-tokens-while-decoding", "some"])
    assert "expected auto, off or a number of tokens, got 'some'" in capsys.readouterr().err


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("off", "off"), ("false", "off"), ("null", None),
                                             ("96", 96)])
def test_max_prefill_tokens_while_decoding_in_yaml(tmp_path, value, expected):
    """A bare `off` is YAML's false: it means off too."""
    path = tmp_path / "c.yaml"
    path.write_text(DEFAULT_CONFIG.read_text().replace("max_prefill_tokens_while_decoding: auto",
                                                       f"max_prefill_tokens_while_decoding: {value}"))
    assert load_config(path).engine.max_prefill_tokens_while_decoding == expected


@pytest.mark.parametrize("value", ["0", "-3", "true", "sometimes"])
def test_max_prefill_tokens_while_decoding_refuses(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(DEFAULT_CONFIG.read_text().replace("max_prefill_tokens_while_decoding: auto",
                                                       f"max_prefill_tokens_while_decoding: {value}"))
    with pytest.raises(ConfigError, match="max_prefill_tokens_while_decoding: .*expected auto, off or a number"):
        load_config(path)


@pytest.mark.parametrize("dtype, expected", [("auto", "auto"), ("bfloat16", "bfloat16"), ("float32", "float32"),
                                             ("float16", "float16"), ("half", "float16")])
def test_dtype_flag(dtype, expected):
    assert _serve_config(["--dtype", dtype]).model.dtype == expected


@pytest.mark.parametrize("flag, expected", [(None, "auto"), ("half", "float16"), ("bfloat16", "bfloat16"),
                                            ("fp8", "fp8"), ("fp8_e4m3", "fp8_e4m3")])
def test_kv_cache_dtype_flag(flag, expected):
    assert _serve_config(["--kv-cache-dtype", flag] if flag else []).engine.kv_cache_dtype == expected


def test_quantization_flag_and_its_environment_variable(monkeypatch):
    assert _serve_config([]).model.quantization is None
    assert _serve_config(["--quantization", "int8"]).model.quantization == "int8"
    assert _serve_config(["--quantization", "gguf"]).model.quantization == "gguf"
    assert _serve_config(["--quantization", "none"]).model.quantization == "none"
    monkeypatch.setenv("NEURONMM_QUANTIZATION", "int8")
    assert _serve_config([]).model.quantization == "int8"


def test_int8_on_a_cuda_device_or_the_neuron_backend_stops_the_start():
    cuda = load_config(None, {"model.quantization": "int8", "device": "cuda"})
    with pytest.raises(ConfigError, match="quantization|CUDA"):
        check_backend_available(cuda)
    neuron = load_config(None, {"model.quantization": "int8", "backend": "neuron"})
    with pytest.raises(ConfigError, match="model.quantization: the neuron backend"):
        check_backend_available(neuron)


@pytest.mark.parametrize("dtype, kv_cache_dtype, ok", [
    ("float32", "float16", True), ("float32", "bfloat16", True), ("bfloat16", "bfloat16", True),
    ("float32", "fp8", True), ("bfloat16", "fp8_e4m3", True),
    ("bfloat16", "float16", False), ("bfloat16", "float32", False), ("float16", "bfloat16", False),
    ("float16", "fp8", False)])
def test_a_kv_cache_dtype_the_kernels_lack_stops_the_start(dtype, kv_cache_dtype, ok):
    from server.backends import check_backend_available

    cfg = load_config(None, {"model.dtype": dtype, "engine.kv_cache_dtype": kv_cache_dtype})
    if ok:
        check_backend_available(cfg)
        return
    with pytest.raises(ConfigError, match=f"engine.kv_cache_dtype: {kv_cache_dtype} under a {dtype} model"):
        check_backend_available(cfg)


def test_every_serve_flag_reads_its_env_var(monkeypatch):
    monkeypatch.setenv("NEURONMM_MAX_MODEL_LEN", "333")
    monkeypatch.setenv("NEURONMM_SERVED_MODEL_NAME", "a,b")
    monkeypatch.setenv("NEURONMM_STRICT_FIELDS", "true")
    cfg = _serve_config([])
    assert cfg.engine.max_model_len == 333 and cfg.model.name == "a" and cfg.server.model_aliases == ["b"]
    assert cfg.server.strict_fields
    assert _serve_config(["--max-model-len", "444"]).engine.max_model_len == 444  # the flag wins


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("neuronmm ")


def test_port_in_use_is_reported_before_the_model_loads(tmp_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model does not exist: had it been loaded first, that would be the error
        assert main(["serve", str(tmp_path / "missing.gguf"), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "missing.gguf" not in err[0]


@pytest.fixture
def spawned(monkeypatch) -> list:
    """The engine cores `neuronmm serve` spawns, recorded instead of started; past its checks it serves nothing
    (returns 0), so a check that regresses fails the test rather than serving."""
    from server.engine.engine_core import EngineCoreClient

    cores: list = []
    monkeypatch.setattr(EngineCoreClient, "spawn", lambda self: cores.append(self))
    monkeypatch.setattr(cli, "_serve_with", lambda cfg, core: 0)
    return cores


def test_unknown_tool_parser_and_template_are_one_line_errors(spawned, capsys):
    """Each is a one-line error, given before the engine core is spawned: a typo costs no model load."""
    assert main(["serve", "--tool-call-parser", "nope", "--port", "0"]) == 2
    assert "known: hermes" in capsys.readouterr().err
    assert main(["serve", "--reasoning-parser", "r2", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "server.reasoning_parser" in err[0] and "deepseek_r1, qwen3" in err[0]
    assert main(["serve", "--chat-template", "/no/such.jinja", "--port", "0"]) == 2
    assert "hermes_tools" in capsys.readouterr().err
    assert spawned == []


def test_a_bad_generation_config_folder_stops_the_start_before_the_engine_core(tmp_path, spawned, capsys):
    """A folder without generation_config.json, or one whose values no request could take: one line and exit 2,
    not a server whose model "failed to load" and that stays up answering 503."""
    assert main(["serve", "--generation-config", str(tmp_path / "absent"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no generation_config.json" in err[0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 5.0}))
    assert main(["serve", "--generation-config", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.generation_config: top_p" in err[0]
    assert spawned == []


def test_a_lora_module_that_is_no_adapter_stops_the_start_before_the_engine_core(tmp_path, spawned, capsys):
    """--lora-modules naming a missing path, or a folder that is not a PEFT adapter: one line and exit 2."""
    (tmp_path / "empty").mkdir()
    for path, says in ((tmp_path / "nope", "is neither a PEFT folder nor a .gguf file"),
                       (tmp_path / "empty", "no adapter_config.json")):
        assert main(["serve", "--enable-lora", "--lora-modules", f"x={path}", "--port", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert spawned == []


def test_more_sequences_than_a_steps_token_budget_is_a_config_error(spawned, capsys):
    """A step holds a token of each running sequence: max_num_batched_tokens below max_num_seqs is refused as the
    config loads (as vLLM refuses it), not by the engine core after the server is up."""
    with pytest.raises(ConfigError, match="max_num_batched_tokens 512 must be >= max_num_seqs 1024"):
        load_config(overrides={"engine.max_num_seqs": 1024})
    assert main(["serve", "--max-num-seqs", "1024", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-num-batched-tokens" in err[0], err


def test_the_serve_commands_early_checks_import_no_torch():
    """The tool and reasoning parsers' names and the chat template are checked before the engine core spawns, so
    their modules import neither torch nor transformers (seconds each)."""
    code = ("import sys, server.api.tool_parsers, server.api.reasoning, server.api.chat_templates, "
            "server.api.generation_defaults, server.models.lora_paths, server.models.gemm_tuning; "
            "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_missing_compressed_artifact_stops_the_start_with_one_line(tmp_path):
    """As a missing model file does: not a server that loads in the background and answers 503 for ever (in a
    child process with a timeout, so a regression fails rather than serves)."""
    (tmp_path / "empty").mkdir()
    for artifact in (tmp_path / "nope", tmp_path / "empty"):
        proc = subprocess.run([sys.executable, "-c", "from server.cli import main; import sys; "
                               f"sys.exit(main(['serve', '--compressed', '{artifact}', '--port', '0']))"],
                              capture_output=True, text=True, timeout=120)
        # (the engine core, spawned first, may log a line before it is stopped on a slow machine)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"compressed artifact {artifact}: not a compressed artifact" in proc.stderr.strip().splitlines()[-1]


def test_a_missing_compressed_artifact_stops_the_start_before_the_engine_core(tmp_path, spawned, capsys):
    """The manifest is read before the engine core is spawned: a typo in --compressed costs no model load."""
    assert main(["serve", "--compressed", str(tmp_path / "nope"), "--port", "0"]) == 2
    assert spawned == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a compressed artifact" in err[0]


def test_the_artifact_format_reads_a_manifest_without_torch():
    """The serve command checks --compressed before it spawns the engine core, so that check imports no torch."""
    code = "import sys, server.models.artifact; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_max_model_len_past_the_models_positions_stops_the_start(tiny_model_dir, capsys):
    """vLLM refuses a max_model_len past max_position_embeddings: checked before the engine core starts, one line."""
    assert main(["serve", str(tiny_model_dir), "--max-model-len", "5000", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine.max_model_len 5000 exceeds the model's max_position_embeddings 4096" in err[0]


@pytest.mark.parametrize("config, ok", [
    ({"max_position_embeddings": 4096}, False),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, False),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, True),  # its own reach
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, True),
    ({}, True),  # no limit stated
])
def test_check_max_model_len(config, ok):
    from server.models.source import check_max_model_len

    check_max_model_len(config, 4096)  # at the limit: fine
    if ok:
        check_max_model_len(config, 8192)
    else:
        with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 4096"):
            check_max_model_len(config, 8192)


@pytest.mark.parametrize("var", ["NEURONMM_BF16_FMA_ROWS", "NEURONMM_BF16_AMX_ROWS"])
def test_bad_gemm_thresholds_stop_the_start_with_one_line(capsys, monkeypatch, spawned, var):
    """The engine process reads the GEMM thresholds when it packs the weights; serve checks them before it spawns
    the engine core."""
    monkeypatch.setenv(var, "-1")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{var} must be a row count >= 0" in err[0]
    assert spawned == []


def test_serve_spawns_the_engine_core_before_it_imports_the_server(tiny_model_dir):
    """The core's imports and load (seconds) run while this process imports the server (seconds too): at the spawn
    neither torch, nor the app, nor another command's plugin has been imported here."""
    code = textwrap.dedent(f"""
        import sys
        from server.engine import engine_core

        def spawn(self):
            print(sorted(m for m in ("torch", "server.api.app", "compression.cli") if m in sys.modules))
            raise SystemExit(0)

        engine_core.EngineCoreClient.spawn = spawn
        from server.cli import main
        main(["serve", "{tiny_model_dir}", "--port", "0"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_ctrl_c_before_a_command_handles_it_is_one_line(capsys, monkeypatch):
    """serve imports for seconds before its server handles SIGINT: a Ctrl+C there exits 130 without a traceback."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_serve", interrupted)
    assert main(["serve", "--port", "0"]) == 130
    assert capsys.readouterr().err.strip() == "neuronmm: interrupted"


def test_vllm_flags_without_effect_here_are_accepted_and_named():
    from server.cli import build_parser, ignored_vllm_flags

    args = build_parser().parse_args(["serve", "--trust-remote-code", "--gpu-memory-utilization", "0.9",
                                      "--disable-log-requests", "--max-logprobs", "20"])
    assert ignored_vllm_flags(args) == ["--trust-remote-code", "--gpu-memory-utilization", "--max-logprobs",
                                        "--disable-log-requests"]
    assert ignored_vllm_flags(build_parser().parse_args(["serve"])) == []
    assert _serve_config(["--trust-remote-code", "--swap-space", "4"]) == _serve_config([])  # the config unchanged
    assert _serve_config(["--disable-uvicorn-access-log"]).server.access_log is False
    assert _serve_config([]).server.access_log is True


def test_a_config_error_the_engine_core_finds_ends_the_server_with_one_line(serve_children):
    """A limit only the loaded model can check (here a KV pool too small for one sequence) stops `neuronmm serve`
    with the one-line error and exit 2, as vLLM exits when its engine cannot start: not a server that stays up
    answering 503 (in a child process with a timeout, so a regression fails rather than serves)."""
    proc = serve_children("tiny kv pool")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("neuronmm serve: error: engine.kv_cache_gib:") and "cannot hold one sequence" in last, last


def test_a_queue_of_no_requests_is_a_config_error():
    """engine.max_queue 0 would answer every request 429 for good; it is refused as the config loads."""
    with pytest.raises(ConfigError, match="max_queue"):
        load_config(overrides={"engine.max_queue": 0})
    assert load_config(overrides={"engine.max_queue": 1}).engine.max_queue == 1
