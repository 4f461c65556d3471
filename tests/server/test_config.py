"""Settings from flags, environment and file, with their precedence and errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from snowflake_server import ConfigurationError, ServerSettings
from snowflake_server._config.options import OPTIONS, build_parser, default_state_dir, load_settings
from snowflake_server._config.settings import FromMachine


def test_defaults_are_the_originals() -> None:
    s = load_settings([], {"HOME": "/home/u"})
    assert s == replace(ServerSettings(), state_dir="/home/u/.local/state/snowflake")
    assert (s.host, s.port, s.metrics_port, s.transport) == ("127.0.0.1", 7609, 9990, "framed")
    assert s.idle_timeout > 3, "an idle client must not be dropped after thriftpy2's 3 s"


def test_the_default_state_dir_follows_xdg() -> None:
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/snowflake")
    assert default_state_dir({"HOME": "/home/u"}) == Path("/home/u/.local/state/snowflake")


def test_flag_beats_env_beats_file(tmp_path: Path) -> None:
    config = tmp_path / "snowflake.toml"
    config.write_text("worker-id = 3\ndatacenter_id = 4\nport = 1111\nidle_timeout = 2\n")
    env = {"SNOWFLAKE_WORKER_ID": "5", "SNOWFLAKE_PORT": "2222", "SNOWFLAKE_CONFIG": str(config)}
    s = load_settings(["--port", "3333"], env)
    assert (s.port, s.worker_id, s.datacenter_id, s.idle_timeout) == (3333, 5, 4, 2.0)


def test_every_option_has_a_flag_and_an_env_var() -> None:
    help_text = build_parser().format_help()
    for option in OPTIONS:
        assert option.flag in help_text
        assert option.env in help_text
    env = {
        "SNOWFLAKE_HOST": "0.0.0.0",
        "SNOWFLAKE_TRANSPORT": "buffered",
        "SNOWFLAKE_EPOCH": "0",
        "SNOWFLAKE_SEQUENCE_BITS": "10",
        "SNOWFLAKE_MAX_BACKWARDS_MS": "0",
        "SNOWFLAKE_LOG_LEVEL": "debug",
    }
    s = load_settings([], env)
    assert (s.host, s.transport, s.epoch, s.sequence_bits) == ("0.0.0.0", "buffered", 0, 10)
    assert (s.max_backwards_ms, s.log_level) == (0, "debug")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--worker-id", "abc"], {}, r"--worker-id: invalid value 'abc'"),
        ([], {"SNOWFLAKE_PORT": "70000"}, r"SNOWFLAKE_PORT: invalid value '70000'.*0\.\.65535"),
        (["--transport", "http"], {}, "must be one of framed, buffered"),
        (["--worker-id", "32"], {}, r"worker_id must be in 0\.\.31, got 32"),
        (["--timestamp-bits", "50"], {}, "layout needs 72 bits"),
        (["--idle-timeout", "-1"], {}, "must not be negative"),
        (["--epoch", "99999999999999"], {}, None),  # valid here; in the future at start-up
    ],
)
def test_bad_values_name_their_source(
    argv: list[str], env: dict[str, str], message: str | None
) -> None:
    if message is None:
        assert load_settings(argv, env).epoch == 99999999999999
        return
    with pytest.raises(ConfigurationError, match=message):
        load_settings(argv, env)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--port", "abc"], {}, "--port: invalid value 'abc': must be a whole number"),
        (["--port", "1_0"], {}, "--port: invalid value '1_0': must be a whole number"),
        (["--max-batch", "1e3"], {}, "--max-batch: invalid value '1e3': must be a whole number"),
        (["--epoch", "0x10"], {}, "--epoch: invalid value '0x10': must be a whole number"),
        (["--worker-id", "1_0"], {}, "must be a number, auto, ordinal, ip or mac"),
        (["--idle-timeout", "x"], {}, "--idle-timeout: invalid value 'x': must be a number"),
        (["--idle-timeout", "nan"], {}, "must be a number like 2 or 0.5"),
        (["--drain-seconds", "1_0"], {}, "must be a number like 2 or 0.5"),
        (["--epoch", "9" * 5000], {}, "must be a whole number of at most 19 digits"),
    ],
)
def test_a_bad_number_is_said_in_words_not_in_python(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as raised:
        load_settings(argv, env)
    assert "literal" not in str(raised.value) and "convert" not in str(raised.value)


def test_numbers_in_their_plain_forms_are_read() -> None:
    s = load_settings(
        ["--port", " +7610", "--idle-timeout", ".5", "--max-peer-skew", "inf"],
        {"SNOWFLAKE_DRAIN_SECONDS": "2.5e0", "SNOWFLAKE_HTTP_PORT": "-1"},
    )
    assert (s.port, s.idle_timeout, s.max_peer_skew, s.drain_seconds) == (7610, 0.5, 1e999, 2.5)


@pytest.mark.parametrize("variable", ["SNOWFLAKE_PORT", "SNOWFLAKE_METRICS_PORT"])
def test_a_kubernetes_service_link_in_a_port_variable_is_explained(variable: str) -> None:
    link = "tcp://10.0.0.1:7609"
    with pytest.raises(ConfigurationError) as raised:
        load_settings([], {variable: link})
    message = str(raised.value)
    assert message.startswith(f"{variable}: invalid value '{link}'")
    assert "Kubernetes service link" in message and "enableServiceLinks: false" in message


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--prot", "5"], "unknown argument '--prot'; did you mean --port?"),
        (["--worker-idd=3"], "unknown argument '--worker-idd=3'; did you mean --worker-id?"),
        (["--zz-top"], "unknown argument '--zz-top'\n"),
        (["7609"], "unknown argument '7609'\n"),
    ],
)
def test_a_mistyped_flag_exits_2_naming_the_one_it_resembles(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        load_settings(argv, {})
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read"):
        load_settings(["--config", str(tmp_path / "missing.toml")], {})
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \n")
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        load_settings(["--config", str(bad)], {})
    bad.write_text("prot = 1\n")
    with pytest.raises(ConfigurationError, match=r"unknown setting 'prot'; did you mean port\?"):
        load_settings(["--config", str(bad)], {})
    bad.write_text('port = "7609"\n')
    assert load_settings(["--config", str(bad)], {}).port == 7609
    bad.write_text("worker_id = true\n")
    with pytest.raises(ConfigurationError, match="worker_id: invalid value True"):
        load_settings(["--config", str(bad)], {})


def test_unrelated_env_vars_are_ignored() -> None:
    # The Snowflake data warehouse's tools use SNOWFLAKE_ACCOUNT and friends.
    env = {"SNOWFLAKE_ACCOUNT": "x", "SNOWFLAKE_USER": "y", "XDG_STATE_HOME": "/s"}
    assert load_settings([], env) == replace(ServerSettings(), state_dir="/s/snowflake")


def test_state_settings_and_switches(tmp_path: Path) -> None:
    s = load_settings(["--discard-corrupt-state", "--sequence-start", "random"], {})
    assert (s.discard_corrupt_state, s.sequence_start) == (True, "random")
    assert s.ids.sequence_start == "random"
    env = {"SNOWFLAKE_DISCARD_CORRUPT_STATE": "no", "SNOWFLAKE_STATE_DIR": "/var/lib/sf"}
    s = load_settings([], env)
    assert (s.discard_corrupt_state, s.state_dir) == (False, "/var/lib/sf")
    with pytest.raises(ConfigurationError, match="must be true or false"):
        load_settings([], {"SNOWFLAKE_DISCARD_CORRUPT_STATE": "maybe"})
    config = tmp_path / "c.toml"
    config.write_text("discard-corrupt-state = true\nmax-startup-wait = 30\n")
    s = load_settings(["--config", str(config)], {})
    assert (s.discard_corrupt_state, s.max_startup_wait) == (True, 30.0)


def test_worker_id_sources_and_the_force_switch(tmp_path: Path) -> None:
    assert load_settings(["--worker-id", "ordinal"], {}).worker_id is FromMachine.ORDINAL
    assert load_settings([], {"SNOWFLAKE_WORKER_ID": " MAC "}).worker_id is FromMachine.MAC
    config = tmp_path / "c.toml"
    config.write_text('worker-id = "ip"\nforce-node-id = true\n')
    s = load_settings(["--config", str(config)], {})
    assert (s.worker_id, s.force_node_id) == (FromMachine.IP, True)
    assert load_settings(["--force-node-id"], {}).force_node_id is True
    assert load_settings([], {"SNOWFLAKE_FORCE_NODE_ID": "yes"}).force_node_id is True
    # ordinal leaves the datacenter id to the settings, and --processes to multiply it.
    s = load_settings(["--worker-id", "ordinal", "--datacenter-id", "3", "--processes", "2"], {})
    assert (s.worker_id, s.datacenter_id, s.processes) == (FromMachine.ORDINAL, 3, 2)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--worker-id", "abc"], {},
         "--worker-id: invalid value 'abc': must be a number, auto, ordinal, ip or mac"),
        (["--worker-id", "ip", "--datacenter-id", "0"], {},
         "--worker-id ip fills --datacenter-id too (both come from the low bits of the "
         "address): leave --datacenter-id unset"),
        (["--worker-id", "mac"], {"SNOWFLAKE_DATACENTER_ID": "4"},
         "--worker-id mac fills --datacenter-id too (both come from the low bits of the "
         "address): leave --datacenter-id unset (set by SNOWFLAKE_DATACENTER_ID)"),
        ([], {"SNOWFLAKE_WORKER_ID": "ip", "SNOWFLAKE_PROCESSES": "2"},
         "--worker-id ip gives each machine one node id (datacenter and worker together): "
         "--processes must be 1, as consecutive worker ids would take the node ids of "
         "neighbouring addresses (set by SNOWFLAKE_WORKER_ID; SNOWFLAKE_PROCESSES)"),
    ],
)  # fmt: skip
def test_worker_id_sources_that_cannot_work_are_refused(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_settings(argv, env)
    assert str(refused.value) == message


def test_settings_read_from_the_machine_have_no_worker_id_until_resolved() -> None:
    with pytest.raises(ConfigurationError, match="worker_id ip fills datacenter_id too"):
        ServerSettings(worker_id=FromMachine.IP, datacenter_id=1)
    settings = ServerSettings(worker_id=FromMachine.ORDINAL, datacenter_id=1)
    for view in ("worker_number", "ids", "cluster"):
        with pytest.raises(ConfigurationError, match="worker_id ordinal is read from this machine"):
            getattr(settings, view)
    assert replace(settings, worker_id=7).ids.worker_id == 7


def test_the_first_start_wait_is_derived_unless_given(tmp_path: Path) -> None:
    assert ServerSettings().worker.first_start_wait == 5.0, "standalone: Twitter's 5 s"
    clustered = ServerSettings(zookeeper="zk:2181", zk_session_timeout=4, max_peer_skew=7)
    assert clustered.worker.first_start_wait == clustered.cluster.first_start_wait == 11.0
    unbounded = replace(clustered, max_peer_skew=float("inf"))
    assert unbounded.first_start_window == 14.0, "10 s where the skew has no bound"
    assert replace(clustered, first_start_wait=0.0).cluster.first_start_wait == 0.0
    config = tmp_path / "snowflake.toml"
    config.write_text("first-start-wait = 3\n")
    assert load_settings(["--config", str(config)], {}).first_start_window == 3.0
    config.write_text("first-start-wait = true\n")
    with pytest.raises(ConfigurationError, match="must be a number"):
        load_settings(["--config", str(config)], {})
    with pytest.raises(ConfigurationError, match="first_start_wait"):
        ServerSettings(first_start_wait=-1.0)
    help_text = " ".join(build_parser().format_help().split())
    assert "0: no wait. (env SNOWFLAKE_FIRST_START_WAIT)" in help_text, "no default shown"


def test_native_threads_share_the_cpus_unless_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(6)))
    assert ServerSettings().serving.native_threads == 6, "auto: every CPU this process may use"
    assert ServerSettings(processes=4).serving.native_threads == 1, "6 // 4, shared by processes"
    assert ServerSettings(processes=8).serving.native_threads == 1, "at least one each"
    assert load_settings(["--native-threads", "0"], {}).serving.native_threads == 0
    assert load_settings([], {"SNOWFLAKE_NATIVE_THREADS": "auto"}).native_threads is None
    config = tmp_path / "snowflake.toml"
    config.write_text("native-threads = 3\n")
    assert load_settings(["--config", str(config)], {}).serving.native_threads == 3
    assert ServerSettings(native_threads=2).worker.native_state, "native threads: a native state"
    for no_native in (
        ServerSettings(native_threads=0),
        ServerSettings(native_threads=2, transport="buffered"),
        ServerSettings(native_threads=2, tls_cert="server.pem"),
    ):
        assert not no_native.serving.native and not no_native.worker.native_state
    with pytest.raises(ConfigurationError, match="native_threads"):
        ServerSettings(native_threads=65)
    with pytest.raises(ConfigurationError, match="native_threads"):
        ServerSettings(native_threads=-1)
    with pytest.raises(ConfigurationError, match="whole number"):
        load_settings(["--native-threads", "many"], {})


def test_the_probes_settings_and_their_narrow_view(tmp_path: Path) -> None:
    defaults = ServerSettings().probes
    assert (defaults.max_lag_s, defaults.max_stall_s, defaults.window_s) == (0.25, 30.0, 5.0)
    config = tmp_path / "snowflake.toml"
    config.write_text("ready-max-lag = 0.5\nlive_max_stall = 60\n")
    s = load_settings(["--ready-max-lag", "1"], {"SNOWFLAKE_CONFIG": str(config)})
    assert (s.probes.max_lag_s, s.probes.max_stall_s) == (1.0, 60.0)
    s = load_settings([], {"SNOWFLAKE_LIVE_MAX_STALL": "10", "SNOWFLAKE_READY_MAX_LAG": ".1"})
    assert (s.probes.max_lag_s, s.probes.max_stall_s) == (0.1, 10.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Cheap restarts: a client holding the loop for a few seconds must not get them.
        (["--live-max-stall", "9.5"], r"--live-max-stall: invalid value '9\.5': "
         r"live_max_stall must be at least 10 s, got 9\.5: a shorter one would let a client"),
        (["--live-max-stall", "inf"], "live_max_stall must be a finite number of seconds"),
        (["--ready-max-lag", "0"], "--ready-max-lag: invalid value '0': .*must be positive"),
        (["--ready-max-lag", "inf"], "ready_max_lag must be a finite number of seconds"),
        (["--ready-max-lag", "12", "--live-max-stall", "12"],
         r"--ready-max-lag \(12 s\) must be below --live-max-stall \(12 s\): a node whose "
         "loop stalls must leave the rotation before it is restarted"),
    ],
)  # fmt: skip
def test_probes_that_would_restart_nodes_cheaply_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        load_settings(argv, {})
