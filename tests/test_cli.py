"""The ``skyrl-sdk`` command, run the way users run it (a subprocess) and in-process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types as pytypes
from pathlib import Path

import pytest

from _limits import HANG_S
from skyrl_sdk import builtin_plugins as plugins
from skyrl_sdk.cli import commands as cli
from skyrl_sdk.cli import losses as cli_losses
from skyrl_sdk.losses.base import LossSpec
from skyrl_sdk.losses.dialects import convert_tinker
from skyrl_sdk.plugins.registry import DialectSpec


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "skyrl_sdk.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=HANG_S)


def has_reinforce() -> bool:
    try:
        import skyrl_sdk_reinforce  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True)
def _fresh(fresh_plugins):
    """An empty plugin cache before and after each test."""


# ---- as a subprocess -----------------------------------------------------------------------


def test_plugins_json_lists_builtins_and_reinforce():
    proc = run_cli("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    by_name = {r["name"]: r for r in rows}
    for name in plugins.builtin_plugin_names():
        assert by_name[name]["builtin"] is True and by_name[name]["package"] == "skyrl-sdk"
        assert by_name[name]["error"] is None
    assert "loss:cross_entropy" in by_name["skyrl_sdk.losses.sft"]["registered"]
    assert set(rows[0]) == {"name", "package", "version", "builtin", "registered", "error"}
    if has_reinforce():
        r = by_name["reinforce"]
        assert (r["package"], r["builtin"], r["registered"], r["error"]) == (
            "skyrl-sdk-reinforce", False, ["loss:reinforce"], None)


def test_losses_json_lists_inputs_config_and_dialect_names():
    proc = run_cli("losses", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    ce = rows["cross_entropy"]
    assert ce["role"] == "policy" and ce["plugin"] == "skyrl_sdk.losses.sft"
    assert ce["required_inputs"] == ["target_tokens"] and ce["optional_inputs"] == ["weights"]
    assert ce["dialect_names"] == {"native": ["cross_entropy"], "tinker": ["cross_entropy"]}
    assert ce["config"] == {} and ce["description"]
    if has_reinforce():
        rf = rows["reinforce"]
        assert rf["plugin"] == "reinforce"
        assert rf["required_inputs"] == ["target_tokens", "advantages"]
        assert rf["dialect_names"] == {"native": ["reinforce"], "tinker": ["reinforce"]}


def test_human_output_is_an_aligned_table_and_env_restricts():
    proc = run_cli("plugins", env={"SKYRL_SDK_PLUGINS": ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "PACKAGE", "VERSION", "BUILTIN", "REGISTERED"]
    column = lines[0].index("PACKAGE")
    assert all(line[column - 2:column] == "  " and line[column] != " " for line in lines[1:])
    assert "reinforce" not in [line.split()[0] for line in lines] and len(lines) == 1 + len(plugins.builtin_plugin_names())


# ---- in-process ------------------------------------------------------------------------------


def test_losses_dialect_filter(capsys):
    assert cli.main(["losses", "--json", "--dialect", "tinker"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(set(r["dialect_names"]) == {"tinker"} for r in rows)


def test_unknown_dialect_is_a_usage_error(capsys):
    assert cli.main(["losses", "--dialect", "klingon"]) == 2
    err = capsys.readouterr().err
    assert "unknown dialect 'klingon'" in err and "tinker" in err


def test_losses_human_output_shows_config_defaults(capsys, monkeypatch):
    import attrs

    @attrs.frozen
    class Cfg:
        beta: float = 0.25
        tags: tuple = attrs.field(factory=tuple)

    spec = LossSpec(name="fake", fn=lambda b, c: None, description="a fake loss",
                    required_inputs=("target_tokens", "advantages"), optional_inputs=("weights",), config_cls=Cfg)
    assert cli_losses.config_defaults(spec) == {"beta": 0.25, "tags": ()}
    monkeypatch.setitem(plugins.get_registry().losses, "fake", spec)
    assert cli.main(["losses", "--wide"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fake "))
    assert "beta=0.25, tags=()" in line and "target_tokens, advantages [weights]" in line
    assert "native: fake; tinker: fake" in line
    assert cli.main(["losses"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("fake (policy)\n"):].split("\n\n")[0].splitlines()
    assert block == ["fake (policy)", "  called as: native: fake; tinker: fake", "  inputs: target_tokens, advantages",
                     "  optional: weights", "  config: beta=0.25, tags=()", "  a fake loss"]


def _spec(name: str, role: str = "policy") -> LossSpec:
    return LossSpec(name=name, fn=lambda b, c: None, description="", required_inputs=(), role=role)


@pytest.mark.parametrize(
    "name, role, expected",
    [
        ("regular", "policy", ["ppo", "regular"]),
        ("cispo", "policy", ["cispo"]),
        ("value", "critic", ["ppo", "value"]),
        ("regular", "critic", ["regular"]),
        ("reinforce", "policy", ["reinforce"]),
    ],
)
def test_dialect_names_come_from_the_dialects_own_table(name, role, expected):
    tinker = DialectSpec("tinker", convert_tinker)
    assert cli_losses.dialect_names(tinker, _spec(name, role)) == expected


def test_a_dialect_that_shadows_a_name_hides_it():
    def convert(loss_fn, cfg, role):
        return ("other", {}) if loss_fn == "mine" else None

    convert.names = ("mine",)
    assert cli_losses.dialect_names(DialectSpec("d", convert), _spec("mine")) == []
    assert cli_losses.dialect_names(DialectSpec("d", convert), _spec("other")) == ["mine", "other"]


def test_version(capsys):
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"skyrl-sdk {cli.__version__}"
    assert cli.main(["version", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["skyrl_sdk"] == cli.__version__ and doc["pluggy"]


def _fake_module(monkeypatch, name: str, func: str) -> list:
    calls: list = []
    module = pytypes.ModuleType(name)
    setattr(module, func, lambda args: calls.append(args) or 0)
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_serve_arguments_and_lazy_import(monkeypatch):
    from skyrl_sdk.server.config import ServerConfig
    from skyrl_sdk.server.settings import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "tml-secret")
    calls = _fake_module(monkeypatch, "skyrl_sdk.cli.serve", "serve")
    assert cli.main(["serve"]) == 0
    config = ServerConfig.from_args(calls[-1])  # the parsed flags hold the settings' names (server/settings.py)
    assert (config.host, config.port, config.models, config.engine, config.engine_config, str(config.state_dir),
            config.api_key, calls[-1].lazy) == ("127.0.0.1", 8000, ("tiny",), "local", {}, "skyrl-server-state",
                                                "tml-secret", False)
    assert cli.main(["-v", "serve", "--model", "a", "--model", "/m/b", "--port", "9",
                     "--engine-config", '{"device": "cpu"}', "--api-key", "tml-x", "-v", "--lazy"]) == 0
    args = calls[-1]
    config = ServerConfig.from_args(args)
    assert (config.models, config.port, config.engine_config, config.api_key, args.lazy) == (
        ("a", "/m/b"), 9, {"device": "cpu"}, "tml-x", True)
    assert args.verbose >= 1


@pytest.mark.parametrize("bad", ["{nope", "[1, 2]"])
def test_serve_rejects_bad_engine_config(bad, capsys):
    for flag in ("--engine-config", "--sampler-config"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["serve", flag, bad])
        assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_demo_arguments(monkeypatch):
    calls = _fake_module(monkeypatch, "skyrl_sdk.cli.demo", "main")
    assert cli.main(["demo"]) == 0
    args = calls[-1]
    assert (args.steps, args.rl_steps, args.json, args.out, args.short, args.threads) == (
        120, 16, False, "./skyrl-demo-out", False, None)
    assert cli.main(["demo", "--short", "--json", "--steps", "3", "--rl-steps", "1", "--seed", "7",
                     "--out", "/tmp/x", "--threads", "3"]) == 0
    args = calls[-1]
    assert (args.steps, args.rl_steps, args.json, args.short, args.seed, args.out, args.threads) == (
        3, 1, True, True, 7, "/tmp/x", 3)


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_threads_must_be_a_positive_whole_number(bad, capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--threads", bad])
    assert "argument --threads: expected a whole number >= 1" in capsys.readouterr().err


def test_cpu_threads_one_unless_told():
    """--threads wins, then OMP_NUM_THREADS (torch reads it itself), else 1 thread."""
    import torch

    from skyrl_sdk.cli import threads

    assert threads.choose(4, {"OMP_NUM_THREADS": "2"}) == (4, "--threads")
    assert threads.choose(None, {"OMP_NUM_THREADS": "2"}) == (None, "OMP_NUM_THREADS")
    assert threads.choose(None, {"OMP_NUM_THREADS": " "}) == (1, "the default on CPU; --threads N to change")
    assert threads.choose(None, {}) == (1, "the default on CPU; --threads N to change")
    before = torch.get_num_threads()
    try:
        assert threads.apply(3) == "3 CPU threads (--threads)" and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_missing_optional_module_is_reported(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "skyrl_sdk.cli.serve", raising=False)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the [server] extra were not installed
    assert cli.main(["serve"]) == 2
    assert "cannot import 'uvicorn' (pip install -e \".[server]\" (in the skyrl-sdk checkout; `skyrl-sdk doctor`" \
        in capsys.readouterr().err


def test_plugin_errors_exit_nonzero_with_a_message(monkeypatch, capsys):
    from skyrl_sdk.errors import DuplicateRegistrationError

    def boom():
        raise DuplicateRegistrationError("loss 'x' is registered by both plugin 'a' and plugin 'b'")

    monkeypatch.setattr(plugins, "get_plugins", boom)
    assert cli.main(["plugins", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "registered by both plugin 'a' and plugin 'b'" in captured.err


# ---- first contact: help, version, output that fits ------------------------------------------


def test_bare_command_prints_the_help_with_the_commands(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: skyrl-sdk")
    for command in ("plugins", "losses", "version", "doctor", "demo", "serve"):
        assert f"\n    {command} " in out
    assert "skyrl-sdk demo" in out  # where to start


def test_version_flag():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"skyrl-sdk {cli.__version__}"


def _subcommands() -> dict:
    return {name: (sub, sub.summary) for name, sub in cli.build_parser().commands.items()}


def test_every_command_has_a_one_line_summary_and_no_rest_markup():
    commands = _subcommands()
    assert set(commands) == {"plugins", "losses", "version", "doctor", "demo", "serve"}
    texts = [cli.build_parser().format_help()]
    for name, (sub, summary) in commands.items():
        assert summary and "\n" not in summary, name
        assert sub.description.rstrip(".").lower() == summary.lower(), name
        texts.append(sub.format_help())
    for text in texts:
        assert "``" not in text and ":class:" not in text and ":func:" not in text


def test_serve_help_says_how_to_point_the_client():
    text = _subcommands()["serve"][0].format_help()
    assert "TINKER_BASE_URL=http://127.0.0.1:8000" in text and "TINKER_API_KEY=tml-" in text
    assert "base_url=" in text and "--lazy" in text


def test_serve_help_describes_the_api_keys_file_with_its_real_columns(tmp_path):
    """--api-keys's help names the columns the file reader accepts, the operator mark too."""
    from skyrl_sdk.server.config import OPERATOR_MARK, read_api_keys

    help_text = " ".join(_subcommands()["serve"][0].format_help().split())
    columns = re.search(r"--api-keys FILE .*?one '(KEY \[OWNER \[(\w+)\]\])' per line", help_text)
    assert columns and columns.group(2) == OPERATOR_MARK, help_text
    keys, operators = tmp_path / "keys", set()
    keys.write_text(f"tml-aaaaaaaaaaaaaaaa alice {OPERATOR_MARK}\ntml-bbbbbbbbbbbbbbbb\n")
    keys.chmod(0o600)
    assert read_api_keys(keys, operators)["tml-aaaaaaaaaaaaaaaa"] == "alice" and operators == {"alice"}
    index = (Path(__file__).resolve().parents[1] / "docs" / "index.md").read_text()
    summary = re.search(r"## The command line\n\n```\n(.*?)```", index, re.S).group(1)
    assert "--api-keys FILE" in summary


