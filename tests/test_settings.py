"""The server's settings are declared once (``skyrl_sdk.server.settings.SETTINGS``: name, type,
default, help, flag) and everything that names one reads the declaration: ``ServerConfig``'s
fields and defaults, ``skyrl-sdk serve``'s parser and ``--help``, docs/server.md's flags table and
the console's limits table. A flag renamed in one place, or missing from the parsed arguments,
fails loudly (before: ``ServerConfig.from_args`` read 25 ``getattr(args, "...", None)`` strings,
so a renamed flag silently fell back to its default)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attrs
import pytest

from skyrl_sdk.cli.commands import build_parser
from skyrl_sdk.server import settings
from skyrl_sdk.server.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "tml-settings-test-key-0123"


def _serve_parser():
    return build_parser().commands["serve"]


def test_every_config_field_is_a_declared_setting_with_the_declared_default():
    fields = attrs.fields_dict(ServerConfig)
    assert sorted(fields) == sorted(settings.BY_NAME), "ServerConfig's fields and SETTINGS differ"
    for name, field in fields.items():
        default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
        assert default == settings.BY_NAME[name].default, name


def _given(tmp_path) -> dict[str, tuple[list[str], object]]:
    """For every flag: the arguments that set it to something other than its default, and the
    value the config then holds."""
    keys = tmp_path / "keys"
    keys.write_text(f"{API_KEY} alice operator\n")
    keys.chmod(0o600)
    return {
        "host": (["--host", "0.0.0.0"], "0.0.0.0"),
        "port": (["--port", "0"], 0),
        "models": (["--model", "tiny", "--model", "/models/other"], ("tiny", "/models/other")),
        "engine": (["--engine", "fsdp"], "fsdp"),
        "engine_config": (["--engine-config", '{"device": "cpu"}'], {"device": "cpu"}),
        "sampler": (["--sampler", "vllm"], "vllm"),
        "sampler_config": (["--sampler-config", '{"gpu_memory_utilization": 0.4}'], {"gpu_memory_utilization": 0.4}),
        "state_dir": (["--state-dir", str(tmp_path / "state")], tmp_path / "state"),
        "api_key": (["--api-key", "tml-one"], "tml-one"),
        "api_keys": (["--api-keys", str(keys)], {API_KEY: "alice"}),
        "session_timeout_s": (["--session-timeout", "30"], 30.0),
        "max_seq_len": (["--max-seq-len", "512"], 512),
        "max_num_samples": (["--max-num-samples", "4"], 4),
        "share_base": (["--no-share-base"], False),
        "max_lora_adapters": (["--max-lora-adapters", "3"], 3),
        "max_memory": (["--max-memory", "8GiB"], 8 * 2**30),
        "snapshot_memory": (["--snapshot-memory", "64MiB"], 64 * 2**20),
        "max_tokens_per_request": (["--max-tokens-per-request", "1000"], 1000),
        "max_queued_requests": (["--max-queued-requests", "7"], 7),
        "header_timeout_s": (["--header-timeout", "2.5"], 2.5),
        "max_connections": (["--max-connections", "50"], 50),
        "allowed_hosts": (["--allowed-host", "a.example", "--allowed-host", "b.example"], ("a.example", "b.example")),
    }


def test_every_flag_reaches_its_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(settings.API_KEY_ENV, raising=False)
    given = _given(tmp_path)
    assert sorted(given) == sorted(s.name for s in settings.FLAGS), "a flag without a case here (add it)"
    argv = [arg for args, _ in given.values() for arg in args]
    config = ServerConfig.from_args(build_parser().parse_args(["serve", *argv]))
    for name, (_, want) in given.items():
        assert getattr(config, name) == want, name
        assert want != settings.BY_NAME[name].default, f"{name}: pick a value other than the default"
    assert config.operators == {"alice"}
    plain = ServerConfig.from_args(build_parser().parse_args(["serve"]))  # nothing given: every default
    assert plain == ServerConfig(), "a flag not given must leave its setting's default"


def test_a_missing_or_renamed_flag_fails_loudly():
    args = build_parser().parse_args(["serve", "--session-timeout", "30"])
    assert ServerConfig.from_args(args).session_timeout_s == 30.0
    renamed = vars(args) | {"session_timeout": 30.0}  # as a hand-written parser with the old name would have it
    del renamed["session_timeout_s"]
    with pytest.raises(TypeError, match="--session-timeout"):
        ServerConfig.from_args(type(args)(**renamed))
    for s in settings.FLAGS:
        missing = vars(args).copy()
        del missing[s.name]
        with pytest.raises(TypeError, match=re.escape(s.flag)):
            ServerConfig.from_args(type(args)(**missing))


def test_positive_flags_are_refused_naming_the_flag():
    from skyrl_sdk.errors import InputError

    for s in settings.FLAGS:
        if s.positive:
            with pytest.raises(InputError, match=f"^{re.escape(s.flag)}: expected a positive number"):
                ServerConfig.from_args(build_parser().parse_args(["serve", s.flag, "0"]))


def test_serve_help_shows_each_flag_with_its_declared_help_and_default():
    text = _serve_parser().format_help()
    assert "``" not in text and "`" not in text
    squeezed = re.sub(r"\s+", "", text)  # argparse wraps lines (at hyphens too)
    for s in settings.FLAGS:
        assert re.sub(r"\s+", "", f"{s.help} (default: {s.default_text})".replace("`", "")) in squeezed, s.flag


def test_the_docs_flags_table_is_the_declaration():
    text = (ROOT / "docs" / "server.md").read_text()
    block = text.split(settings.MARK_START)[1].split(settings.MARK_END)[0].strip()
    assert block == settings.render_flags_table(), "regenerate it: python -m skyrl_sdk.server.settings"


def test_no_code_reads_parsed_arguments_by_strings():
    """``getattr(args, "name", default)`` is how a renamed flag fell back to its default unseen."""
    found = []
    for file in (ROOT / "src" / "skyrl_sdk").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
                found.append(f"{file.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
