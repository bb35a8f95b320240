"""tinker-cookbook's supervised training loop, unmodified, against ``skyrl-sdk serve``, offline.

The base model is ``tiny`` exported as a Hugging Face directory (the cookbook names its
model and its tokenizer by that one path); the renderer is ``role_colon``; the data is
the conversations file bundled inside the cookbook package.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources

import pytest

pytest.importorskip("tinker")
cookbook = pytest.importorskip("tinker_cookbook", reason="pip install --no-deps tinker-cookbook (see docs/server.md)")

from _server_harness import API_KEY, ServerThread
from skyrl_sdk import Backend


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "tiny-hf"
    with Backend(model="tiny") as b:
        b.save_weights_for_sampler(directory)
    return directory


@pytest.mark.slow
def test_cookbook_supervised_loop(tmp_path, tiny_dir, monkeypatch):
    import tinker
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    conversations = resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with ServerThread(tmp_path / "state", models=[str(tiny_dir)]) as srv:
        common = ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=str(tiny_dir), renderer_name="role_colon", max_length=512, batch_size=16,
            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
        )
        config = train.Config(
            log_path=str(tmp_path / "log"), model_name=str(tiny_dir), recipe_name="skyrl_sdk_test",
            renderer_name="role_colon",
            dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(conversations),
                                                        test_size=16),
            learning_rate=5e-3, lora_rank=8, base_url=srv.url, eval_every=3, save_every=3, num_epochs=1,
        )
        asyncio.run(train.main(config))

        metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
        nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
        assert len(nll) == 7  # 112 training conversations / batch 16
        assert nll[-1] < nll[0]
        assert any(k.startswith("test/") or k.startswith("eval") or "nll" in k and k != "train_mean_nll"
                   for m in metrics for k in m)
        final = [json.loads(line) for line in (tmp_path / "log" / "checkpoints.jsonl").read_text().splitlines()][-1]
        rest = tinker.RestClient(base_url=srv.url, api_key=API_KEY)
        run_id = final["state_path"].split("/")[2]
        listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert final["state_path"] in listed and final["sampler_path"] in listed


@pytest.mark.slow
def test_cookbook_rl_loop(tmp_path, tiny_dir, monkeypatch):
    """The cookbook's RL loop (synthetic arithmetic environment): sampling through fresh
    sampling clients each step, importance-sampling updates, checkpoints."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with ServerThread(tmp_path / "state", models=[str(tiny_dir)]) as srv:
        config = train.Config(
            learning_rate=1e-3, model_name=str(tiny_dir), recipe_name="skyrl_sdk_test", max_tokens=8,
            dataset_builder=ArithmeticDatasetBuilder(batch_size=4, group_size=4, n_batches=3,
                                                     model_name_for_tokenizer=str(tiny_dir),
                                                     renderer_name="role_colon"),
            log_path=str(tmp_path / "log"), eval_every=0, save_every=2, renderer_name="role_colon",
            base_url=srv.url, lora_rank=4,
        )
        asyncio.run(train.main(config))
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "optim/kl_sample_train_v1" in m]
    assert len(steps) == 3
    # the sampler's logprobs are the trainer's: no train/sample mismatch
    assert all(abs(m["optim/kl_sample_train_v1"]) < 1e-3 for m in steps)


def _parity_dataset_builder(**kwargs):
    """The arithmetic dataset with a reward the tiny random model earns half the time (an even
    number of characters in its answer), so groups are mixed and the advantages are not zero."""
    from functools import partial

    import chz
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import (
        ArithmeticDataset,
        ArithmeticDatasetBuilder,
        ArithmeticEnv,
    )
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class ParityEnv(ArithmeticEnv):
        def check_answer(self, sample_str: str) -> bool:
            return len(sample_str) % 2 == 0

    class ParityDataset(ArithmeticDataset):
        def _make_env_group_builder(self, rng):
            return ProblemGroupBuilder(env_thunk=partial(ParityEnv, 1, 2, renderer=self.renderer,
                                                         require_stop_sequence_for_format=False),
                                       num_envs=self.group_size)

    @chz.chz
    class ParityDatasetBuilder(ArithmeticDatasetBuilder):
        async def __call__(self):
            renderer = renderers.get_renderer(self.renderer_name, tokenizer=get_tokenizer(self.model_name_for_tokenizer))
            return ParityDataset(batch_size=self.batch_size, renderer=renderer, group_size=self.group_size,
                                 n_batches=self.n_batches), None

    return ParityDatasetBuilder(**kwargs)


@pytest.mark.slow
def test_cookbook_async_rl_with_its_default_loss(tmp_path, tiny_dir, monkeypatch):
    """The cookbook's async RL (``AsyncConfig``, sampling up to one step ahead of training)
    with its default loss, ``stable_reinforce``: sampling clients record their sequences,
    every datum carries provenance, and the server resolves it against its session's records."""
    from tinker_cookbook.rl import train

    from skyrl_sdk.losses import calls as calls_module  # where a call's provenance is resolved

    assert train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=4).loss_fn == "stable_reinforce"
    resolved = []  # the datums whose provenance the server checked against its records

    def counting(datums, records):
        out = resolve(datums, records)
        resolved.extend(out)
        return out

    resolve = calls_module.resolve_provenance
    monkeypatch.setattr(calls_module, "resolve_provenance", counting)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with ServerThread(tmp_path / "state", models=[str(tiny_dir)]) as srv:
        config = train.Config(
            learning_rate=1e-3, model_name=str(tiny_dir), recipe_name="skyrl_sdk_test", max_tokens=8,
            dataset_builder=_parity_dataset_builder(batch_size=4, group_size=4, n_batches=4,
                                                    model_name_for_tokenizer=str(tiny_dir),
                                                    renderer_name="role_colon"),
            log_path=str(tmp_path / "log"), eval_every=0, save_every=0, renderer_name="role_colon",
            base_url=srv.url, lora_rank=4,
            async_config=train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=4),
        )
        asyncio.run(train.main(config))
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "optim/kl_sample_train_v1" in m]
    assert len(steps) >= 3
    assert all(m["grad_norm"] > 0 for m in steps if m["env/all/by_group/frac_mixed"] > 0)
    assert sum(m["env/all/by_group/frac_mixed"] > 0 for m in steps) >= 2
    assert len(resolved) >= 16 * len(steps)  # 4 groups of 4 per step, every datum with provenance
    assert all(float(d.loss_fn_inputs["sampled_mask"].array.sum()) > 0 for d in resolved)