@pytest.mark.slow
def test_losses_fit_100_columns_by_default_and_wide_is_one_line_each():
    proc = run_cli("losses", env={"COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    rows = loss_rows()
    *blocks, shared = proc.stdout.strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [f"{r['name']} ({r['role']})" for r in rows]
    assert shared.startswith("Every loss also takes, in every dialect: ") and "kl_coef" in shared
    # wrapped, not cut: every word of every description is there
    assert " ".join(proc.stdout.split()).count(" ".join(rows[0]["description"].split())) == 1
    wide = run_cli("losses", "--wide").stdout.splitlines()
    assert len(wide) == 2 + len(rows) and wide[0].split()[:2] == ["NAME", "ROLE"]  # + the shared keys' line


def loss_rows() -> list:
    plugins.reset()
    return cli_losses.loss_rows()


def test_a_closed_pipe_is_not_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "skyrl_sdk.cli", "losses", "--wide"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` exiting before the command writes
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=HANG_S) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


# ---- serve: fail fast, announce after bind ------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "gpt2"], "cannot start: model 'gpt2': not 'tiny' and not a local directory"),
        (["--engine", "fsdpp"], "--engine: unknown engine 'fsdpp'; available: ["),
        (["--engine-config", '{"devcie": "cpu"}'], "engine_config: unknown key 'devcie'"),
        (["--lazy", "--engine-config", '{"devcie": "cpu"}'], "engine_config: unknown key 'devcie'"),
        (["--sampler", "nope"], "--sampler: unknown sampler 'nope'; available: ['transformers'"),
        (["--sampler-config", '{"n": 1}'], "with sampler 'transformers': InputError: sampler_config: "
                                            "the 'transformers' sampler takes no options, got ['n']"),
        (["--lazy", "--sampler-config", '{"n": 1}'], "sampler 'transformers' with these configs: InputError"),
    ],
)
def test_serve_refuses_to_start_with_the_reason(argv, expected, tmp_path, capsys):
    from _server_harness import free_port

    assert cli.main(["serve", "--port", str(free_port()), "--state-dir", str(tmp_path / "s"), *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    if "fsdpp" in argv:
        assert err.rstrip().endswith("did you mean 'fsdp'?")
    if "devcie" in argv[-1]:
        assert err.rstrip().endswith("did you mean 'device'?")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_serve_port_out_of_range_is_one_line_exit_2(port, tmp_path, capsys):
    assert cli.main(["serve", "--port", port, "--state-dir", str(tmp_path / "s")]) == 2
    first, last = capsys.readouterr().err.splitlines()
    assert first.startswith(f"skyrl-sdk serve: starting on 127.0.0.1:{port} (models: tiny; ")
    assert last == ("skyrl-sdk serve: cannot start: --port: expected a TCP port from 1 to 65535, or 0 for a free "
                    f"one, got {port}")


def test_serve_port_in_use_is_one_line_exit_2_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import socket

    from skyrl_sdk.cli import serve as serve_command

    monkeypatch.setattr(serve_command, "trial_backend", lambda *a: pytest.fail("a model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--state-dir", str(tmp_path / "s")]) == 2
    first, last = capsys.readouterr().err.splitlines()
    assert first.startswith(f"skyrl-sdk serve: starting on 127.0.0.1:{port} ")
    assert last == (f"skyrl-sdk serve: cannot start: --host/--port: cannot bind 127.0.0.1:{port}: address already in "
                    "use; another server may hold it: another --port, or --port 0 for a free one")


def _imported_before(argv: list[str], line_start: str, tmp_path) -> tuple[list[str], list[str]]:
    """``skyrl-sdk`` run with ``-X importtime``: the modules it imported before it printed the
    line starting with ``line_start`` (or before it ended), and its other stderr lines."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "skyrl_sdk.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    modules, lines = [], []
    try:
        for line in proc.stderr:
            if line.startswith("import time:"):
                modules.append(line.rsplit("|", 1)[1].strip())
            else:
                lines.append(line.rstrip("\n"))
                if line.startswith(line_start):
                    break
    finally:
        proc.kill()
        proc.wait(timeout=HANG_S)
        proc.stderr.close()
    return modules, lines


def test_serve_says_it_is_starting_and_refuses_a_busy_port_before_importing_torch(tmp_path):
    """A busy port is refused at once, suggesting --port 0: the first line and the refusal come
    before torch, transformers or the server are imported (counted by imports, not seconds)."""
    import socket

    modules, lines = _imported_before(["serve"], "skyrl-sdk serve: starting", tmp_path)
    assert lines[-1].startswith("skyrl-sdk serve: starting on 127.0.0.1:8000") and "torch" not in modules
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        modules, lines = _imported_before(["serve", "--port", str(port)], "skyrl-sdk serve: cannot start", tmp_path)
    assert lines[-1].endswith("address already in use; another server may hold it: another --port, or --port 0 "
                              "for a free one")
    assert not {"torch", "transformers", "fastapi", "uvicorn"} & set(modules), modules


def test_an_unknown_option_shows_the_commands_own_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--stesp", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: skyrl-sdk demo ")
    assert err.rstrip().endswith("skyrl-sdk demo: error: unrecognized arguments: --stesp 3; did you mean '--steps'?")
    with pytest.raises(SystemExit):
        cli.main(["losses", "--jsno"])
    assert capsys.readouterr().err.startswith("usage: skyrl-sdk losses ")
    with pytest.raises(SystemExit):
        cli.main(["--jsno"])  # no command: the top-level usage
    assert capsys.readouterr().err.startswith("usage: skyrl-sdk [-h]")


def test_serve_checks_a_model_directory_without_loading_it(tmp_path, capsys):
    from skyrl_sdk.cli import serve as serve_command
    from skyrl_sdk.server.config import ServerConfig

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(serve_command.CannotServe, match="config.json could not be read"):
        serve_command.preflight(ServerConfig(models=(str(tmp_path),)), lazy=True)
    from skyrl_sdk.models.loading import tiny_config

    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(serve_command.CannotServe, match="directory has no weights"):
        serve_command.preflight(ServerConfig(models=(str(tmp_path),)), lazy=True)


def test_serve_tries_a_plugin_sampler_with_its_config_before_binding(fresh_plugins, tmp_path, capsys):
    """A plugin sampler is built and samples one token at start-up, so a config it refuses
    exits 2 naming it, before anything binds; one it accepts says what it is."""
    import skyrl_sdk
    from skyrl_sdk import errors, types
    from skyrl_sdk.cli import serve as serve_command
    from skyrl_sdk.sampling import Sampler
    from skyrl_sdk.server.config import ServerConfig

    @skyrl_sdk.register_sampler("picky")
    class Picky(Sampler):
        name = "picky"

        def __init__(self, *, source, config):
            if config.get("size", 1) > 2:
                raise errors.InputError(f"sampler_config['size']: at most 2, got {config['size']}")
            super().__init__(source=source, config=config)

        def sample(self, request):
            return [types.SampleOutput(sequences=[]) for _ in request.prompts]

        def describe(self):
            return f"picky of size {self.config.get('size', 1)}"

    from _server_harness import free_port

    argv = ["serve", "--port", str(free_port()), "--state-dir", str(tmp_path / "s"), "--sampler", "picky"]
    assert cli.main([*argv, "--sampler-config", '{"size": 3}']) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "skyrl-sdk serve: cannot start: model 'tiny' on engine 'local' with sampler 'picky': InputError: "
        "sampler_config['size']: at most 2, got 3")
    said = serve_command.preflight(ServerConfig(sampler="picky", sampler_config={"size": 2}), lazy=True)
    assert said == "picky of size 2"
    assert "(models: tiny; engine: local; sampler: picky of size 2; state: " in \
        serve_command.banner(ServerConfig(sampler="picky"), sampler=said)


def _serve(tmp_path, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "skyrl_sdk.cli", "serve", "--port", str(port),
                             "--state-dir", str(tmp_path / "state"), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _until_listening(proc: subprocess.Popen) -> tuple[str, list[str]]:
    """The banner's first line, and the start-up lines before it (which must say what it did)."""
    before = []
    for line in proc.stderr:
        if line.startswith("skyrl-sdk serve: listening on "):
            return line, before
        before.append(line.rstrip("\n"))
    raise AssertionError(f"serve ended without listening: {before}")


@pytest.mark.slow
def test_serve_with_a_missing_model_exits_2_before_loading_anything(tmp_path):
    from _server_harness import free_port

    proc = _serve(tmp_path, free_port(), "-v", "--model", str(tmp_path / "missing"))
    err = proc.communicate(timeout=HANG_S)[1]
    assert proc.returncode == 2 and "not 'tiny' and not a local directory" in err
    assert "Backend ready" not in err  # -v logs every Backend built: none was and "Traceback" not in err


@pytest.mark.slow
def test_serve_port_0_binds_a_free_port_and_prints_it(tmp_path):
    """``serve --port 0``: the system picks a free port; the banner names it (not 0) and the
    server answers there."""
    import socket
    import urllib.request

    proc = _serve(tmp_path, 0)
    try:
        first, before = _until_listening(proc)
        assert [line.split(" (")[0].split(" ...")[0] for line in before] == [
            "skyrl-sdk serve: starting on 127.0.0.1:0", "skyrl-sdk serve: the port is free; importing torch, "
            "transformers and the HTTP server", "skyrl-sdk serve: loading tiny on engine local and sampling a token "
            "with transformers", "skyrl-sdk serve: tiny ready"], before
        match = re.match(r"skyrl-sdk serve: listening on http://127\.0\.0\.1:(\d+) \(ready in [\d.]+ s; models: tiny; ",
                         first)
        assert match, first
        port = int(match.group(1))
        assert port != 0
        hint = "".join(proc.stderr.readline() for _ in range(2))
        assert f"TINKER_BASE_URL=http://127.0.0.1:{port} " in hint, hint
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=HANG_S) as answer:
            assert answer.status == 200 and isinstance(json.loads(answer.read()), dict)
        with socket.socket() as taken, pytest.raises(OSError):  # the port is really in use
            taken.bind(("127.0.0.1", port))
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)
        proc.stderr.close()


@pytest.mark.slow
def test_serve_banner_comes_after_the_bind(tmp_path):
    import socket

    from _server_harness import free_port

    port = free_port()
    proc = _serve(tmp_path, port)
    try:
        first, _ = _until_listening(proc)
        assert first.startswith(f"skyrl-sdk serve: listening on http://127.0.0.1:{port}"), first
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # already bound when the banner appeared
        hint = "".join(proc.stderr.readline() for _ in range(5))
        assert f"TINKER_BASE_URL=http://127.0.0.1:{port} TINKER_API_KEY=tml-local" in hint
        assert f"console in a browser: http://127.0.0.1:{port}/\n" in hint
        busy = _serve(tmp_path, port)  # same port: binding fails, no banner, non-zero exit
        err = busy.communicate(timeout=HANG_S)[1]
        assert busy.returncode != 0 and "listening on" not in err and "address already in use" in err
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)
        proc.stderr.close()
