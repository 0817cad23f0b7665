"""`neuronmm compress`: bad input is one line on stderr and exit 2, with nothing written."""

from server.cli import main


def test_bad_keep_ratio_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compress", "--keep-ratio", "1.5", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep-ratio" in err[0]
    assert not out.exists()


def test_missing_calibration_data_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["compress", "--calib-data", str(tmp_path / "nope.jsonl"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calib_data" in err[0] and "nope.jsonl" in err[0]
    assert not out.exists()
