"""The compatibility matrix of docs/server.md, generated from the installed ``tinker`` client.

:func:`client_routes` reads the client's source (``ast``, nothing imported or run) for every
HTTP call it can make under ``/api/v1``; :data:`ROWS` says, per route, whether this server
serves it and how. :func:`render_matrix` writes the table docs/server.md carries between its
``compat-matrix`` markers; ``python -m skyrl_sdk.server.wire.compat`` prints it.
``tests/test_server_compat.py`` fails when a client route has no row, a row names a route the
client no longer has, the docs differ from the rendering, or a row disagrees with what the
server answers. Routes this server declines answer 404 with :data:`NOT_SERVED_PREFIX` and the
row's reason (:func:`not_served_detail`).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from ...errors import install_hint

#: the start of every "this server does not serve it" 404 detail
NOT_SERVED_PREFIX = "skyrl-sdk serve does not serve"
_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}
MARK_START, MARK_END = "<!-- compat-matrix:start -->", "<!-- compat-matrix:end -->"

#: (method, path) -> (served, what calls it, notes). ``served`` False: declined, answered 404.
ROWS: dict[tuple[str, str], tuple[bool, str, str]] = {
    ("POST", "/api/v1/client/config"): (True, "every client", "JSON flags; `parallel_fwdbwd_chunks: false`, `pjwt_auth_enabled: false`; `ServerConfig.client_config` adds more"),
    ("POST", "/api/v1/client/dynamic_config"): (True, "every client", "`sample_cancel_enabled: false`"),
    ("POST", "/api/v1/create_session"): (True, "`ServiceClient()`", "`display_name`, `user_metadata`, `tags` kept"),
    ("POST", "/api/v1/session_heartbeat"): (True, "every 10 s", "410 once the session ended"),
    ("POST", "/api/v1/sessions/{session_id}/finish"): (True, "`close(\"success\")`, `with` exit", "releases the session's models and recorded sequences"),
    ("GET", "/api/v1/sessions"): (True, "`RestClient.list_sessions`", "the caller's sessions"),
    ("GET", "/api/v1/sessions/{session_id}"): (True, "`RestClient.get_session`", ""),
    ("POST", "/api/v1/sessions/search"): (True, "`RestClient.search_sessions`", "filters by id, display name, user_metadata, status; pages by cursor; only the caller's own sessions (every owner type reads as the caller's)"),
    ("PUT", "/api/v1/sessions/{session_id}/project"): (False, "`RestClient.assign_session_project`", "projects are a hosted-service feature"),
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): (False, "`RestClient.export_session_trace`", "no server-side traces"),
    ("POST", "/api/v1/create_model"): (True, "`create_lora_training_client`", "LoRA rank/seed/train_mlp/attn/unembed honoured; AdamW only; model id `{session}:train:{n}`"),
    ("POST", "/api/v1/get_info"): (True, "training-client creation", "`tokenizer_id` = local tokenizer directory; adds `sampler` (which sampler serves; the client ignores it)"),
    ("POST", "/api/v1/copy_weights"): (False, "`RestClient.copy_weights`", "copies a checkpoint into another project; this server has no projects"),
    ("POST", "/api/v1/forward_backward"): (True, "`forward_backward`, `forward`, `forward_backward_custom`", "protobuf in/out; dense + sparse CSR tensors; multi-chunk prompts; encoded-text and image chunks (a vision-language base); provenance spans; `loss_fn_config_v2` (numbers and text); every built-in loss incl. `stable_reinforce`"),
    ("POST", "/api/v1/optim_step"): (True, "`optim_step(AdamParams)`", "every field honoured; `DimuonParams` -> user error"),
    ("POST", "/api/v1/save_weights"): (True, "`save_state`", "`overwrite`, `ttl_seconds`, `user_metadata`"),
    ("POST", "/api/v1/save_weights_for_sampler"): (True, "`save_weights_for_sampler`, `save_weights_and_get_sampling_client`", "named and ephemeral (`snapshot`, `inflight`)"),
    ("POST", "/api/v1/save_weights_external"): (True, "`save_weights_external`", "a Hugging Face directory (LoRA: merged, its peft adapter in `adapter/`); `ttl_seconds`; `age_encryption_recipients` (needs `pyrage`)"),
    ("POST", "/api/v1/load_weights"): (True, "`create_training_client_from_state[_with_optimizer]`, `load_state[_with_optimizer]`", "the caller's checkpoints and published ones"),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints"): (True, "`list_checkpoints`", ""),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id}/external_weights_urls"): (True, "`RestClient.get_external_weights_urls`, cookbook `weights.download`", "the caller's own exports: signed links (1 h) to each file, downloaded without a key"),
    ("POST", "/api/v1/asample"): (True, "`sample`, `compute_logprobs`", "num_samples, max_tokens, temperature, top_k, top_p, seed, stop, logprobs, prompt_logprobs, topk_prompt_logprobs, topk_sample_logprobs, prompt_alt_tokens_k (widths <= 20), target_prompt_logprobs (answered dense), prompt_logprobs_last_n, record_stability_info; image chunks in the prompt (a vision-language base)"),
    ("POST", "/api/v1/create_sampling_session"): (True, "`create_sampling_client`", "base model or `tinker://` path (the caller's or a published one)"),
    ("GET", "/api/v1/samplers/{sampling_session_id}"): (True, "sampling-client creation", ""),
    ("GET", "/api/v1/samplers/{sampler_id}"): (True, "`RestClient.get_sampler`", ""),
    ("POST", "/api/v1/retrieve_future"): (True, "every future", "long-poll 20 s then `try_again`"),
    ("POST", "/api/v1/retrieve_futures"): (False, "only when the client config enables it", "this server leaves `sample_use_retrieve_futures` off, so the client never calls it"),
    ("POST", "/api/v1/cancel_future"): (True, "only if the dynamic config enables it", "accepted; no-op"),
    ("POST", "/api/v1/join_sampling_session"): (False, "only when the client config enables it", "`sample_join_sampling_session` is off"),
    ("POST", "/api/v1/create_custom_loss"): (False, "only when the client config enables it", "`custom_loss_server_side` is off: custom losses run client-side"),
    ("GET", "/api/v1/training_runs"): (True, "`RestClient.list_training_runs`", "the caller's runs"),
    ("GET", "/api/v1/training_runs/{training_run_id}"): (True, "`RestClient.get_training_run`, cookbook resume", ""),
    ("DELETE", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}"): (True, "`delete_checkpoint*`, cookbook rolling saves", "the caller's own checkpoints"),
    ("POST", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/publish"): (True, "`publish_checkpoint_from_tinker_path`", "owner only; other owners may then read it by path (sample, load, weights info), never list, change or delete it"),
    ("DELETE", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/publish"): (True, "`unpublish_checkpoint_from_tinker_path`", "owner only"),
    ("PUT", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/ttl"): (True, "`set_checkpoint_ttl_from_tinker_path`", "3600 s to 10 years, or null (never); an expired checkpoint is gone at once and its files deleted within a minute"),
    ("GET", "/api/v1/checkpoints"): (True, "`list_user_checkpoints`", "the caller's checkpoints"),
    ("POST", "/api/v1/weights_info"): (True, "`get_weights_info_by_tinker_path`", "the caller's checkpoints and published ones"),
    ("GET", "/api/v1/get_server_capabilities"): (True, "`get_server_capabilities`", "lists `--model`s"),
    ("GET", "/api/v1/healthz"): (True, "`health_check`", "no key needed"),
    ("POST", "/api/v1/telemetry"): (True, "telemetry (unless `TINKER_TELEMETRY=0`)", "accepted, dropped"),
    ("POST", "/api/v1/auth/token"): (False, "JWT auth (only when `pjwt_auth_enabled`)", "plain API keys only"),
    ("GET", "/api/v1/auth/apikey/me"): (False, "`tinker` CLI auth", "keys are the server's `--api-key(s)`"),
    ("DELETE", "/api/v1/auth/apikey/me"): (False, "`tinker` CLI auth", "keys are the server's `--api-key(s)`"),
    ("GET", "/api/v1/audit"): (False, "`AdminClient.get_audit_log`", "hosted-service feature"),
    ("GET", "/api/v1/billing/usage/events"): (False, "`AdminClient.get_billing_usage`", "hosted-service feature"),
    ("GET", "/api/v1/billing/usage/checkpoints/current"): (False, "`AdminClient.get_current_checkpoint_storage_usage`", "hosted-service feature"),
}


def _tinker_root() -> Path:
    spec = importlib.util.find_spec("tinker")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the tinker client is not installed: {install_hint('server')}")
    return Path(spec.origin).parent


def _f_string_part(part: ast.expr) -> str:
    """One part of an f-string: its text, or a placeholder as ``{name}``."""
    if isinstance(part, ast.Constant):
        return str(part.value)
    assert isinstance(part, ast.FormattedValue)  # an f-string holds these two kinds
    return "{" + ast.unparse(part.value) + "}"


def _path_of(node: ast.expr) -> str | None:
    """The route of a string or f-string argument (placeholders as ``{name}``), if under /api/v1."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        text = "".join(_f_string_part(v) for v in node.values)
    else:
        return None
    return text if text.startswith("/api/v1/") else None


