"""The plugin manager: built-ins, real entry points, failure isolation, duplicates, restriction.

Third-party plugins are real installed distributions: each test writes a module and a
``*.dist-info`` folder (``METADATA`` + ``entry_points.txt``) into a temporary directory on
``sys.path``, which ``importlib.metadata`` finds exactly like a pip-installed package.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import attrs
import pytest

from skyrl_sdk import builtin_plugins
from skyrl_sdk.errors import DuplicateRegistrationError, PluginError
from skyrl_sdk.plugins import manager
from skyrl_sdk.plugins.registry import Registry

HOOKS = ("skyrl_sdk_register_losses", "skyrl_sdk_register_dialects", "skyrl_sdk_register_engines")


@pytest.fixture(autouse=True)
def _fresh(fresh_plugins):
    """Each test starts and ends with an empty plugin cache and no SKYRL_SDK_PLUGINS."""


@pytest.fixture
def site(plugin_site):
    return plugin_site


def loss_plugin(name: str, extra: str = "") -> str:
    """Source of a plugin module registering a cross-entropy-like loss called ``name``."""
    return f"""
        import skyrl_sdk
        from skyrl_sdk.losses import LossOutput

        def fn(batch, config):
            return LossOutput(loss=-batch.target_logprobs.sum())

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(register):
            register({name!r}, fn, description="test loss", required_inputs=("target_tokens",))
            {extra}
    """


def info_of(name: str) -> manager.PluginInfo:
    return next(p for p in builtin_plugins.get_plugins().plugins if p.name == name)


# ---- built-ins ---------------------------------------------------------------------------


def test_builtins_are_registered_through_the_same_hooks():
    loaded = builtin_plugins.get_plugins()
    for module_name in builtin_plugins.builtin_plugin_names():
        module = sys.modules[module_name]
        assert loaded.manager.get_plugin(module_name).origin is module  # its attributed view
        info = info_of(module_name)
        assert (info.package, info.builtin, info.error) == ("skyrl-sdk", True, None)
    impls = {impl.plugin_name for impl in loaded.manager.hook.skyrl_sdk_register_losses.get_hookimpls()}
    assert "skyrl_sdk.losses.sft" in impls
    registry = loaded.registry
    assert registry.owners[("loss", "cross_entropy")] == "skyrl_sdk.losses.sft"
    assert registry.owners[("dialect", "tinker")] == "skyrl_sdk.losses.dialects"
    assert registry.owners[("dialect", "native")] == "skyrl_sdk.losses.dialects"
    assert "loss:cross_entropy" in info_of("skyrl_sdk.losses.sft").registered


def test_builtins_come_first_and_are_cached():
    loaded = builtin_plugins.get_plugins()
    names = [p.name for p in loaded.plugins]
    assert names[: len(builtin_plugins.builtin_plugin_names())] == list(builtin_plugins.builtin_plugin_names())
    assert builtin_plugins.get_plugins() is loaded
    manager.reset()
    assert builtin_plugins.get_plugins() is not loaded


def test_a_failing_builtin_is_not_hidden(site):
    site("unused-dist", {"skyrl_fake_builtin": loss_plugin("fake_builtin", "raise RuntimeError('boom')")}, {})
    import skyrl_fake_builtin

    with pytest.raises(RuntimeError, match="boom"):
        manager.load_plugins((*builtin_plugins.builtin_plugins(), skyrl_fake_builtin))


# ---- real entry points -------------------------------------------------------------------


def test_reinforce_found_through_its_real_entry_point():
    pytest.importorskip("skyrl_sdk_reinforce", reason="pip install -e plugins/skyrl-sdk-reinforce")
    info = info_of("reinforce")
    assert (info.package, info.builtin, info.error) == ("skyrl-sdk-reinforce", False, None)
    assert info.version == "0.1.0"
    assert info.registered == ("loss:reinforce",)
    assert builtin_plugins.get_registry().owners[("loss", "reinforce")] == "reinforce"


def test_installed_plugin_registers_all_three_kinds(site):
    site(
        "skyrl-fake-all",
        {
            "skyrl_fake_all": loss_plugin("fake_all_loss") + """
        def convert(loss_fn, loss_fn_config, role):
            return ("fake_all_loss", {}) if loss_fn == "alias" else None

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_dialects(register):
            register("fake_dialect", convert, description="test dialect")

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_engines(register):
            register("fake_engine", lambda **kw: kw, description="test engine")
        """
        },
        {"fake_all": "skyrl_fake_all"},
        version="4.5.6",
    )
    info = info_of("fake_all")
    assert (info.package, info.version, info.builtin, info.error) == ("skyrl-fake-all", "4.5.6", False, None)
    assert info.registered == ("loss:fake_all_loss", "dialect:fake_dialect", "engine:fake_engine")
    registry = builtin_plugins.get_registry()
    assert registry.dialects["fake_dialect"].convert("alias", None, "policy") == ("fake_all_loss", {})
    assert registry.engines["fake_engine"].factory(model="m") == {"model": "m"}


def test_entry_point_may_name_an_object(site):
    source = loss_plugin("fake_obj_loss") + """
        class Holder:
            skyrl_sdk_register_losses = staticmethod(skyrl_sdk_register_losses)

        holder = Holder()
    """
    site("skyrl-fake-obj", {"skyrl_fake_obj": source}, {"fake_obj": "skyrl_fake_obj:holder"})
    assert "fake_obj_loss" in builtin_plugins.get_registry().losses


# ---- failure isolation -------------------------------------------------------------------


def test_plugin_that_fails_to_import_is_reported_and_skipped(site):
    site("skyrl-fake-broken", {"skyrl_fake_broken": "raise ImportError('needs libfoo')\n"},
         {"broken": "skyrl_fake_broken"}, version="0.0.1")
    site("skyrl-fake-good", {"skyrl_fake_good": loss_plugin("fake_good_loss")}, {"good": "skyrl_fake_good"})
    broken = info_of("broken")
    assert (broken.package, broken.version, broken.builtin, broken.registered) == (
        "skyrl-fake-broken", "0.0.1", False, ()
    )
    assert "import failed" in broken.error and "needs libfoo" in broken.error
    assert info_of("good").error is None
    assert "fake_good_loss" in builtin_plugins.get_registry().losses


def test_plugin_that_raises_while_registering_is_rolled_back(site):
    partial = loss_plugin("fake_partial", "raise RuntimeError('half way')")
    site("skyrl-fake-partial", {"skyrl_fake_partial": partial}, {"a_partial": "skyrl_fake_partial"})
    # Loads after a_partial (sorted by name) and claims the same name: fine once rolled back.
    site("skyrl-fake-after", {"skyrl_fake_after": loss_plugin("fake_partial")}, {"b_after": "skyrl_fake_after"})
    loaded = builtin_plugins.get_plugins()
    info = info_of("a_partial")
    assert info.registered == () and info.package == "skyrl-fake-partial"
    assert "registration failed" in info.error and "half way" in info.error
    assert loaded.registry.owners[("loss", "fake_partial")] == "b_after"
    assert "a_partial" not in loaded.registry.registered_by
    assert loaded.manager.get_plugin("a_partial") is None
    assert "cross_entropy" in loaded.registry.losses


def test_plugin_with_a_wrong_hook_signature_is_isolated(site):
    bad = """
        import skyrl_sdk

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(register, unknown_argument):
            pass
    """
    site("skyrl-fake-badsig", {"skyrl_fake_badsig": bad}, {"badsig": "skyrl_fake_badsig"})
    site("skyrl-fake-fine", {"skyrl_fake_fine": loss_plugin("fake_fine_loss")}, {"fine": "skyrl_fake_fine"})
    assert "registration failed" in info_of("badsig").error
    assert "fake_fine_loss" in builtin_plugins.get_registry().losses


def test_malformed_registration_in_a_plugin_is_reported(site):
    bad = """
        import skyrl_sdk

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(register):
            register("fake_bad_role", lambda b, c: None, description="x",
                     required_inputs=("target_tokens",), role="judge")
    """
    site("skyrl-fake-bad", {"skyrl_fake_bad": bad}, {"bad": "skyrl_fake_bad"})
    error = info_of("bad").error
    assert "PluginError" in error and "role" in error
    assert "fake_bad_role" not in builtin_plugins.get_registry().losses


def test_a_plugin_that_breaks_the_hook_call_does_not_stop_the_plugins_called_after_it(site):
    """pluggy stops a hook call at the first implementation that raises: the call runs again
    without the broken plugin, so plugins (and built-ins) pluggy would call after it register."""
    site("skyrl-fake-first", {"skyrl_fake_first": loss_plugin("fake_first", "raise RuntimeError('first fails')")
                              .replace("@skyrl_sdk.hookimpl", "@skyrl_sdk.hookimpl(tryfirst=True)")},
         {"zz_first": "skyrl_fake_first"})
    site("skyrl-fake-then", {"skyrl_fake_then": loss_plugin("fake_then")}, {"then": "skyrl_fake_then"})
    loaded = builtin_plugins.get_plugins()
    assert "first fails" in info_of("zz_first").error and "fake_first" not in loaded.registry.losses
    assert loaded.registry.owners[("loss", "fake_then")] == "then"
    assert "cross_entropy" in loaded.registry.losses


def test_a_wrapper_that_never_yields_is_found_and_skipped(site):
    """pluggy's own error names no frame of the plugin: each plugin is then called alone."""
    no_yield = """
        import skyrl_sdk

        @skyrl_sdk.hookimpl(wrapper=True)
        def skyrl_sdk_register_losses(register):
            if False:
                yield
    """
    site("skyrl-fake-noyield", {"skyrl_fake_noyield": no_yield}, {"noyield": "skyrl_fake_noyield"})
    site("skyrl-fake-fine2", {"skyrl_fake_fine2": loss_plugin("fake_fine2")}, {"fine2": "skyrl_fake_fine2"})
    assert "did not yield" in info_of("noyield").error
    assert builtin_plugins.get_registry().owners[("loss", "fake_fine2")] == "fine2"


