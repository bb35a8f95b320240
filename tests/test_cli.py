"""The ``skyrl-sdk`` command, run the way users run it (a subprocess) and in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types as pytypes

import pytest

from skyrl_sdk import cli, plugins
from skyrl_sdk.dialects.tinker import convert_tinker
from skyrl_sdk.losses.base import LossSpec
from skyrl_sdk.registry import DialectSpec


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "skyrl_sdk.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


def has_reinforce() -> bool:
    try:
        import skyrl_sdk_reinforce  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    monkeypatch.delenv(plugins.ENV_VAR, raising=False)
    plugins.reset()
    yield
    plugins.reset()


# ---- as a subprocess -----------------------------------------------------------------------


def test_plugins_json_lists_builtins_and_reinforce():
    proc = run_cli("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    by_name = {r["name"]: r for r in rows}
    for name in plugins.BUILTIN_PLUGINS:
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
    proc = run_cli("plugins", env={plugins.ENV_VAR: ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "PACKAGE", "VERSION", "BUILTIN", "REGISTERED"]
    column = lines[0].index("PACKAGE")
    assert all(line[column - 2:column] == "  " and line[column] != " " for line in lines[1:])
    assert "reinforce" not in proc.stdout and len(lines) == 1 + len(plugins.BUILTIN_PLUGINS)


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
    assert cli.config_defaults(spec) == {"beta": 0.25, "tags": ()}
    monkeypatch.setitem(plugins.get_registry().losses, "fake", spec)
    assert cli.main(["losses"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fake "))
    assert "beta=0.25, tags=()" in line and "target_tokens, advantages [weights]" in line
    assert "native: fake; tinker: fake" in line


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
    assert cli.dialect_names(tinker, _spec(name, role)) == expected


def test_a_dialect_that_shadows_a_name_hides_it():
    def convert(loss_fn, cfg, role):
        return ("other", {}) if loss_fn == "mine" else None

    convert.names = ("mine",)
    assert cli.dialect_names(DialectSpec("d", convert), _spec("mine")) == []
    assert cli.dialect_names(DialectSpec("d", convert), _spec("other")) == ["mine", "other"]


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
    monkeypatch.setenv(cli.API_KEY_ENV, "tml-secret")
    calls = _fake_module(monkeypatch, "skyrl_sdk.server.app", "serve")
    assert cli.main(["serve"]) == 0
    args = calls[-1]
    assert (args.host, args.port, args.model, args.engine, args.engine_config, args.state_dir, args.api_key) == (
        "127.0.0.1", 8000, ["tiny"], "local", None, "./skyrl-server-state", "tml-secret")
    assert cli.main(["-v", "serve", "--model", "a", "--model", "/m/b", "--port", "9",
                     "--engine-config", '{"device": "cpu"}', "--api-key", "tml-x", "-v"]) == 0
    args = calls[-1]
    assert (args.model, args.port, args.engine_config, args.api_key) == (["a", "/m/b"], 9, {"device": "cpu"}, "tml-x")
    assert args.verbose >= 1


@pytest.mark.parametrize("bad", ["{nope", "[1, 2]"])
def test_serve_rejects_bad_engine_config(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine-config", bad])
    assert exc.value.code == 2 and "--engine-config" in capsys.readouterr().err


def test_demo_arguments(monkeypatch):
    calls = _fake_module(monkeypatch, "skyrl_sdk.demo", "main")
    assert cli.main(["demo"]) == 0
    args = calls[-1]
    assert (args.steps, args.rl_steps, args.json, args.out, args.short) == (120, 16, False, "./skyrl-demo-out", False)
    assert cli.main(["demo", "--short", "--json", "--steps", "3", "--rl-steps", "1", "--seed", "7",
                     "--out", "/tmp/x"]) == 0
    args = calls[-1]
    assert (args.steps, args.rl_steps, args.json, args.short, args.seed, args.out) == (3, 1, True, True, 7, "/tmp/x")


def test_missing_optional_module_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "skyrl_sdk.server.app", None)  # makes the import fail
    assert cli.main(["serve"]) == 2
    assert "cannot import" in capsys.readouterr().err


def test_plugin_errors_exit_nonzero_with_a_message(monkeypatch, capsys):
    from skyrl_sdk.errors import DuplicateRegistrationError

    def boom():
        raise DuplicateRegistrationError("loss 'x' is registered by both plugin 'a' and plugin 'b'")

    monkeypatch.setattr(plugins, "get_plugins", boom)
    assert cli.main(["plugins", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "registered by both plugin 'a' and plugin 'b'" in captured.err
