"""Config as data (``agent.io.settings``): each role's config class is the one place a tunable
is named, and its flags, its TOML file and the command lines the harness and the node spell are
derived from it, so these round trips must hold for every field, present and future."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.cli import build_parser
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client.config import SwarmClientConfig
from agent.io.node import cli as node_cli
from agent.io.node.config import NodeConfig, worker_config
from agent.io.relay.config import RelayConfig
from agent.io.relay.server import serve_main
from agent.io.settings import SettingsError, flag_names, load_toml, settings_fields, settings_from_args, to_argv
from agent.io.tracker.config import TrackerConfig
from agent.io.worker.config import WorkerConfig
from agent.io.worker.process import worker_argv

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KEY = Ed25519PrivateKey.generate()

#: values for settings whose flag parser takes only a format (any other string is refused)
FORMATTED = {
    "layers": "3:7",
    "listen": "127.0.0.1:9",  # the relay's HOST:PORT (the node's listen takes any text)
    "data_listen": "127.0.0.1:0",
    "worker_wait": "sleep",
    "canary_worker_wait": "spin",
    "register_model": (f"{__file__}:a", __file__),  # files that exist
    "hf_repo": ("a=org/name",),
    "model_source": ("a=https://example.org/m.gguf",),
    "serve_models": "127.0.0.1:8080",
    "heartbeat_timeout_ms": 4000,  # must exceed the interval
    "admission_rate_exempt": ("198.18.0.0/15", "10.0.0.0/8"),  # networks
}


def _not_default(cls: type, name: str, hint: Any, default: Any) -> Any:
    """A value of the setting's type that is not its default (and that its flag accepts)."""
    if name in FORMATTED and not (cls is NodeConfig and name == "listen"):
        return FORMATTED[name]
    if typing.get_origin(hint) is tuple:
        return (f"{name}-a", f"{name}-b")
    inner = next(a for a in getattr(hint, "__args__", (hint,)) if a is not type(None))
    if inner is bool:
        return not default
    if inner is int:
        return 3 if default != 3 else 4
    if inner is float:
        return 0.5 if default != 0.5 else 0.25
    if inner is Path:
        return Path(f"/tmp/{name}")
    if inner is str:
        return f"x-{name}"
    raise AssertionError(f"{cls.__name__}.{name}: no sample for {hint!r}")


def _every_setting_changed(cls: type, **required: Any) -> dict[str, Any]:
    values = {}
    for field, meta, hint in settings_fields(cls):
        default = None if field.default is dataclasses.MISSING else field.default
        choices = [c for c in meta.choices or () if c != default]
        values[field.name] = choices[-1] if choices else _not_default(cls, field.name, hint, default)
    return {**values, **required}


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("cls", "command", "extra"),
    [
        (NodeConfig, ["node"], {"key": KEY}),
        (RelayConfig, ["relay", "serve"], {}),
        (WorkerConfig, ["worker"], {}),
        (TrackerConfig, ["tracker", "serve"], {}),
    ],
    ids=["node-config", "relay-config", "worker-config", "tracker-config"],
)
def test_config_to_argv_and_back_is_the_same_config(cls: type, command: list[str], extra: dict[str, Any]) -> None:
    changed = cls(**_every_setting_changed(cls), **extra)
    argv = to_argv(changed)
    parsed = cls(**settings_from_args(cls, _parse([*command, *argv])), **extra)
    assert parsed == changed, argv
    # and the defaults need no flag but the required ones
    required = {
        f.name: getattr(changed, f.name)
        for f, m, _ in settings_fields(cls)
        if m.required or f.default is dataclasses.MISSING
    }
    plain = cls(**required, **extra)
    assert cls(**settings_from_args(cls, _parse([*command, *to_argv(plain)])), **extra) == plain


