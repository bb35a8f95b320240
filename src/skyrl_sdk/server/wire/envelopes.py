"""Tinker's JSON requests and responses <-> plain values the runtime works with.

Every JSON request is read here: its keys against the keys Tinker's request type has
(:data:`REQUEST_KEYS`; any other key is refused by name, as everywhere), the ids, names and
flags of the envelope into small frozen records with a clear ``InputError`` naming the field,
and the call's own values (sampling params, AdamParams, LoraConfig, prompts) through
:mod:`skyrl_sdk.inputs`, the same functions ``Backend`` uses, so a value is accepted or
refused alike in process and over HTTP, with the same message. The JSON answers (model
info, training runs, sessions, optimizer metrics) are shaped here too. The protobuf
forward_backward request is read by :mod:`skyrl_sdk.inputs.tinker_proto`, outputs written
by :mod:`.proto`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from ...errors import InputError, quoted, refuse_unknown_keys
from ...inputs import sample as sample_input
from ...inputs.coerce import adam_params_from_any
from ...inputs.limits import prompt_length_problem
from ...inputs.tinker_proto import SERVER_LIMIT, check_seq_id
from ...types import AdamParams, ModelInput, SampleRequest
from ...types.numbers import check_number
from . import caps
from .tinker_paths import check_name, check_run_id, iso

#: widest ``topk_prompt_logprobs``, ``topk_sample_logprobs`` and ``prompt_alt_tokens_k`` one sample
#: request may ask for (Tinker's top-k width bound)
MAX_TOPK_PROMPT_LOGPROBS = 20
#: The keys of each JSON request, as the ``tinker`` client's request types (0.38) have them
#: (``tests/test_input_path.py`` checks that every field the client can send is here). A key
#: not listed is refused by name; a new request field is read where its route's parser reads
#: the others, and listed here.
REQUEST_KEYS: dict[str, tuple[str, ...]] = {
    "create_session": ("tags", "user_metadata", "sdk_version", "project_id", "display_name", "type"),
    "session_heartbeat": ("session_id", "type"),
    "finish_session": ("reason", "detail"),
    "create_sampling_session": ("session_id", "sampling_session_seq_id", "base_model", "model_path", "type"),
    "create_model": ("session_id", "model_seq_id", "base_model", "user_metadata", "lora_config", "optimizer_config",
                     "type"),
    "get_info": ("model_id", "type"),
    "load_weights": ("model_id", "seq_id", "session_id", "model_seq_id", "base_model", "user_metadata", "path",
                     "optimizer", "optimizer_config", "weights_access_token", "type"),
    "save_weights": ("model_id", "path", "seq_id", "ttl_seconds", "overwrite", "user_metadata", "type"),
    "save_weights_external": ("model_id", "path", "seq_id", "ttl_seconds", "age_encryption_recipients", "type"),
    "save_weights_for_sampler": ("model_id", "path", "sampling_session_seq_id", "kind", "seq_id", "ttl_seconds",
                                 "user_metadata", "type"),
    "optim_step": ("adam_params", "optim_params", "optimizer_params", "model_id", "seq_id", "type"),
    "asample": ("prompt", *sample_input.OPTION_KEYS, "base_model", "model_path", "sampling_session_id", "seq_id",
                "prompt_logprobs_last_n", "type"),
    "retrieve_future": ("request_id", "allow_metadata_only"),
    "weights_info": ("tinker_path",),
    # the RestClient's routes (server/http/rest.py)
    "set_ttl": ("ttl_seconds",),
    "search_sessions": ("session_id", "project_ids", "user_metadata", "display_name", "owner", "statuses", "limit",
                        "cursor"),
}
#: Tinker's bounds on a checkpoint's time to live, in whole seconds: one hour to ten years
MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 24 * 3600
#: the largest id number a request may give (``model_seq_id``, ``sampling_session_seq_id``, an
#: ``asample``'s ``seq_id``): int64's
MAX_ID_NUMBER = 2**63 - 1


# ---- reading fields -----------------------------------------------------------------------------
def json_request(raw: bytes, route: str) -> dict[str, Any]:
    """A request body as a JSON object whose keys are all ``route``'s (:data:`REQUEST_KEYS`)."""
    body = json_object(raw)
    refuse_unknown_keys(route, body, REQUEST_KEYS[route])
    return body


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (an empty body is ``{}``)."""
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise InputError("request body: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, or an integer of too many digits
        raise InputError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(f"request body: expected a JSON object, got {type(obj).__name__}")
    return obj


def integer(body: Mapping[str, Any], key: str, required: bool = True) -> int | None:
    """An id number of the body: an integer 0..int64 (a longer one, or a decimal, refused by name)."""
    value = body.get(key)
    if value is None and not required:
        return None
    return check_number(key, value, low=0, high=MAX_ID_NUMBER, integer=True)


def flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InputError(f"{key}: expected true or false, got {quoted(value)}")
    return value


def _object(body: Mapping[str, Any], key: str) -> dict | None:
    value = body.get(key)
    if value is not None and not isinstance(value, dict):
        raise InputError(f"{key}: expected an object, got {type(value).__name__}")
    return value


def ttl_seconds(value: Any) -> int | None:
    """A checkpoint's ``ttl_seconds``, the one rule of every save and of ``PUT .../ttl``: null
    (never expires) or whole seconds in :data:`MIN_TTL_S`..:data:`MAX_TTL_S` (an expiry past
    year 9999 cannot even be written as a date)."""
    return None if value is None else check_number("ttl_seconds", value, low=MIN_TTL_S, high=MAX_TTL_S,
                                                   integer=True)


def _ttl(body: Mapping[str, Any]) -> int | None:
    return ttl_seconds(body.get("ttl_seconds"))


def parse_set_ttl(body: Mapping[str, Any]) -> int | None:
    """``PUT .../ttl``'s body: ``{"ttl_seconds": seconds or null}`` (the key is required)."""
    if "ttl_seconds" not in body:
        raise InputError('set ttl: expected {"ttl_seconds": seconds or null}, got no ttl_seconds')
    return ttl_seconds(body["ttl_seconds"])