# ---- hooks are called through pluggy -------------------------------------------------------


def test_hookwrappers_old_and_new_style_run_around_the_other_implementations(site):
    log = "EVENTS = []\n"
    wrappers = """
        import skyrl_sdk
        from skyrl_fake_log import EVENTS

        def fn(batch, config):
            return None

        @skyrl_sdk.hookimpl(hookwrapper=True)
        def skyrl_sdk_register_losses(register):
            EVENTS.append("old-style before")
            outcome = yield
            EVENTS.append(f"old-style after ({len(outcome.get_result())} results)")
            register("from_old_style_wrapper", fn, description="x", required_inputs=())
    """
    new_style = """
        import skyrl_sdk
        from skyrl_fake_log import EVENTS

        def fn(batch, config):
            return None

        class Plugin:
            @skyrl_sdk.hookimpl(wrapper=True)
            def skyrl_sdk_register_losses(self, register):
                EVENTS.append("new-style before")
                results = yield
                EVENTS.append("new-style after")
                register("from_new_style_wrapper", fn, description="x", required_inputs=())
                return results

        plugin = Plugin()
    """
    plain = """
        import skyrl_sdk
        from skyrl_fake_log import EVENTS

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(register):
            EVENTS.append("plain")
    """
    site("skyrl-fake-log", {"skyrl_fake_log": log}, {})
    site("skyrl-fake-old", {"skyrl_fake_old": wrappers}, {"old": "skyrl_fake_old"})
    site("skyrl-fake-new", {"skyrl_fake_new": new_style}, {"new": "skyrl_fake_new:plugin"})
    site("skyrl-fake-plain", {"skyrl_fake_plain": plain}, {"plain": "skyrl_fake_plain"})
    registry = builtin_plugins.get_registry()
    events = sys.modules["skyrl_fake_log"].EVENTS
    # wrappers: the later registered runs outermost; both around every plain implementation
    assert events == ["old-style before", "new-style before", "plain", "new-style after",
                      "old-style after (0 results)"], events
    assert registry.owners[("loss", "from_old_style_wrapper")] == "old"
    assert registry.owners[("loss", "from_new_style_wrapper")] == "new"
    assert info_of("new").registered == ("loss:from_new_style_wrapper",)