def test_every_setting_is_a_flag_of_its_command() -> None:
    for cls, command in ((NodeConfig, "node"), (WorkerConfig, "worker")):
        sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        offered = {s for a in sub._actions for s in a.option_strings}
        assert set(flag_names(cls)) <= offered


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_a_flag_given_beats_the_file_and_the_file_beats_the_default(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        'tracker = "/ip4/1.2.3.4/tcp/1/p2p/Qm"\nmodel_files = ["a.gguf", "b.gguf"]\nthreads = 2\n'
        "memory_bytes = 5000\nsession_idle_timeout_s = 9\nrelay = true\nchannel = false\n",
    )
    file_values = load_toml(path, NodeConfig)
    assert file_values["session_idle_timeout_s"] == 9.0 and isinstance(file_values["session_idle_timeout_s"], float)
    # --session-idle-timeout-s with the default's own value still beats the file
    args = _parse(["node", "--config", str(path), "--threads", "3", "--session-idle-timeout-s", "5"])
    settings = settings_from_args(NodeConfig, args, file_values)
    assert settings["threads"] == 3  # the command line
    assert settings["session_idle_timeout_s"] == 5.0  # the command line, though it is the default
    assert settings["memory_bytes"] == 5000 and settings["relay"] is True and settings["channel"] is False  # file
    assert settings["model_files"] == ("a.gguf", "b.gguf")
    assert settings["owner_max_share"] == 0.75 and settings["listen"] == "/ip4/127.0.0.1/tcp/0"  # defaults
    # repeated flags replace the file's list, they do not add to it
    args = _parse(["node", "--model", "c.gguf"])
    assert settings_from_args(NodeConfig, args, file_values)["model_files"] == ("c.gguf",)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("thread = 2\n", "unknown key 'thread'"),
        ('threads = "2"\n', "threads: expected an integer, got '2'"),
        ("threads = 0\n", "threads: must be >= 1, got 0"),
        ("threads = 2.5\n", "threads: expected an integer, got 2.5"),
        ("relay = 1\n", "relay: expected true or false, got 1"),
        ('model_files = "a.gguf"\n', "model_files: expected a list of strings"),
        ('worker_wait = "nap"\n', "worker_wait: expected one of auto, spin, sleep, got 'nap'"),
        ("owner_max_share = 1.5\n", "owner_max_share: must be in (0, 1]"),
        ("key = 1\n", "unknown key 'key'"),  # a loaded key is no setting: the file names key_file
        ("threads = \n", "not TOML"),
    ],
)
def test_a_bad_file_names_the_file_and_the_key(tmp_path: Path, text: str, error: str) -> None:
    path = _toml(tmp_path, text)
    with pytest.raises(SettingsError) as caught:
        load_toml(path, NodeConfig)
    assert str(caught.value).startswith(f"{path}: ") and error in str(caught.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"nothing\.toml: No such file"):
        load_toml(tmp_path / "nothing.toml", RelayConfig)


def test_relay_file_values_take_their_fields_types(tmp_path: Path) -> None:
    path = tmp_path / "relay.toml"
    path.write_text('tracker = "/ip4/1.2.3.4/tcp/1/p2p/Qm"\ndb = "relay.db"\nlisten = "0.0.0.0:8080"\n')
    args = _parse(["relay", "serve", "--config", str(path)])
    config = RelayConfig(**settings_from_args(RelayConfig, args, load_toml(path, RelayConfig)))
    assert config.db == Path("relay.db") and (config.listen_host, config.listen_port) == ("0.0.0.0", 8080)
    path.write_text('listen = "8080"\n')
    with pytest.raises(SettingsError, match="listen: expected HOST:PORT"):
        load_toml(path, RelayConfig)


async def test_baton_node_refuses_a_bad_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _toml(tmp_path, "heartbeat_interval_s = 1\n")
    assert await node_cli.run(_parse(["node", "--config", str(path)])) == node_cli.EXIT_SETUP
    assert f"baton node: --config {path}: unknown key 'heartbeat_interval_s'" in capsys.readouterr().err


async def test_baton_node_reads_tracker_and_key_from_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # no --listen, no --relay in the file: the node's own check speaks, so the file was read
    path = _toml(tmp_path, f'tracker = "/ip4/1.2.3.4/tcp/1/p2p/Qm"\nkey_file = "{tmp_path / "k"}"\nlisten = "none"\n')
    argv = ["node", "--config", str(path), "--model", "a.gguf"]
    assert await node_cli.run(_parse(argv)) == node_cli.EXIT_SETUP
    assert "--listen none needs --relay" in capsys.readouterr().err


def test_baton_relay_serve_refuses_a_bad_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "relay.toml"
    path.write_text("body_timeout_s = -1\n")
    assert serve_main(_parse(["relay", "serve", "--config", str(path)])) == 2
    assert f"baton relay serve: {path}: body_timeout_s: must be a finite number > 0" in capsys.readouterr().err
    assert serve_main(_parse(["relay", "serve", "--db", str(tmp_path / "r.db")])) == 2
    assert "--tracker and --db are required" in capsys.readouterr().err