def session_id(body: Mapping[str, Any], key: str = "session_id") -> str:
    return check_run_id(body.get(key), "session id")


def seq_id(body: Mapping[str, Any]) -> int | None:
    """A training request's ``seq_id`` (None: not ordered), by the rule its protobuf form has
    (:func:`~skyrl_sdk.inputs.tinker_proto.check_seq_id`)."""
    return check_seq_id(body.get("seq_id"))


def model_id(body: Mapping[str, Any]) -> str:
    value = body.get("model_id")
    if not isinstance(value, str):
        raise InputError(f"model_id: expected a string, got {quoted(value)}")
    return value


# ---- requests -----------------------------------------------------------------------------------
@attrs.frozen
class NewModel:
    """create_model, or load_weights with a session id (create from a checkpoint)."""

    session_id: str
    model_id: str
    base_model: Any
    lora_config: Any
    user_metadata: dict | None
    path: str | None = None
    optimizer: bool = False


def parse_new_model(body: Mapping[str, Any], from_state: bool = False) -> NewModel:
    sid = session_id(body)
    seq = integer(body, "model_seq_id")
    _check_optimizer(body)
    return NewModel(
        session_id=sid, model_id=check_run_id(f"{sid}:train:{seq}", "model id"), base_model=body.get("base_model"),
        lora_config=_object(body, "lora_config"), user_metadata=caps.metadata(body.get("user_metadata")),
        path=body.get("path") if from_state else None, optimizer=flag(body, "optimizer"),
    )


