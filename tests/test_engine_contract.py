"""The engine contract is enforced when an engine is built, not when a method is first called:
``Engine`` is an abstract base class, and the registry refuses an engine class that lacks
a required method."""

from __future__ import annotations

import pytest

from skyrl_sdk import builtin_plugins
from skyrl_sdk.engines import Engine, LocalEngine
from skyrl_sdk.errors import InputError, PluginError
from skyrl_sdk.plugins.registry import Registry


class Complete(Engine):
    name = "complete"

    def run(self, data, loss, *, backward):
        return None

    def optim_step(self, params, grad_scale=1.0):
        return {}

    def zero_grad(self):
        return None


class NoZeroGrad(Engine):
    def run(self, data, loss, *, backward):
        return None

    def optim_step(self, params, grad_scale=1.0):
        return {}


class OnlyRun(Engine):
    def run(self, data, loss, *, backward):
        return None


def test_an_engine_missing_a_required_method_fails_at_construction_naming_it():
    with pytest.raises(TypeError, match="zero_grad"):
        NoZeroGrad()
    with pytest.raises(TypeError, match="optim_step") as excinfo:
        OnlyRun()
    assert "zero_grad" in str(excinfo.value)


def test_the_required_methods_are_exactly_the_three_of_the_contract():
    assert Engine.__abstractmethods__ == frozenset({"run", "optim_step", "zero_grad"})
    assert not LocalEngine.__abstractmethods__


def test_a_complete_engine_builds_and_its_optional_features_refuse_by_name(tmp_path):
    engine = Complete()
    with pytest.raises(InputError, match="engine 'complete' cannot save a training state"):
        engine.save_state(tmp_path)
    with pytest.raises(InputError, match="engine 'complete' cannot sample"):
        engine.weights_source()  # what a sampler reads
    engine.close()  # optional, and a no-op by default


def test_the_registry_refuses_an_abstract_engine_class_at_registration():
    registry = Registry()
    with pytest.raises(PluginError, match=r"plugin 'p', engine 'broken': NoZeroGrad does not implement .*zero_grad"):
        registry.register_engine("p", "broken", NoZeroGrad)
    assert "broken" not in registry.engines
    registry.register_engine("p", "fine", Complete)  # a complete class, or any other factory, is taken
    registry.register_engine("p", "factory", lambda **kw: Complete())


def test_a_plugin_registering_an_abstract_engine_is_reported_and_skipped(fresh_plugins, plugin_site):
    source = """
        import skyrl_sdk
        from skyrl_sdk.engines import Engine

        class Half(Engine):
            def run(self, data, loss, *, backward):
                return None

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_engines(register):
            register("half", Half, description="lacks optim_step and zero_grad")
    """
    plugin_site("skyrl-fake-half", {"skyrl_fake_half": source}, {"half": "skyrl_fake_half"})
    loaded = builtin_plugins.get_plugins()
    info = next(p for p in loaded.plugins if p.name == "half")
    assert "optim_step, zero_grad" in info.error and "half" not in loaded.registry.engines
    assert "local" in loaded.registry.engines