def test_tryfirst_and_trylast_order_the_calls(site):
    site("skyrl-fake-log2", {"skyrl_fake_log2": "EVENTS = []\n"}, {})

    def plugin(name: str, mark: str = "") -> str:
        return loss_plugin(f"fake_{name}", f"import skyrl_fake_log2; skyrl_fake_log2.EVENTS.append({name!r})") \
            .replace("@skyrl_sdk.hookimpl", f"@skyrl_sdk.hookimpl({mark})")

    # loaded a, b, c, d; pluggy calls tryfirst, then the rest latest-registered first, then trylast
    for name, mark in (("a", ""), ("b", "tryfirst=True"), ("c", "trylast=True"), ("d", "")):
        site(f"skyrl-fake-{name}", {f"skyrl_fake_{name}": plugin(name, mark)}, {name: f"skyrl_fake_{name}"})
    registry = builtin_plugins.get_registry()
    assert sys.modules["skyrl_fake_log2"].EVENTS == ["b", "d", "a", "c"]
    assert [registry.owners[("loss", f"fake_{n}")] for n in "abcd"] == list("abcd")
    # the registry keeps load order, whatever order the calls ran in
    assert [n for n in registry.losses if n.startswith("fake_")] == ["fake_a", "fake_b", "fake_c", "fake_d"]