def test_the_harness_command_lines_parse_back_to_their_configs(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # the tracker's flag checks that it is a file
    swarm = LocalSwarm(LocalSwarmConfig(model_path=tmp_path / "m.gguf", threads=2), tmp_path)
    swarm.tracker_addr = "/ip4/127.0.0.1/tcp/1/p2p/Qm"
    argv = swarm.node_argv("n0", 12345, listen="none", relay=True)
    assert argv[argv.index("node") + 1 :][:2] == ["--tracker", swarm.tracker_addr]
    settings = settings_from_args(NodeConfig, _parse(argv[argv.index("node") :]))
    expected = NodeConfig(
        tracker=swarm.tracker_addr, key=KEY, key_file=str(swarm.key_path("n0")), model_files=(str(tmp_path / "m.gguf"),),
        memory_bytes=12345, threads=2, worker_wait="sleep", listen="none", relay=True,
    )  # fmt: skip
    assert NodeConfig(**settings, key=KEY) == expected
    relay = swarm.relay_argv()
    assert RelayConfig(**settings_from_args(RelayConfig, _parse(relay[relay.index("relay") :]))) == swarm.relay_config()
    tracker = swarm.tracker_argv()
    settings = settings_from_args(TrackerConfig, _parse(tracker[tracker.index("tracker") :]))
    assert TrackerConfig(**settings) == swarm.tracker_config()
    assert swarm.tracker_config().canary_interval_s == 0.0 and "--canary-interval-s" in tracker


def test_a_node_passes_its_worker_settings_by_name() -> None:
    config = NodeConfig(
        tracker="t", key=KEY, threads=2, threads_decode=1, ctx_size=256, max_sequences=8, batch_size=64, gpu_layers=0
    )
    worker = worker_config(config)
    assert (worker.threads, worker.threads_decode, worker.ctx_size, worker.max_sequences, worker.batch_size) == (
        2, 1, 256, 8, 64,
    )  # fmt: skip
    argv = worker_argv("bin", "m.gguf", 0, 10, "s", config=worker, model_sha256="ab" * 32)
    assert argv == [
        "bin", "--model", "m.gguf", "--layers", "0:10", "--socket", "s", "--ctx-size", "256", "--max-sequences", "8",
        "--batch-size", "64", "--threads", "2", "--threads-decode", "1", "--gpu-layers", "0", "--model-sha256", "ab" * 32,
    ]  # fmt: skip
    # the node's --gpu-layers (a NodeConfig field named as the worker's) reaches its workers
    args = _parse(["node", "--gpu-layers", "12"])
    assert worker_config(NodeConfig(**settings_from_args(NodeConfig, args), key=KEY)).gpu_layers == 12
    assert "--gpu-layers" not in worker_argv(
        "bin", "m.gguf", 0, 10, "s", config=worker_config(NodeConfig(tracker="t", key=KEY))
    )
    # every field the node shares with the worker has the worker's type
    node_types = {f.name: f.type for f in dataclasses.fields(NodeConfig)}
    shared = [f for f in dataclasses.fields(WorkerConfig) if f.name in node_types]
    assert shared and all(node_types[f.name] == f.type for f in shared)


def test_a_setting_refuses_a_mutable_default() -> None:
    from agent.io.settings import setting

    with pytest.raises(TypeError, match="mutable"):
        setting([], "a list")


def test_the_example_files_in_the_operations_guide_are_valid(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "OPERATIONS.md").read_text()
    examples = re.findall(r"```toml\n# (\w+)\.toml:.*?\n(.*?)```", text, re.S)
    assert [name for name, _ in examples] == ["relay", "node"]
    for name, body in examples:
        path = tmp_path / f"{name}.toml"
        path.write_text(body)
        assert load_toml(path, RelayConfig if name == "relay" else NodeConfig)


def test_the_owners_config_round_trips_through_baton_generate() -> None:
    def parse(argv: list[str]) -> SwarmClientConfig:
        args = _parse(["generate", "--tracker", "t", "--model", "m", *argv, "a prompt"])
        return SwarmClientConfig(**settings_from_args(SwarmClientConfig, args))

    changed = SwarmClientConfig(**_every_setting_changed(SwarmClientConfig))
    assert parse(to_argv(changed)) == changed
    # baton generate spot-checks 1% and speculates by default, a library user (tests, the relay) opts in
    assert parse([]) == SwarmClientConfig(spot_check_rate=0.01, speculate_tokens=8)
    assert SwarmClientConfig().spot_check_rate == 0.0 and SwarmClientConfig().speculate_tokens == 0
    assert to_argv(SwarmClientConfig()) == ["--speculate-tokens", "0", "--spot-check-rate", "0.0"]


def test_a_relay_passes_its_client_settings_by_name() -> None:
    from agent.io.settings import shared_fields

    relay = RelayConfig(tracker="t", db=Path("d"), step_timeout_s=7.0, spot_check_rate=0.5)
    assert SwarmClientConfig(**shared_fields(relay, SwarmClientConfig)) == SwarmClientConfig(
        step_timeout_s=7.0, spot_check_rate=0.5
    )
    relay_types = {f.name: f.type for f in dataclasses.fields(RelayConfig)}
    shared = [f for f in dataclasses.fields(SwarmClientConfig) if f.name in relay_types]
    assert len(shared) == 10 and all(relay_types[f.name] == f.type for f in shared)
    assert {"wire", "link_mbit", "prefill_chunk_tokens", "prefix_block_tokens", "invite", "speculate_tokens"} <= {
        f.name for f in shared
    }


def test_the_node_service_command_line_is_rendered_from_node_config() -> None:
    from agent.io.node.service import node_argv

    installed = {"tracker": "/ip4/1.2.3.4/tcp/1/p2p/Qm", "key": "/k", "models_dir": "/m", "memory_bytes": 10**9}
    argv = node_argv({**installed, "listen": None, "relay": True})
    settings = settings_from_args(NodeConfig, _parse(argv[argv.index("node") :]))
    assert NodeConfig(**settings) == NodeConfig(
        tracker=installed["tracker"], key_file="/k", models_dir="/m", memory_bytes=10**9, relay=True
    )
