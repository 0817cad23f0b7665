"""`neuronmm bench NAME`: it offers the benchmark scripts only, and refuses any other name with a one-line error."""

from __future__ import annotations

import argparse

import pytest

from bench import cli
from server.errors import ConfigError


def test_only_scripts_with_a_main_are_offered():
    names = cli._available()
    assert {"serve", "engine_step", "peak_rate", "read_bandwidth"} <= set(names)
    assert not {"harness", "model_costs", "cli"} & set(names)  # parts of the benchmarks, not benchmarks


@pytest.mark.parametrize("name", ["harness", "no_such_bench"])
def test_another_name_is_a_config_error_that_lists_the_scripts(name):
    with pytest.raises(ConfigError, match="available: .*serve"):
        cli._run(argparse.Namespace(name=name, args=[]))