def test_a_registration_made_through_a_helper_belongs_to_the_calling_plugin(site):
    helper = """
        def fn(batch, config):
            return None

        def register_all(register, prefix):
            register(prefix + "_via_helper", fn, description="x", required_inputs=())
    """
    caller = """
        import skyrl_sdk
        from skyrl_fake_helper import register_all

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(register):
            register_all(register, "fake_caller")
    """
    site("skyrl-fake-helper", {"skyrl_fake_helper": helper}, {})
    site("skyrl-fake-caller", {"skyrl_fake_caller": caller}, {"caller": "skyrl_fake_caller"})
    assert builtin_plugins.get_registry().owners[("loss", "fake_caller_via_helper")] == "caller"


def test_register_kept_and_called_after_the_hook_is_refused(site):
    keeper = """
        import skyrl_sdk

        KEPT = []

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(register):
            KEPT.append(register)
    """
    site("skyrl-fake-keeper", {"skyrl_fake_keeper": keeper}, {"keeper": "skyrl_fake_keeper"})
    builtin_plugins.get_plugins()
    with pytest.raises(PluginError, match="outside a skyrl_sdk hook implementation"):
        sys.modules["skyrl_fake_keeper"].KEPT[0]("late", lambda b, c: None, description="x", required_inputs=())


def test_a_plugin_handed_to_the_manager_after_the_hooks_ran_is_refused_not_ignored():
    """The hooks are not historic (pluggy refuses wrappers on historic hooks), so a late
    ``manager.register`` would never be called: it is refused, naming the plugin and the ways in."""

    import skyrl_sdk

    class Late:
        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(self, register):
            register("late_loss", lambda b, c: None, description="x", required_inputs=())

    loaded = builtin_plugins.get_plugins()
    before = loaded.manager.get_plugins()
    with pytest.raises(PluginError, match=r"plugin 'late'.*already ran.*@skyrl_sdk.register_loss.*reset\(\)"):
        loaded.manager.register(Late(), name="late")
    assert loaded.manager.get_plugins() == before and "late_loss" not in loaded.registry.losses


# ---- duplicates --------------------------------------------------------------------------


