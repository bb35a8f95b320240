"""Samplers are plugins: the hook, Backend(sampler=...), the built-in ``transformers`` sampler.

A third-party sampler is a real installed distribution (a module + ``*.dist-info`` with an
entry point in a temporary directory on ``sys.path``), found like a pip-installed package.
"""

from __future__ import annotations

import pytest

import skyrl_sdk
from skyrl_sdk import builtin_plugins as plugins
from skyrl_sdk import errors, types
from skyrl_sdk.sampling import TransformersSampler

ECHO_PLUGIN = """
    import skyrl_sdk
    from skyrl_sdk import types

    CALLS = []

    class EchoSampler:
        def __init__(self, *, engine, config):
            CALLS.append(("init", engine.info.vocab_size, dict(config)))

        def sample(self, prompts, params, num_samples, *, prompt_logprobs, topk_prompt_logprobs):
            CALLS.append(("sample", [p.tolist() for p in prompts], params.max_tokens, num_samples,
                          prompt_logprobs, topk_prompt_logprobs))
            seq = lambda p: types.SampledSequence(tokens=p.tolist(), logprobs=[0.0] * len(p), stop_reason="length")
            return [types.SampleOutput(sequences=[seq(p)] * num_samples) for p in prompts]

        def close(self):
            CALLS.append(("close",))

    @skyrl_sdk.hookimpl
    def skyrl_sdk_register_samplers(register):
        register("echo", EchoSampler, description="returns the prompt")
"""


@pytest.fixture(autouse=True)
def _fresh(fresh_plugins):
    """An empty plugin cache before and after each test."""


@pytest.fixture
def install(plugin_site):
    """``install(module, source)``: a distribution ``<module>-dist`` whose entry point is the module."""
    return lambda module, source: plugin_site(f"{module}-dist", {module: source}, {module: module}, version="1.0")


def test_builtin_transformers_sampler_registers_through_the_hook():
    registry = plugins.get_registry()
    assert registry.samplers["transformers"].factory is TransformersSampler
    assert registry.owners[("sampler", "transformers")] == "skyrl_sdk.sampling"
    assert "skyrl_sdk.sampling" in plugins.builtin_plugin_names()


def test_a_plugin_sampler_serves_backend_sample(install):
    install("echo_sampler", ECHO_PLUGIN)
    import echo_sampler

    with skyrl_sdk.Backend(sampler="echo", sampler_config={"gpu_memory": 0.5}) as b:
        assert echo_sampler.CALLS == []  # built lazily, on the first sample
        out = b.sample([[1, 2, 3]], {"max_tokens": 4}, num_samples=2, topk_prompt_logprobs=2)
        assert [s.tokens for s in out[0].sequences] == [[1, 2, 3], [1, 2, 3]]
        b.sample([[5]], types.SamplingParams())
        with pytest.raises(errors.InputError, match="prompt 0"):  # the Backend still validates first
            b.sample([[99999]], types.SamplingParams())
    assert echo_sampler.CALLS == [
        ("init", 320, {"gpu_memory": 0.5}),
        ("sample", [[1, 2, 3]], 4, 2, False, 2),
        ("sample", [[5]], 16, 1, False, 0),
        ("close",),
    ]


def test_unknown_sampler_and_bad_config_are_clear_errors():
    with pytest.raises(errors.UnknownNameError, match=r"unknown sampler 'vllm'; available: \['transformers'\]"):
        skyrl_sdk.Backend(sampler="vllm")
    with pytest.raises(errors.InputError, match="sampler_config: expected a mapping"):
        skyrl_sdk.Backend(sampler_config=[("a", 1)])
    with skyrl_sdk.Backend(sampler_config={"tensor_parallel": 2}) as b:
        with pytest.raises(errors.InputError, match=r"'transformers' sampler takes no options, got \['tensor_"):
            b.sample([[1, 2]], types.SamplingParams(max_tokens=1))


def test_malformed_and_duplicate_sampler_registrations(install):
    install("bad_sampler", """
        import skyrl_sdk

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_samplers(register):
            register("bad", "not callable")
    """)
    loaded = plugins.get_plugins()
    info = next(p for p in loaded.plugins if p.name == "bad_sampler")
    assert "factory must be callable" in info.error and "bad" not in loaded.registry.samplers
    plugins.reset()
    install("dup_sampler", """
        import skyrl_sdk

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_samplers(register):
            register("transformers", lambda **kw: None)
    """)
    with pytest.raises(errors.DuplicateRegistrationError, match="sampler 'transformers'"):
        plugins.get_plugins()