def client_routes() -> dict[tuple[str, str], list[str]]:
    """Every (method, path) the installed client calls, with the modules that call it."""
    root = _tinker_root()
    found: dict[tuple[str, str], list[str]] = {}
    for file in sorted(root.rglob("*.py")):
        if file.name.endswith("_test.py"):
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or not node.args:
                continue
            name = node.func.attr.lstrip("_")
            args = node.args
            if name == "request" and len(args) >= 2 and isinstance(args[0], ast.Constant):
                method, path = str(args[0].value).upper(), _path_of(args[1])
            elif name in _METHODS:
                method, path = _METHODS[name], _path_of(args[0])
            else:
                continue
            if path is not None:
                where = str(file.relative_to(root.parent).with_suffix("")).replace("/", ".")
                found.setdefault((method, path), [])
                if where not in found[(method, path)]:
                    found[(method, path)].append(where)
    return found


def not_served_detail(method: str, path: str) -> str:
    """The 404 detail of a declined client route."""
    return f"{NOT_SERVED_PREFIX} {method} {path}: {ROWS[(method, path)][2]}"


def render_matrix() -> str:
    """The markdown table (client routes in the client's module order, then by path)."""
    routes = client_routes()
    lines = ["| endpoint | client call | supported | notes |", "|---|---|---|---|"]
    for method, path in sorted(routes, key=lambda r: (r[1], r[0])):
        served, caller, notes = ROWS[(method, path)]
        answer = "yes" if served else "no (404)"
        lines.append(f"| `{method} {path}` | {caller} | {answer} | {notes} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    print(render_matrix())