def test_two_plugins_registering_one_loss_name_raise_naming_both(site):
    site("skyrl-fake-one", {"skyrl_fake_one": loss_plugin("fake_dup")}, {"first": "skyrl_fake_one"})
    site("skyrl-fake-two", {"skyrl_fake_two": loss_plugin("fake_dup")}, {"second": "skyrl_fake_two"})
    with pytest.raises(DuplicateRegistrationError) as excinfo:
        builtin_plugins.get_plugins()
    message = str(excinfo.value)
    assert "'fake_dup'" in message and "'first'" in message and "'second'" in message


def test_plugin_reusing_a_builtin_name_raises_naming_both(site):
    site("skyrl-fake-shadow", {"skyrl_fake_shadow": loss_plugin("cross_entropy")}, {"shadow": "skyrl_fake_shadow"})
    with pytest.raises(DuplicateRegistrationError, match="skyrl_sdk.losses.sft.*shadow"):
        builtin_plugins.get_plugins()


def test_duplicate_engine_and_dialect_names_raise():
    registry = Registry()
    registry.register_engine("p1", "eng", lambda **kw: None)
    with pytest.raises(DuplicateRegistrationError, match="engine 'eng'.*'p1'.*'p2'"):
        registry.register_engine("p2", "eng", lambda **kw: None)
    registry.register_dialect("p1", "dia", lambda *a: None)
    with pytest.raises(DuplicateRegistrationError, match="dialect 'dia'.*'p1'.*'p2'"):
        registry.register_dialect("p2", "dia", lambda *a: None)


# ---- SKYRL_SDK_PLUGINS -------------------------------------------------------------------


@pytest.fixture
def two_plugins(site):
    site("skyrl-fake-a", {"skyrl_fake_a": loss_plugin("fake_a_loss")}, {"a": "skyrl_fake_a"})
    site("skyrl-fake-b", {"skyrl_fake_b": loss_plugin("fake_b_loss")}, {"b": "skyrl_fake_b"})


def _third_party() -> set[str]:
    return {p.name for p in builtin_plugins.get_plugins().plugins if not p.builtin}


def test_env_unset_loads_every_plugin(two_plugins):
    assert {"a", "b"} <= _third_party()


def test_env_empty_loads_builtins_only(two_plugins, monkeypatch):
    monkeypatch.setenv(manager.ENV_VAR, "")
    assert _third_party() == set()
    assert "cross_entropy" in builtin_plugins.get_registry().losses


def test_env_names_restrict_by_entry_point_or_distribution(two_plugins, monkeypatch):
    monkeypatch.setenv(manager.ENV_VAR, "a")
    assert _third_party() == {"a"}
    assert "fake_b_loss" not in builtin_plugins.get_registry().losses
    monkeypatch.setenv(manager.ENV_VAR, " skyrl-fake-b , a ")
    assert _third_party() == {"a", "b"}


# ---- malformed registrations fail at registration ----------------------------------------


def _ok_fn(batch, config):
    return None


@attrs.frozen
class GoodConfig:
    beta: float = 0.1


@attrs.frozen
class NoDefaultConfig:
    beta: float


@attrs.frozen
class BadDefaultConfig:
    beta: float = attrs.field(default=-1.0, validator=attrs.validators.ge(0))


class PlainConfig:
    beta = 0.1


BASE = dict(description="d", required_inputs=("target_tokens",))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fn=42), "fn must be callable"),
        (dict(fn=lambda batch: None), "fn must accept"),
        (dict(config_cls=PlainConfig), "config_cls must be an attrs class"),
        (dict(config_cls=GoodConfig()), "config_cls must be an attrs class"),
        (dict(config_cls=NoDefaultConfig), r"config fields \['beta'\] need defaults"),
        (dict(config_cls=BadDefaultConfig), "defaults fails"),
        (dict(role="judge"), "role must be one of"),
        (dict(optional_inputs=("target_tokens", "weights")), r"\['target_tokens'\] are both required and optional"),
        (dict(required_inputs="target_tokens"), "required_inputs must be a list"),
        (dict(outputs=("logprobs", "")), "outputs must be a list"),
        (dict(prepare=3), "prepare must be callable"),
        (dict(description=None), "description must be a string"),
        (dict(name=""), "name must be a non-empty string"),
    ],
)
def test_malformed_loss_registration_raises_plugin_error(kwargs, match):
    args = {"name": "fake_loss", "fn": _ok_fn, **BASE, **kwargs}
    registry = Registry()
    with pytest.raises(PluginError, match=match) as excinfo:
        registry.register_loss("myplugin", args.pop("name"), args.pop("fn"), **args)
    assert not isinstance(excinfo.value, DuplicateRegistrationError)
    assert registry.losses == {} and registry.owners == {}


