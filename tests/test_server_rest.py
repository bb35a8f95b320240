"""The RestClient's export, download, publish, time-to-live and session-search routes through
the unmodified tinker client and tinker-cookbook's ``weights.download``, with two owners:
what one owner exports loads in transformers and peft with the trained weights, what one
publishes the other can read but never list, change or delete."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import ServerThread, next_token_datum
from skyrl_sdk import Backend
from skyrl_sdk.models.loading import quiet_peft_wrap
from skyrl_sdk.server.compute.exports import DownloadLinks
from skyrl_sdk.server.config import read_api_keys
from skyrl_sdk.server.wire.tinker_paths import TinkerPath

#: the client marks some RestClient calls experimental; calling them is what these tests are for
pytestmark = pytest.mark.filterwarnings("ignore::tinker.ExperimentalWarning")

ALICE, BOB = "tml-alice", "tml-bob"
TOKENS = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    with ServerThread(tmp_path_factory.mktemp("state"), api_keys=read_api_keys(keys)) as srv:
        alice = srv.service_client(api_key=ALICE)
        trainer = alice.create_lora_training_client(base_model="tiny", rank=4).result(timeout=HANG_S)
        trainer.forward_backward([next_token_datum(8)], "cross_entropy").result(timeout=HANG_S)
        trainer.optim_step(tt.AdamParams(learning_rate=5e-2)).result(timeout=HANG_S)
        bob = srv.service_client(api_key=BOB)
        yield dict(srv=srv, alice=alice, bob=bob, trainer=trainer, rest_a=srv.rest_client(api_key=ALICE),
                   rest_b=srv.rest_client(api_key=BOB))
        alice.close("success").result()
        bob.close("success").result()


def trained_logprobs(trainer) -> np.ndarray:
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]})
    return trainer.forward([datum], "cross_entropy").result(timeout=HANG_S).loss_fn_outputs[0]["logprobs"].to_numpy()


def hf_logprobs(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([TOKENS[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()


def test_an_export_downloads_and_loads_in_transformers_and_peft(world, tmp_path):
    import peft
    import transformers

    path = world["trainer"].save_weights_external("final").result(timeout=HANG_S).path
    assert path == f"tinker://{world['trainer'].model_id}/external_weights/final"
    links = world["rest_a"].get_external_weights_urls(path).result(timeout=HANG_S)
    assert {"config.json", "model.safetensors", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors"} <= set(links.urls)
    for name, url in links.urls.items():  # no key: the link is the credential
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(url, str(tmp_path / name))
    want = trained_logprobs(world["trainer"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    np.testing.assert_allclose(hf_logprobs(merged), want, atol=1e-4)
    with Backend(model="tiny") as base_backend:  # the served base, as its owner would have it
        base_backend.save_weights_for_sampler(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    with quiet_peft_wrap():  # peft reads a deprecated transformers attribute while wrapping
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    np.testing.assert_allclose(hf_logprobs(adapted), want, atol=1e-4)


def test_the_cookbook_downloads_a_training_checkpoint(world, tmp_path, monkeypatch):
    """weights.download on a training checkpoint: load it into a new training client, export it
    encrypted to a key of the cookbook's own, download, decrypt, delete the export."""
    import transformers
    from tinker_cookbook import weights

    monkeypatch.setenv("TINKER_API_KEY", ALICE)
    state = world["trainer"].save_state("for-download").result(timeout=HANG_S).path
    out = weights.download(tinker_path=state, output_dir=str(tmp_path / "dl"), base_url=world["srv"].url)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    np.testing.assert_allclose(hf_logprobs(model), trained_logprobs(world["trainer"]), atol=1e-4)
    listed = [c.tinker_path for c in world["rest_a"].list_user_checkpoints().result(timeout=HANG_S).checkpoints]
    assert state in listed and not any("/external_weights/download" in p for p in listed)  # the export was deleted


def test_encrypted_exports_and_bad_recipients(world, tmp_path):
    import pyrage

    identity = pyrage.x25519.Identity.generate()
    path = world["trainer"].save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]).result(timeout=HANG_S).path
    links = world["rest_a"].get_external_weights_urls(path).result(timeout=HANG_S).urls
    assert links and all(name.endswith(".age") for name in links)
    urllib.request.urlretrieve(links["config.json.age"], str(tmp_path / "c.age"))
    pyrage.decrypt_file(str(tmp_path / "c.age"), str(tmp_path / "config.json"), [identity])
    assert '"LlamaForCausalLM"' in (tmp_path / "config.json").read_text()
    with pytest.raises(tinker.RequestFailedError, match=r"age_encryption_recipients\[0\]: not an age or SSH public key"):
        world["trainer"].save_weights_external("bad", age_encryption_recipients=["age1nope"]).result(timeout=HANG_S)