def _check_optimizer(body: Mapping[str, Any]) -> None:
    """``optimizer_config`` (create_model, load_weights) names AdamW; no external weights token."""
    optimizer_config = _object(body, "optimizer_config") or {}
    if optimizer_config.get("type", "adamw") != "adamw":
        raise InputError(f"optimizer {quoted(optimizer_config.get('type'))} is not supported; skyrl-sdk trains "
                         f"with AdamW")
    refuse_unknown_keys("optimizer_config", optimizer_config, ("type",))
    if body.get("weights_access_token") is not None:
        raise InputError("weights_access_token is not supported by skyrl-sdk serve (checkpoints are this "
                         "server's tinker:// paths)")


@attrs.frozen
class Save:
    name: str
    overwrite: bool
    ttl_seconds: float | None
    user_metadata: dict | None


def parse_save(body: Mapping[str, Any]) -> Save:
    return Save(check_name(body.get("path")), flag(body, "overwrite"), _ttl(body),
                caps.metadata(body.get("user_metadata")))


def parse_external_save(body: Mapping[str, Any]) -> tuple[Save, Any]:
    """save_weights_external: the export's name and ttl, and its ``age_encryption_recipients`` (raw)."""
    return Save(check_name(body.get("path")), True, _ttl(body), None), body.get("age_encryption_recipients")


@attrs.frozen
class Load:
    """load_weights into an existing model: which checkpoint (resolved by the store), and
    whether its optimizer state comes too."""

    path: Any
    optimizer: bool


def parse_load(body: Mapping[str, Any]) -> Load:
    _check_optimizer(body)
    return Load(body.get("path"), flag(body, "optimizer"))


#: sampling sessions save_weights_for_sampler makes without a path: pinned to the weights of
#: the moment ("snapshot"), or always sampling the live weights ("inflight")
SAMPLER_KINDS = ("snapshot", "inflight")


@attrs.frozen
class SamplerSave:
    """save_weights_for_sampler: a named checkpoint (``save``), or else weights for the
    sampling session ``sampling_session_seq_id`` of the given ``kind``."""

    save: Save | None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"


def parse_sampler_save(body: Mapping[str, Any]) -> SamplerSave:
    if body.get("path") is not None:
        return SamplerSave(parse_save(body))
    if body.get("sampling_session_seq_id") is None:
        raise InputError("save_weights_for_sampler: needs a path (a name) or a sampling_session_seq_id")
    kind = body.get("kind") or "snapshot"
    if kind not in SAMPLER_KINDS:
        raise InputError(f"save_weights_for_sampler: unknown kind {quoted(kind)} (snapshot or inflight)")
    return SamplerSave(None, integer(body, "sampling_session_seq_id"), kind)


@attrs.frozen
class SamplerSource:
    """What a sampling session (or an ad-hoc sample) samples from: a saved ``tinker://`` path
    or a served base model (checked against the store and the served models later)."""

    model_path: str | None
    base_model: str | None