def test_wellformed_loss_registration_records_owner():
    registry = Registry()
    spec = registry.register_loss("myplugin", "fake_loss", _ok_fn, config_cls=GoodConfig, **BASE)
    assert spec.config_defaults() == {"beta": 0.1}
    assert registry.owners[("loss", "fake_loss")] == "myplugin"
    assert registry.registered_by == {"myplugin": ["loss:fake_loss"]}


@pytest.mark.parametrize("method", ["register_engine", "register_dialect"])
def test_non_callable_engine_or_dialect_raises(method):
    with pytest.raises(PluginError, match="must be callable"):
        getattr(Registry(), method)("myplugin", "x", "not callable")


def test_plugin_info_to_dict_is_json_ready():
    info = manager.PluginInfo("n", "pkg", "1", False, ("loss:x",), None)
    assert info.to_dict() == {
        "name": "n", "package": "pkg", "version": "1", "builtin": False, "registered": ["loss:x"], "error": None,
    }


def test_plugin_with_a_misspelt_hook_is_reported(site):
    typo = """
        import skyrl_sdk

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_loss(register):
            pass
    """
    site("skyrl-fake-typo", {"skyrl_fake_typo": typo}, {"typo": "skyrl_fake_typo"})
    error = info_of("typo").error
    assert "unknown hook" in error and "skyrl_sdk_register_loss'" in error and "skyrl_sdk_register_losses" in error
    assert builtin_plugins.get_plugins().manager.get_plugin("typo") is None


# ---- decorators: sugar over the hooks ------------------------------------------------------
def test_a_decorated_loss_in_this_process_is_registered_under_its_module():
    import skyrl_sdk
    from skyrl_sdk import Backend
    from skyrl_sdk.losses import LossOutput
    from skyrl_sdk.testing import make_sft_data

    before = builtin_plugins.get_registry()
    assert "decorated_ce" not in before.losses

    @skyrl_sdk.register_loss("decorated_ce", description="test", required_inputs=("target_tokens",),
                             optional_inputs=("weights",))
    def decorated_ce(batch, config):
        return LossOutput(loss=-(batch.target_logprobs * batch.mask()).sum())

    registry = builtin_plugins.get_registry()  # a new declaration rebuilds the registry
    assert registry.losses["decorated_ce"].fn is decorated_ce
    assert registry.owners[("loss", "decorated_ce")] == __name__
    info = info_of(__name__)
    assert (info.package, info.registered, info.error) == ("(declared in this process)", ("loss:decorated_ce",), None)
    data = make_sft_data([5, 7], seed=3)
    with Backend(model="tiny") as backend:
        ours = backend.forward(data, "decorated_ce").metrics["loss:sum"]
        theirs = backend.forward(data, "cross_entropy").metrics["loss:sum"]
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert builtin_plugins.get_registry() is registry  # no new declaration: the same registry