def test_download_links_are_checked(world):
    path = world["trainer"].save_weights_external("linked").result(timeout=HANG_S).path
    url = world["rest_a"].get_external_weights_urls(path).result(timeout=HANG_S).urls["config.json"]
    base, _, name = url.rpartition("/")
    for bad in (base + "/../../model.safetensors", base[:-3] + "xyz/" + name, base + "/.skyrl_checkpoint"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(bad)
        assert caught.value.code == 404
    with pytest.raises(tinker.NotFoundError):  # Bob cannot sign links to Alice's export
        world["rest_b"].get_external_weights_urls(path).result(timeout=HANG_S)
    rt = world["srv"].runtime
    links = DownloadLinks(rt.catalog.link_record, rt.downloads.directory, ttl_s=-1.0)  # an expired link: 404
    target = asyncio.run_coroutine_threadsafe(rt.catalog.export_target("alice", path), rt.loop).result(HANG_S)
    token = links.sign(target, "http://x")["urls"]["config.json"].split("/")[-2]
    with pytest.raises(Exception, match="this download link has expired"):
        links.file(token, "config.json")
    with pytest.raises(Exception, match="unknown or expired download link"):  # another process's key
        rt.downloads.file(token, "config.json")


def _fetch(url: str) -> int:
    """The status of a GET of ``url`` (a download link: no key)."""
    try:
        with urllib.request.urlopen(url) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_link_dies_with_its_export_when_it_expires_or_is_made_again(world):
    """Issue 41, items 11 and 12. Before: an expired export's signed links still downloaded (6 of
    6) while every listing answered 404, and a link signed for an export kept serving after the
    export was deleted and made again under its name (the new content). Now a link names the
    export as it was when signed and is checked against the catalog when used."""
    trainer, rest_a, store = world["trainer"], world["rest_a"], world["srv"].runtime.store
    path = trainer.save_weights_external("short-export").result(timeout=HANG_S).path
    urls = rest_a.get_external_weights_urls(path).result(timeout=HANG_S).urls
    assert {_fetch(url) for url in urls.values()} == {200}
    rest_a.set_checkpoint_ttl_from_tinker_path(path, 3600).result(timeout=HANG_S)
    store.update_checkpoint(TinkerPath.parse(path), expires_at=time.time() - 1)  # the hour has passed, not swept yet
    assert path not in {c.tinker_path for c in rest_a.list_user_checkpoints().result(timeout=HANG_S).checkpoints}
    assert {_fetch(url) for url in urls.values()} == {404}

    path = trainer.save_weights_external("again").result(timeout=HANG_S).path
    old = rest_a.get_external_weights_urls(path).result(timeout=HANG_S).urls["config.json"]
    assert _fetch(old) == 200
    rest_a.delete_checkpoint_from_tinker_path(path).result(timeout=HANG_S)
    assert trainer.save_weights_external("again").result(timeout=HANG_S).path == path  # made again, same name
    assert _fetch(old) == 404
    new = rest_a.get_external_weights_urls(path).result(timeout=HANG_S).urls["config.json"]
    assert new != old and _fetch(new) == 200


def test_signing_links_keeps_nothing_in_memory(world):
    """Issue 41, item 6. Before: every external_weights_urls call kept its link (~2 KiB) for an
    hour, with no cap: 3000 calls held 6.1 MB. Links are now stateless (signed, checked against
    the catalog when used): asking for 1000 keeps no memory in the server."""
    import gc
    import tracemalloc

    import httpx

    path = world["trainer"].save_weights_external("many-links").result(timeout=HANG_S).path
    tp = TinkerPath.parse(path)
    route = f"/api/v1/training_runs/{tp.run_id}/checkpoints/external_weights/{tp.name}/external_weights_urls"
    with httpx.Client(base_url=world["srv"].url, headers={"X-API-Key": ALICE}, timeout=HANG_S) as http:
        assert http.get(route).status_code == 200
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for _ in range(1000):
                http.get(route).raise_for_status()
            gc.collect()
            grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
        finally:
            tracemalloc.stop()
    assert grown < 256 * 1024, grown


def test_publishing_lets_other_owners_read_but_never_list_or_change(world):
    trainer, rest_a, rest_b = world["trainer"], world["rest_a"], world["rest_b"]
    sampler_path = trainer.save_weights_for_sampler("shared").result(timeout=HANG_S).path
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_weights_info_by_tinker_path(sampler_path).result(timeout=HANG_S)
    with pytest.raises(tinker.NotFoundError):  # only the owner publishes
        rest_b.publish_checkpoint_from_tinker_path(sampler_path).result(timeout=HANG_S)
    rest_a.publish_checkpoint_from_tinker_path(sampler_path).result(timeout=HANG_S)
    mine = {c.tinker_path: c for c in rest_a.list_user_checkpoints().result(timeout=HANG_S).checkpoints}
    assert mine[sampler_path].public
    assert rest_b.get_weights_info_by_tinker_path(sampler_path).result(timeout=HANG_S).lora_rank == 4
    bobs = world["bob"].create_sampling_client(model_path=sampler_path).result(timeout=HANG_S)
    assert len(bobs.sample(tt.ModelInput.from_ints(TOKENS), 1, tt.SamplingParams(max_tokens=2))
               .result(timeout=HANG_S).sequences) == 1
    assert sampler_path not in {c.tinker_path for c in rest_b.list_user_checkpoints().result(timeout=HANG_S).checkpoints}
    assert rest_b.list_training_runs().result(timeout=HANG_S).training_runs == []
    for change in (lambda: rest_b.delete_checkpoint_from_tinker_path(sampler_path),
                   lambda: rest_b.unpublish_checkpoint_from_tinker_path(sampler_path),
                   lambda: rest_b.set_checkpoint_ttl_from_tinker_path(sampler_path, 7200)):
        with pytest.raises(tinker.NotFoundError):
            change().result(timeout=HANG_S)
    rest_a.unpublish_checkpoint_from_tinker_path(sampler_path).result(timeout=HANG_S)
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_weights_info_by_tinker_path(sampler_path).result(timeout=HANG_S)
    # a published training checkpoint: Bob trains from it (a run of his own), Alice's export stays hers
    state = trainer.save_state("shared-state").result(timeout=HANG_S).path
    export = trainer.save_weights_external("shared-export").result(timeout=HANG_S).path
    rest_a.publish_checkpoint_from_tinker_path(state).result(timeout=HANG_S)
    rest_a.publish_checkpoint_from_tinker_path(export).result(timeout=HANG_S)
    bobs_run = world["bob"].create_training_client_from_state(state).result(timeout=HANG_S)
    np.testing.assert_allclose(trained_logprobs(bobs_run), trained_logprobs(trainer), atol=1e-5)
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_external_weights_urls(export).result(timeout=HANG_S)


def test_a_checkpoints_time_to_live_expires_and_deletes_it(world):
    trainer, rest_a = world["trainer"], world["rest_a"]
    store = world["srv"].runtime.store
    path = trainer.save_state("short-lived").result(timeout=HANG_S).path
    tp = TinkerPath.parse(path)
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds: expected an integer in 3600..315360000"):
        rest_a.set_checkpoint_ttl_from_tinker_path(path, 60).result(timeout=HANG_S)
    rest_a.set_checkpoint_ttl_from_tinker_path(path, 3600).result(timeout=HANG_S)
    listed = {c.tinker_path: c for c in rest_a.list_user_checkpoints().result(timeout=HANG_S).checkpoints}
    assert abs(listed[path].expires_at.timestamp() - (time.time() + 3600)) < 600
    rest_a.set_checkpoint_ttl_from_tinker_path(path, None).result(timeout=HANG_S)  # never expires again
    assert store.delete_expired(now=time.time() + 10**9) == 0 and store.checkpoint_dir(tp).is_dir()
    rest_a.set_checkpoint_ttl_from_tinker_path(path, 3600).result(timeout=HANG_S)
    assert store.delete_expired(now=time.time() + 3601) == 1  # the sweep (every minute, and at start-up)
    assert not store.checkpoint_dir(tp).exists()
    assert path not in {c.tinker_path for c in rest_a.list_user_checkpoints().result(timeout=HANG_S).checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rest_a.get_weights_info_by_tinker_path(path).result(timeout=HANG_S)


def test_sessions_search_filters_pages_and_stays_the_callers(world):
    srv = world["srv"]
    named = [tinker.ServiceClient(base_url=srv.url, api_key=ALICE, display_name=f"nightly run {i}",
                                  user_metadata={"team": "rl"} if i else None) for i in range(3)]
    ids = [client.holder.get_session_id() for client in named]
    bobs = tinker.ServiceClient(base_url=srv.url, api_key=BOB, display_name="nightly run of bob")
    bobs_id = bobs.holder.get_session_id()
    named[0].close("success").result()
    rest_a, rest_b = world["rest_a"], world["rest_b"]
    found = rest_a.search_sessions(tt.SessionSearchRequest(display_name="NIGHTLY")).result(timeout=HANG_S).sessions
    assert [s.session_id for s in found] == ids[::-1]  # newest first
    assert found[-1].status.type == "client_finished" and found[0].status.type == "active"
    by_meta = rest_a.search_sessions(tt.SessionSearchRequest(user_metadata={"team": "rl"})).result(timeout=HANG_S)
    assert len(by_meta.sessions) == 2
    active = rest_a.search_sessions(tt.SessionSearchRequest(display_name="nightly", statuses=[
        tt.ActiveSessionStatusQuery()])).result(timeout=HANG_S)
    assert [s.session_id for s in active.sessions] == ids[:0:-1]
    pages, request = [], tt.SessionSearchRequest(display_name="nightly", limit=2)
    while True:
        page = rest_a.search_sessions(request).result(timeout=HANG_S)
        pages.append([s.session_id for s in page.sessions])
        if page.next_cursor is None:
            break
        request = request.model_copy(update={"cursor": page.next_cursor})
    assert pages == [[s.session_id for s in found[:2]], [found[2].session_id]]
    everyone = rest_b.search_sessions(tt.SessionSearchRequest(display_name="nightly", owner=tt.AccessibleSearchOwner())
                                      ).result(timeout=HANG_S)
    assert [(s.session_id, s.owner) for s in everyone.sessions] == [(bobs_id, "bob")]
    for client in [*named[1:], bobs]:
        client.close("success").result()
