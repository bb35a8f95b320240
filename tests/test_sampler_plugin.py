"""Samplers are plugins: the hook, Backend(sampler=...), the built-in ``transformers`` sampler,
and the contract the registry and the Backend hold them to (a ``Sampler`` subclass that gets a
``WeightsSource``, never the engine).

A third-party sampler is a real installed distribution (a module + ``*.dist-info`` with an
entry point in a temporary directory on ``sys.path``), found like a pip-installed package.
"""

from __future__ import annotations

import pytest

import skyrl_sdk
from skyrl_sdk import builtin_plugins as plugins
from skyrl_sdk import errors, types
from skyrl_sdk.sampling import Sampler, TransformersSampler

ECHO_PLUGIN = """
    import skyrl_sdk
    from skyrl_sdk import types
    from skyrl_sdk.sampling import Sampler

    CALLS = []

    class EchoSampler(Sampler):
        name = "echo"

        def __init__(self, *, source, config):
            super().__init__(source=source, config=config)
            CALLS.append(("init", type(source).__name__, source.hf_config.vocab_size, dict(config)))

        def sample(self, request):
            CALLS.append(("sample", [p.tolist() for p in request.prompts], request.sampling_params.max_tokens,
                          request.num_samples, request.prompt_logprobs, request.topk_prompt_logprobs,
                          self.source.version))
            seq = lambda p: types.SampledSequence(tokens=p.tolist(), logprobs=[0.0] * len(p), stop_reason="length")
            return [types.SampleOutput(sequences=[seq(p)] * request.num_samples) for p in request.prompts]

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
        assert b.get_info().sampler == "echo"
        out = b.sample([[1, 2, 3]], {"max_tokens": 4}, num_samples=2, topk_prompt_logprobs=2)
        assert [s.tokens for s in out[0].sequences] == [[1, 2, 3], [1, 2, 3]]
        b.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                                        loss_fn_inputs={"target_tokens": [2, 3]})], "cross_entropy")
        b.sample([[5]], types.SamplingParams())  # no step yet: the same weights
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        b.sample([[5]], types.SamplingParams())  # the step moved the version
        with pytest.raises(errors.InputError, match="prompt 0"):  # the Backend still validates first
            b.sample([[99999]], types.SamplingParams())
    assert echo_sampler.CALLS == [
        ("init", "EngineWeights", 320, {"gpu_memory": 0.5}),
        ("sample", [[1, 2, 3]], 4, 2, False, 2, 0),
        ("sample", [[5]], 16, 1, False, 0, 0),
        ("sample", [[5]], 16, 1, False, 0, 1),
        ("close",),
    ]


def test_unknown_sampler_and_bad_config_are_clear_errors(monkeypatch):
    monkeypatch.setenv("SKYRL_SDK_PLUGINS", "")  # the built-ins only, whatever this environment installed
    with pytest.raises(errors.UnknownNameError, match=r"unknown sampler 'vllm'; available: \['transformers'\] "
                                                      r"\(the skyrl-sdk-vllm plugin has it: pip install -e "
                                                      r"\"\.\[lora,server\]\" -e \"plugins/skyrl-sdk-vllm\[gpu\]\""):
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


def test_a_sampler_class_must_subclass_sampler_and_implement_sample(install):
    """The registry holds a sampler class to the contract when its plugin registers: not a
    ``Sampler`` (the old duck-typed shape) or missing ``sample``: refused, naming why."""
    install("duck_sampler", """
        import skyrl_sdk

        class Duck:
            def __init__(self, *, source, config): ...
            def sample(self, request): ...

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_samplers(register):
            register("duck", Duck)
    """)
    install("half_sampler", """
        import skyrl_sdk
        from skyrl_sdk.sampling import Sampler

        class Half(Sampler):
            def describe(self):
                return "half"

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_samplers(register):
            register("half", Half)
    """)
    loaded = plugins.get_plugins()
    errors_by_plugin = {p.name: p.error for p in loaded.plugins}
    assert "Duck must subclass skyrl_sdk.sampling.Sampler" in errors_by_plugin["duck_sampler"]
    assert "Half does not implement the abstract method(s) sample" in errors_by_plugin["half_sampler"]
    assert not {"duck", "half"} & set(loaded.registry.samplers)
    with pytest.raises(TypeError, match="sample"):  # the ABC itself fails when instantiated
        Sampler(source=None, config={})


def test_a_factory_function_must_return_a_sampler(install):
    """A plain function may be the factory; what it returns is checked when the Backend builds it."""
    install("func_sampler", """
        import skyrl_sdk

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_samplers(register):
            register("func", lambda *, source, config: object())
    """)
    with skyrl_sdk.Backend(sampler="func") as b:
        with pytest.raises(errors.PluginError, match="sampler 'func': its factory returned object, not a "
                                                     "skyrl_sdk.sampling.Sampler"):
            b.sample([[1, 2]], types.SamplingParams(max_tokens=1))


def test_request_names_the_options_it_sets_and_refuse_names_each_unserved_one():
    import numpy as np

    from skyrl_sdk.sampling import SampleRequest

    plain = SampleRequest(prompts=[np.array([1, 2])], record_stability_info=True)  # the Backend's, not an option
    assert plain.options_set() == []
    busy = SampleRequest(prompts=[np.array([1, 2])],
                         sampling_params=types.SamplingParams(max_tokens=3, top_k=5, stop=["x"]),
                         num_samples=4, prompt_logprobs=True, topk_prompt_logprobs=2)
    assert busy.options_set() == ["sampling_params.max_tokens", "sampling_params.top_k", "sampling_params.stop",
                                  "num_samples", "prompt_logprobs", "topk_prompt_logprobs"]

    class Narrow(Sampler):
        name = "narrow"

        def sample(self, request):
            self.refuse(request, ["sampling_params.max_tokens", "num_samples"])
            return []

    narrow = Narrow(source=None, config={})
    assert narrow.sample(SampleRequest(prompts=[np.array([1])], sampling_params=types.SamplingParams(max_tokens=2),
                                       num_samples=3)) == []
    with pytest.raises(errors.InputError, match=r"the 'narrow' sampler cannot serve sampling_params.top_k, "
                                                r"sampling_params.stop, prompt_logprobs, topk_prompt_logprobs; of the "
                                                r"options it serves sampling_params.max_tokens, num_samples"):
        narrow.sample(busy)