def test_an_entry_point_plugin_may_declare_with_decorators_only(site, monkeypatch):
    source = """
        import skyrl_sdk
        from skyrl_sdk.losses import LossOutput

        @skyrl_sdk.register_loss("decorated_plugin_loss", description="test", required_inputs=("target_tokens",))
        def fn(batch, config):
            return LossOutput(loss=-batch.target_logprobs.sum())

        @skyrl_sdk.register_dialect("decorated_dialect")
        def convert(loss_fn, loss_fn_config, role):
            return ("decorated_plugin_loss", {}) if loss_fn == "alias" else None
    """
    site("skyrl-fake-decorated", {"skyrl_fake_decorated": source}, {"decorated": "skyrl_fake_decorated"})
    registry = builtin_plugins.get_registry()
    assert registry.owners[("loss", "decorated_plugin_loss")] == "decorated"
    assert registry.dialect_spec("decorated_dialect").convert("alias", None, "policy") == ("decorated_plugin_loss", {})
    info = info_of("decorated")
    assert (info.package, info.error) == ("skyrl-fake-decorated", None)
    assert info.registered == ("loss:decorated_plugin_loss", "dialect:decorated_dialect")
    # left out by SKYRL_SDK_PLUGINS: its declarations are left out too, though its module was imported
    monkeypatch.setenv(manager.ENV_VAR, "")
    assert "decorated_plugin_loss" not in builtin_plugins.get_registry().losses


def test_a_malformed_declaration_fails_its_module_alone():
    import skyrl_sdk

    skyrl_sdk.register_loss("bad_decl", description="test", required_inputs="target_tokens")(lambda b, c: None)
    skyrl_sdk.register_loss("good_decl_same_module", description="test", required_inputs=())(lambda b, c: None)
    registry = builtin_plugins.get_registry()
    assert "bad_decl" not in registry.losses and "good_decl_same_module" not in registry.losses
    assert "required_inputs must be a list" in info_of(__name__).error
    assert "cross_entropy" in registry.losses


# ---- attribution from pluggy's records, one registration path, hooks called once ----------------
def test_registrations_are_attributed_without_looking_at_the_stack(site, monkeypatch):
    """No frame is read: with ``inspect.currentframe`` unavailable (as on Pythons without frame
    support) registrations, helpers and wrappers included, still go to their plugins."""
    import inspect

    helper = """
        def fn(batch, config):
            return None

        def register_all(register, prefix):
            register(prefix + "_via_helper", fn, description="x", required_inputs=())
    """
    caller = """
        import skyrl_sdk
        from skyrl_fake_helper2 import fn, register_all

        @skyrl_sdk.hookimpl
        def skyrl_sdk_register_losses(register):
            register_all(register, "fake_framed")

        @skyrl_sdk.hookimpl(wrapper=True)
        def skyrl_sdk_register_dialects(register):
            result = yield
            register("fake_framed_dialect", lambda name, config, role: None)
            return result
    """
    site("skyrl-fake-helper2", {"skyrl_fake_helper2": helper}, {})
    site("skyrl-fake-framed", {"skyrl_fake_framed": caller}, {"framed": "skyrl_fake_framed"})

    def no_frames():
        raise AssertionError("the plugin manager read a stack frame")

    monkeypatch.setattr(inspect, "currentframe", no_frames)
    registry = builtin_plugins.get_registry()
    assert registry.owners[("loss", "fake_framed_via_helper")] == "framed"
    assert registry.owners[("dialect", "fake_framed_dialect")] == "framed"
    assert registry.owners[("loss", "cross_entropy")] == "skyrl_sdk.losses.sft"
    source = (Path(manager.__file__).parent).glob("*.py")
    assert not [p.name for p in source if re.search(r"currentframe|_getframe|f_locals|f_back|tb_frame", p.read_text())]


def test_a_failure_is_charged_to_the_plugin_whose_implementation_raised_it(site):
    """Called inside another plugin's wrapper, through a helper of a third module: the plugin
    that raised is skipped, the wrapper's plugin is not."""
    wrapper = """
        import skyrl_sdk

        def fn(batch, config):
            return None

        @skyrl_sdk.hookimpl(wrapper=True)
        def skyrl_sdk_register_losses(register):
            result = yield
            register("fake_outer_loss", fn, description="x", required_inputs=())
            return result
    """
    site("skyrl-fake-boom", {"skyrl_fake_boom": loss_plugin("fake_boom", "raise RuntimeError('boom')")},
         {"boom": "skyrl_fake_boom"})
    site("skyrl-fake-outer", {"skyrl_fake_outer": wrapper}, {"outer": "skyrl_fake_outer"})
    registry = builtin_plugins.get_registry()
    assert "boom" in info_of("boom").error and info_of("outer").error is None
    assert registry.owners[("loss", "fake_outer_loss")] == "outer" and "fake_boom" not in registry.losses


