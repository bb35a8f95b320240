"""A sampling client's ``get_tokenizer()`` on a server of ``tiny`` loads offline: the client
loads the tokenizer of the base model the server names for the sampler, and the server names
``tiny`` by the directory of its tokenizer files (which it also accepts as ``tiny``). No
model-hub call is made (the hub functions fail the test if called)."""

from __future__ import annotations

import pytest

pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from _limits import HANG_S
from _server_harness import ServerThread


@pytest.fixture
def no_hub(monkeypatch):
    import huggingface_hub
    import huggingface_hub.file_download as fd

    def refuse(*args, **kwargs):
        raise AssertionError(f"a model-hub lookup was made: {args} {kwargs}")

    for module in (huggingface_hub, fd):
        for name in ("hf_hub_download", "get_hf_file_metadata"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)


def test_sampling_clients_of_tiny_load_their_tokenizer_offline(tmp_path, no_hub):
    from tinker import types as tt

    with ServerThread(tmp_path / "state") as srv:
        service = srv.service_client()
        trainer = service.create_lora_training_client(base_model="tiny", rank=2).result(timeout=HANG_S)
        want = trainer.get_tokenizer().encode("hello world")
        from_weights = trainer.save_weights_and_get_sampling_client().result(timeout=HANG_S)
        path = trainer.save_weights_for_sampler("s").result(timeout=HANG_S).path
        from_path = service.create_sampling_client(model_path=path).result(timeout=HANG_S)
        for sampler in (from_weights, from_path):
            assert sampler.get_tokenizer().encode("hello world") == want
        # that name is the served tiny model too: a client may create more samplers from it
        by_name = service.create_sampling_client(base_model=from_path.get_base_model()).result(timeout=HANG_S)
        assert by_name.get_tokenizer().encode("hello world") == want
        assert len(by_name.sample(tt.ModelInput.from_ints(want), 1, tt.SamplingParams(max_tokens=2))
                   .result(timeout=HANG_S).sequences) == 1
        service.close("success").result()


def test_a_sampling_client_named_tiny_by_hand_fails_at_once_offline_as_the_banner_says(tmp_path, monkeypatch):
    """``create_sampling_client(base_model="tiny")`` holds the name typed, which the client's
    get_tokenizer() looks up on the model hub (~50 s of retries without network). The banner
    says to export HF_HUB_OFFLINE=1 without network: then it fails with no network attempt."""
    import socket

    from skyrl_sdk.cli.serve import banner
    from skyrl_sdk.server.config import ServerConfig

    assert "export HF_HUB_OFFLINE=1" in banner(ServerConfig())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with ServerThread(tmp_path / "state") as srv:
        service = srv.service_client()
        by_hand = service.create_sampling_client(base_model="tiny").result(timeout=HANG_S)
        lookups = []
        real = socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: lookups.append(host) or real(host, *a, **k))
        with pytest.raises(OSError):  # transformers: no such repo or directory, offline
            by_hand.get_tokenizer()
        monkeypatch.setattr(socket, "getaddrinfo", real)
        assert [h for h in lookups if "huggingface" in str(h)] == []
        service.close("success").result()
