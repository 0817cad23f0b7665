"""`neuronmm compress`: bad input is one line on stderr and exit 2, with nothing written."""

import pytest

from server.cli import main


@pytest.mark.parametrize("value, needle", [("1.5", "must be <= 1"), ("nan", "finite number")])
def test_bad_keep_ratio_is_one_line_exit_2(tmp_path, capsys, value, needle):
    out = tmp_path / "art"
    assert main(["compress", "--keep-ratio", value, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep-ratio" in err[0] and needle in err[0]
    assert not out.exists()


def test_missing_calibration_data_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compress", "--calib-data", str(tmp_path / "nope.jsonl"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calib_data" in err[0] and "nope.jsonl" in err[0]
    assert not out.exists()


def test_a_relative_data_path_is_read_from_the_current_folder_first(tmp_path, monkeypatch):
    """A flag's relative path means the shell's folder (it once meant the checkout's alone); a config file's
    `../shared/data/...` still means the shared data."""
    from server.config import data_path

    (tmp_path / "mine.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path)
    assert data_path("mine.jsonl", "calib_data") == tmp_path / "mine.jsonl"
    assert data_path("pyproject.toml", "x").name == "pyproject.toml"  # (not here: the checkout's)
    with pytest.raises(Exception, match=f"calib_data not found: {tmp_path}/nope.jsonl or "):
        data_path("nope.jsonl", "calib_data")


def _compress_args(argv):
    import argparse

    from compression.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["compress", "--out", "x", *argv])


def test_allocation_comes_from_the_config_unless_a_flag_overrides_it():
    from compression.cli import settings_from
    from server.config import load_config

    cfg = load_config()
    cfg.compression.allocation, cfg.compression.latency_model = "sensitivity", "trn1"
    s = settings_from(_compress_args([]), cfg)
    assert (s.allocation, s.latency_model) == ("sensitivity", "trn1")
    s = settings_from(_compress_args(["--allocation", "uniform", "--latency-model", "none"]), cfg)
    assert (s.allocation, s.latency_model) == ("uniform", "none")


def test_sensitivity_allocation_without_refit_is_the_default_and_flags_choose_others():
    from compression.cli import settings_from
    from server.config import load_config

    s = settings_from(_compress_args([]), load_config())
    assert (s.allocation, s.refit, s.rank_multiple, s.keep_ratio) == ("sensitivity", False, 128, 0.8)
    s = settings_from(_compress_args(["--allocation", "exact", "--refit"]), load_config())
    assert (s.allocation, s.refit) == ("exact", True)


def test_exact_allocation_with_normalised_measure_is_one_line_exit_2(tmp_path, capsys, tiny_model_dir):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    out = tmp_path / "art"
    assert main(["compress", "--config", str(cfg), "--allocation", "exact", "--sensitivity", "normalised",
                 "--calib-samples", "2",
                 "--calib-seqlen", "32", "--num-threads", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allocation exact" in err[-1] and not out.exists()


def test_unknown_allocation_in_the_config_is_rejected(tmp_path):
    import pytest

    from server.config import load_config
    from server.errors import ConfigError

    bad = tmp_path / "c.yaml"
    bad.write_text("compression:\n  allocation: greedy\n")
    with pytest.raises(ConfigError, match="allocation"):
        load_config(bad)


def test_compress_with_recover_lora_writes_a_recovered_artifact(tmp_path, tiny_model_dir):
    import json

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    out = tmp_path / "art"
    assert main(["compress", "--config", str(cfg), "--keep-ratio", "0.5", "--rank-multiple", "8", "--allocation",
                 "uniform", "--calib-samples", "2", "--calib-seqlen", "32", "--recover", "lora", "--recover-steps", "2",
                 "--num-threads", "1", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recovery"]["steps"] == 2 and manifest["recovery"]["method"] == "lora-on-factors"
    assert manifest["allocation"]["method"] == "uniform" and not (out / "recovery-checkpoint.pt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # (the staged artifact is gone)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (out, *out.iterdir())}
    assert all(mode & 0o044 == 0o044 for mode in modes.values()), modes  # readable by others under umask 022


def test_an_out_path_that_holds_other_files_is_never_replaced(tmp_path, capsys):
    """--out replaces an earlier artifact (its swap is atomic), never a user's folder or file: it once renamed either
    aside and deleted it. Refused before any work, as are paths that could not be written and a sensitivity cache
    that is some other file."""
    folder, file, notes = tmp_path / "docs", tmp_path / "notes.txt", tmp_path / "cache.json"
    (folder / "sub").mkdir(parents=True)
    (folder / "keep.txt").write_text("precious")
    file.write_text("precious")
    notes.write_text("my notes")
    for argv, needle in [(["--out", str(folder)], "holds other files"), (["--out", str(file)], "is a file"),
                         (["--out", str(file / "x")], "is a file, not a folder"),
                         (["--out", str(tmp_path / "new"), "--sensitivity-cache", str(notes)],
                          "is not a sensitivity cache"),
                         (["--out", str(tmp_path / "new"), "--sensitivity-cache", str(folder)], "is a folder")]:
        assert main(["compress", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (argv, err)
    assert (folder / "keep.txt").read_text() == "precious" and (folder / "sub").is_dir()
    assert file.read_text() == "precious" and notes.read_text() == "my notes"
    assert not (tmp_path / "new").exists()


def test_compress_with_recover_publishes_only_the_recovered_artifact(tmp_path, tiny_model_dir, monkeypatch):
    """An interrupted recovery leaves --out as it was (here absent) and no staged artifact beside it: the compressed
    artifact it started from once sat at --out, looking finished."""
    import compression.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(compression.cli, "recover_artifact", interrupted)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    out = tmp_path / "outs" / "art"
    assert main(["compress", "--config", str(cfg), "--keep-ratio", "0.5", "--rank-multiple", "8", "--allocation",
                 "uniform", "--calib-samples", "2", "--calib-seqlen", "32", "--recover", "lora", "--recover-steps", "2",
                 "--num-threads", "1", "--out", str(out)]) == 130
    assert list((tmp_path / "outs").iterdir()) == []


@pytest.mark.parametrize("argv, needle", [
    (["--recover-steps", "-1"], "--recover-steps needs --recover"),
    (["--num-threads", "0"], "--num-threads: expected a positive integer, got 0"),
    (["--rank-multiple", "100000"], "--rank-multiple 100000: no rank of that multiple saves parameters"),
])
def test_flags_that_would_be_ignored_or_do_nothing_are_refused_first(argv, needle, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compress", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and not out.exists()


def test_bad_recover_steps_fail_before_compressing(tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compress", "--recover", "lora", "--recover-steps", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "steps" in err[0] and not out.exists()


def test_compress_with_recover_distill_trains_the_factors(tmp_path, tiny_model_dir):
    import json

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    out = tmp_path / "art"
    assert main(["compress", "--config", str(cfg), "--keep-ratio", "0.5", "--rank-multiple", "8", "--allocation",
                 "uniform", "--calib-samples", "2", "--calib-seqlen", "32", "--recover", "distill", "--recover-train",
                 "factors", "--recover-steps", "2", "--recover-lr", "5e-4", "--num-threads", "1", "--out", str(out)]) == 0
    recovery = json.loads((out / "manifest.json").read_text())["recovery"]
    assert (recovery["method"], recovery["objective"], recovery["train"]) == ("distill-kl/full-factors", "distill",
                                                                              "factors")
    assert recovery["steps"] == 2 and recovery["lr"] == 5e-4


@pytest.mark.parametrize("argv, needle", [
    (["--recover-train", "factors"], "--recover-train needs --recover distill"),
    (["--recover", "lora", "--recover-train", "factors"], "--recover-train factors needs --recover distill"),
    (["--recover", "distill", "--recover-steps", "0"], "--recover distill: steps must be >= 1"),
    (["--recover-lr", "5e-4"], "--recover-lr needs --recover"),
    (["--recover-windows", "100"], "--recover-windows needs --recover"),
    (["--recover-hidden-loss", "2"], "--recover-hidden-loss needs --recover distill"),
    (["--recover-ce-weight", "0.5"], "--recover-ce-weight needs --recover distill"),
    (["--recover", "lora", "--recover-hidden-loss", "2"], "hidden_loss needs objective distill"),
    (["--recover", "distill", "--recover-lr", "-1"], "--recover distill: lr must be a positive number"),
])
def test_bad_recover_flags_fail_before_compressing(argv, needle, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compress", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and not out.exists()


def test_sigterm_during_recovery_leaves_no_staged_artifact(tmp_path, tiny_model_dir):
    """SIGTERM (a job's stop, `timeout`) ends an offline command with one line and exit code 143 after its cleanup:
    its default action had ended the process at once and left the 140 MB staged artifact behind."""
    import subprocess
    import sys

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    out = tmp_path / "outs" / "art"
    argv = ["compress", "--config", str(cfg), "--keep-ratio", "0.5", "--rank-multiple", "8", "--allocation", "uniform",
            "--calib-samples", "2", "--calib-seqlen", "32", "--recover", "lora", "--num-threads", "1", "--out", str(out)]
    # the recovery is where the signal lands: the process sends it to itself, then works on as a recovery would
    script = ("import os, signal, sys, time\nimport compression.cli\n"
              "def recovering(*args, **kwargs):\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(60)\n"
              "compression.cli.recover_artifact = recovering\n"
              f"from server.cli import main\nsys.exit(main({argv!r}))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 143, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == "neuronmm: terminated"
    assert list((tmp_path / "outs").iterdir()) == []  # neither --out nor the staged artifact beside it