def test_declarations_are_registered_through_pluggy_like_any_hook(site):
    """The decorators take no second path: a module's declarations are a plugin of their own in
    pluggy's manager, called by the same hook calls (a wrapper of another plugin runs around them)."""
    import skyrl_sdk
    from skyrl_sdk.losses import LossOutput

    wrapper = """
        import skyrl_sdk
        SEEN = []

        @skyrl_sdk.hookimpl(wrapper=True)
        def skyrl_sdk_register_losses(register):
            results = yield
            import skyrl_sdk.builtin_plugins as b  # noqa: F401
            SEEN.append("after the others")
            return results
    """
    site("skyrl-fake-around", {"skyrl_fake_around": wrapper}, {"around": "skyrl_fake_around"})

    @skyrl_sdk.register_loss("declared_through_pluggy", description="x", required_inputs=("target_tokens",))
    def declared(batch, config):
        return LossOutput(loss=batch.target_logprobs.sum())

    loaded = builtin_plugins.get_plugins()
    impls = loaded.manager.hook.skyrl_sdk_register_losses.get_hookimpls()
    assert __name__ in {impl.plugin_name for impl in impls}
    assert loaded.manager.get_plugin(__name__).origin is None  # a module that only declares
    assert loaded.registry.owners[("loss", "declared_through_pluggy")] == __name__
    assert loaded.registry.losses["declared_through_pluggy"].fn is declared


def test_hooks_run_once_per_process_and_a_later_declaration_calls_only_its_own(site):
    """hooks.py says each hook is called once per process: a decorator used after the registry
    was built registers its object by calling its own module's hooks alone."""
    import skyrl_sdk
    from skyrl_sdk.losses import LossOutput

    site("skyrl-fake-calls", {"skyrl_fake_calls": "CALLS = []\n"}, {})
    counting = loss_plugin("fake_counted", "import skyrl_fake_calls; skyrl_fake_calls.CALLS.append(1)")
    site("skyrl-fake-counted", {"skyrl_fake_counted": counting}, {"counted": "skyrl_fake_counted"})
    before = builtin_plugins.get_registry()
    calls = sys.modules["skyrl_fake_calls"].CALLS
    assert calls == [1]

    @skyrl_sdk.register_loss("declared_later", description="x", required_inputs=("target_tokens",))
    def later(batch, config):
        return LossOutput(loss=batch.target_logprobs.sum())

    after = builtin_plugins.get_registry()
    assert calls == [1]  # no hook ran again
    assert after is not before and "declared_later" not in before.losses  # a new registry; the old one unchanged
    assert after.losses["declared_later"].fn is later and after.owners[("loss", "declared_later")] == __name__
    assert after.owners[("loss", "fake_counted")] == "counted" and "cross_entropy" in after.losses
    assert info_of(__name__).registered == ("loss:declared_later",)
    assert builtin_plugins.get_registry() is after
    loaded = builtin_plugins.get_plugins()
    plugins = loaded.manager.get_plugins()

    @skyrl_sdk.register_loss("fake_counted", description="x", required_inputs=())  # taken by plugin 'counted'
    def clash(batch, config):
        return None

    for _ in range(2):  # refused each time it is looked at, changing nothing
        with pytest.raises(DuplicateRegistrationError, match=r"loss 'fake_counted' is registered by both plugin "
                                                             rf"'counted' and plugin '{__name__}'"):
            builtin_plugins.get_registry()
        assert loaded.registry is after and loaded.manager.get_plugins() == plugins
    assert calls == [1]