def _optional_text(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InputError(f"{key}: expected a string, got {type(value).__name__}")
    return value or None


def parse_sampler_source(body: Mapping[str, Any]) -> SamplerSource:
    return SamplerSource(_optional_text(body, "model_path"), _optional_text(body, "base_model"))


def parse_sample_ref(body: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """asample's ``(sampling_session_id, seq_id)``; both given make the request deduplicated
    (a sampling client numbers its requests from 0, and they are never held for order)."""
    return _optional_text(body, "sampling_session_id"), integer(body, "seq_id", required=False)


def parse_adam_params(body: Mapping[str, Any]) -> AdamParams:
    """optim_step's ``adam_params``, read by the AdamParams reader ``Backend.optim_step`` uses
    (missing: the defaults, as ``Backend.optim_step()``)."""
    if body.get("optimizer_params") is not None:
        raise InputError("only AdamW (adam_params) is supported by skyrl-sdk serve")
    raw = body.get("adam_params", body.get("optim_params"))
    if raw is not None and not isinstance(raw, dict):
        raise InputError(f"adam_params: expected an object, got {type(raw).__name__}")
    return adam_params_from_any(raw or {})


@attrs.frozen(eq=False)
class SampleSpec:
    """An asample request: the one :class:`~skyrl_sdk.types.SampleRequest` (one prompt), and
    how to shape its answer (``prompt_logprobs_last_n``)."""

    request: SampleRequest
    prompt_logprobs_last_n: int | None = None

    @property
    def prompt(self) -> np.ndarray | ModelInput:
        return self.request.prompts[0]

    @property
    def prompt_length(self) -> int:
        """The prompt's positions as declared (its images' ``expected_tokens`` included)."""
        return sample_input.declared_length(self.prompt)

    def check_length(self, limit: int | None) -> None:
        """The prompt plus ``max_tokens`` must fit the server's limit for the model (checked
        before the request is queued, in ``Backend.sample``'s words)."""
        problem = prompt_length_problem(self.prompt_length, self.request.sampling_params.max_tokens, limit,
                                        SERVER_LIMIT)
        if problem:
            raise InputError(f"prompt 0: {problem}")


def parse_sample_request(body: Mapping[str, Any], max_num_samples: int) -> SampleSpec:
    """A JSON ``SampleRequest`` (everything except where to sample from): the request through
    :func:`skyrl_sdk.inputs.sample.sample_request_from_json`, the prompt first, then
    ``num_samples`` (at most ``max_num_samples``)."""
    request = sample_input.sample_request_from_json(body, max_num_samples=max_num_samples,
                                                    max_topk=MAX_TOPK_PROMPT_LOGPROBS)
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not request.prompt_logprobs:
            raise InputError("prompt_logprobs_last_n needs prompt_logprobs")
        last_n = check_number("prompt_logprobs_last_n", last_n, low=1,
                              high=sample_input.declared_length(request.prompts[0]) - 1, integer=True)
    return SampleSpec(request, last_n)


# ---- responses ----------------------------------------------------------------------------------
def future_json(request_id: str, model_id: str | None, **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id, **extra}


def optim_step_json(metrics: Mapping[str, float]) -> dict[str, Any]:
    """optim_step's answer. A non-finite metric (``grad_norm`` of a skipped step) is left out:
    JSON has no NaN, and the client's ``OptimStepResponse`` wants a float per key."""
    return {"metrics": {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}}


def model_info_json(model_id: str, base_model: str, info: Any) -> dict[str, Any]:
    return {
        "type": "get_info",
        "model_id": model_id,
        "model_data": {"arch": info.architecture, "model_name": base_model, "tokenizer_id": info.tokenizer_dir},
        "optimizer_config": {"type": "adamw"},
        "is_lora": info.is_lora,
        "lora_rank": info.lora_rank,
        "model_name": base_model,
        # not in tinker's GetInfoResponse (its client ignores it): which sampler serves this model
        "sampler": info.sampler,
    }


def run_json(run: Mapping[str, Any], last_checkpoint: Any, last_sampler_checkpoint: Any) -> dict[str, Any]:
    lora = run["lora"]
    return {
        "training_run_id": run["run_id"],
        "base_model": run["base_model"],
        "model_owner": run["owner"],
        "is_lora": lora is not None,
        "corrupted": False,
        "lora_rank": lora["rank"] if lora else None,
        "last_request_time": iso(run["last_request_time"]),
        "last_checkpoint": last_checkpoint,
        "last_sampler_checkpoint": last_sampler_checkpoint,
        "user_metadata": {str(k): str(v) for k, v in (run["user_metadata"] or {}).items()} or None,
    }


def session_json(row: Mapping[str, Any], run_ids: list[str]) -> dict[str, Any]:
    return {"session_id": row["session_id"], "training_run_ids": run_ids, "sampler_ids": [],
            "created_at": iso(row["created_at"]), "finished_at": iso(row["finished_at"])}


def weights_info_json(run: Mapping[str, Any]) -> dict[str, Any]:
    lora = run["lora"]
    out = {"base_model": run["base_model"], "is_lora": lora is not None}
    if lora:
        out.update(lora_rank=lora["rank"], train_unembed=lora["train_unembed"], train_mlp=lora["train_mlp"],
                   train_attn=lora["train_attn"])
    return out
