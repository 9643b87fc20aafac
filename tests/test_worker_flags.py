"""The worker's flags are named twice, once in C++ (native/src/main.cpp, hand-written: it only
parses arguments) and once in ``WorkerConfig`` (every worker command line is derived from it):
these tests make the two the same set, in what the binary documents and in what it accepts."""

from __future__ import annotations

import re
import subprocess

import pytest

from agent.io.settings import flag_names, settings_fields
from agent.io.worker.config import WorkerConfig
from agent.io.worker.process import find_worker_binary

pytestmark = [pytest.mark.worker, pytest.mark.timeout(60)]

#: flags of the binary that are no setting: they print and exit
INFORMATIONAL = {"--help", "--version"}
#: a value each flag's parser takes (the rest of the command line is still incomplete)
SAMPLES = {
    "--layers": "0:1",
    "--data-listen": "127.0.0.1:0",
    "--model-sha256": "ab" * 32,
    "--top-k-in-graph": "off",
    "--data-max-connections": "2",
}


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(find_worker_binary()), *argv], capture_output=True, text=True, timeout=30, check=False)


def test_the_worker_config_names_exactly_the_flags_the_binary_documents() -> None:
    usage = _run("--help")
    assert usage.returncode == 0, usage.stderr
    documented = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", usage.stdout)) - INFORMATIONAL
    assert set(flag_names(WorkerConfig)) == documented
    # and the probe below tells a flag the binary lacks
    assert "unknown argument '--no-such-flag'" in _run("--no-such-flag").stderr


@pytest.mark.parametrize("flag", flag_names(WorkerConfig))
def test_the_binary_accepts_every_flag_of_the_worker_config(flag: str) -> None:
    fields = zip(flag_names(WorkerConfig), settings_fields(WorkerConfig))
    switches = {name for name, (_, _, hint) in fields if hint is bool}
    argv = [flag] if flag in switches else [flag, SAMPLES.get(flag, "1")]
    if flag != "--model":
        argv += ["--model", "/nonexistent.gguf"]
    # without --socket the binary stops at its first missing-argument check, after parsing
    # every flag: an unknown one would have stopped it earlier, naming it
    done = _run(*argv)
    assert done.returncode == 2
    assert "unknown argument" not in done.stderr and "must be" not in done.stderr, done.stderr
    assert "is required" in done.stderr, done.stderr
