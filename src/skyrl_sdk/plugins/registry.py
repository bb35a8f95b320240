"""In-memory registries of losses, dialects, engines and samplers, filled by plugins.

Registration is validated here (so a malformed loss fails when its plugin loads, not at
first use), and every entry remembers the plugin that registered it so duplicates can name
both sides.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..errors import DuplicateRegistrationError, PluginError, UnknownNameError, did_you_mean, install_hint
from ..losses.base import DialectSpec, LossSpec
from ..losses.resolve import ResolvedLoss, resolve_loss
from .samplers import Sampler

_ROLES = ("policy", "critic")


@attrs.frozen
class FactorySpec:
    """A registered engine or sampler: what builds it (``factory(**kwargs)``) and a line saying what it is."""

    kind: str
    name: str
    factory: Callable[..., Any]
    description: str = ""


#: What to install for a well-known name that is missing (said with "unknown engine 'fsdp'").
_INSTALL_HINTS = {("engine", "fsdp"): f" (the skyrl-sdk-fsdp plugin has it: {install_hint('fsdp')})",
                  ("sampler", "vllm"): f" (the skyrl-sdk-vllm plugin has it: {install_hint('vllm')})"}


@attrs.define
class Registry:
    losses: dict[str, LossSpec] = attrs.Factory(dict)
    dialects: dict[str, DialectSpec] = attrs.Factory(dict)
    engines: dict[str, FactorySpec] = attrs.Factory(dict)
    samplers: dict[str, FactorySpec] = attrs.Factory(dict)
    #: (kind, name) -> plugin name that registered it
    owners: dict[tuple[str, str], str] = attrs.Factory(dict)
    #: plugin name -> list of "kind:name" it registered
    registered_by: dict[str, list[str]] = attrs.Factory(dict)

    def _claim(self, kind: str, name: str, plugin: str) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r}: {kind} name must be a non-empty string, got {name!r}")
        owner = self.owners.get((kind, name))
        if owner is not None:
            raise DuplicateRegistrationError(
                f"{kind} {name!r} is registered by both plugin {owner!r} and plugin {plugin!r}"
            )
        self.owners[(kind, name)] = plugin
        self.registered_by.setdefault(plugin, []).append(f"{kind}:{name}")

    def add(self, other: Registry) -> None:
        """Take every entry of ``other`` (what one plugin registered), in its order; a name
        taken here already raises :class:`DuplicateRegistrationError` naming both plugins."""
        for (kind, name), plugin in other.owners.items():
            self._claim(kind, name, plugin)
            self._table(kind)[name] = other._table(kind)[name]

    def _table(self, kind: str) -> dict[str, Any]:
        tables: dict[str, dict[str, Any]] = {"loss": self.losses, "dialect": self.dialects, "engine": self.engines,
                                             "sampler": self.samplers}
        return tables[kind]

    # -- losses --------------------------------------------------------------------------
    def register_loss(
        self,
        plugin: str,
        name: str,
        fn: Callable,
        *,
        description: str,
        required_inputs: tuple[str, ...] | list[str],
        optional_inputs: tuple[str, ...] | list[str] = (),
        config_cls: type | None = None,
        outputs: tuple[str, ...] | list[str] = ("logprobs",),
        role: str = "policy",
        prepare: Callable | None = None,
        accepts_topk_targets: bool = False,
        needs_provenance: bool = False,
    ) -> LossSpec:
        where = f"plugin {plugin!r}, loss {name!r}"
        if not callable(fn):
            raise PluginError(f"{where}: fn must be callable, got {type(fn).__name__}")
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = None
        if params is not None and len(params) < 2 and not any(
            p.kind is p.VAR_POSITIONAL for p in params.values()
        ):
            raise PluginError(f"{where}: fn must accept (loss_input, config), it takes {len(params)} argument(s)")
        if role not in _ROLES:
            raise PluginError(f"{where}: role must be one of {_ROLES}, got {role!r}")
        declared = (("required_inputs", required_inputs), ("optional_inputs", optional_inputs), ("outputs", outputs))
        for label, keys in declared:
            if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
                raise PluginError(f"{where}: {label} must be a list of non-empty strings, got {keys!r}")
        overlap = set(required_inputs) & set(optional_inputs)
        if overlap:
            raise PluginError(f"{where}: inputs {sorted(overlap)} are both required and optional")
        if config_cls is not None:
            if not (isinstance(config_cls, type) and attrs.has(config_cls)):
                raise PluginError(f"{where}: config_cls must be an attrs class, got {config_cls!r}")
            missing = [f.name for f in attrs.fields(config_cls) if f.default is attrs.NOTHING]
            if missing:
                raise PluginError(f"{where}: config fields {missing} need defaults")
            try:
                config_cls()
            except Exception as exc:  # defaults must satisfy the validators
                raise PluginError(f"{where}: config_cls() with defaults fails: {exc}") from exc
        if prepare is not None and not callable(prepare):
            raise PluginError(f"{where}: prepare must be callable or None")
        if not isinstance(description, str):
            raise PluginError(f"{where}: description must be a string")
        spec = LossSpec(
            name=name,
            fn=fn,
            description=description,
            required_inputs=tuple(required_inputs),
            optional_inputs=tuple(optional_inputs),
            config_cls=config_cls,
            outputs=tuple(outputs),
            role=role,  # type: ignore[arg-type]
            prepare=prepare,
            accepts_topk_targets=bool(accepts_topk_targets),
            needs_provenance=bool(needs_provenance),
            plugin=plugin,
        )
        self._claim("loss", name, plugin)
        self.losses[name] = spec
        return spec

    # -- dialects ------------------------------------------------------------------------
    def register_dialect(self, plugin: str, name: str, convert: Callable, *, description: str = "") -> DialectSpec:
        if not callable(convert):
            raise PluginError(f"plugin {plugin!r}, dialect {name!r}: convert must be callable")
        spec = DialectSpec(name=name, convert=convert, description=description)
        self._claim("dialect", name, plugin)
        self.dialects[name] = spec
        return spec

    def dialect_spec(self, name: str) -> DialectSpec:
        """The dialect registered as ``name`` (see :meth:`lookup`)."""
        return self.lookup("dialect", name)

    def resolve(self, loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None, dialect: str = "tinker",
                role: str = "policy") -> ResolvedLoss:
        """:func:`~skyrl_sdk.losses.resolve.resolve_loss` with this registry's losses and the
        dialect registered as ``dialect``."""
        return resolve_loss(self.losses, self.dialect_spec(dialect), loss_fn, loss_fn_config, role)

    # -- engines and samplers: factories ------------------------------------------------
    def register_engine(self, plugin: str, name: str, factory: Callable, *, description: str = "") -> FactorySpec:
        return self._register_factory("engine", self.engines, plugin, name, factory, description)

    def register_sampler(self, plugin: str, name: str, factory: Callable, *, description: str = "") -> FactorySpec:
        """A sampler class must subclass :class:`~.samplers.Sampler` (and, as any factory class,
        implement its abstract methods); any other callable's result is checked when the Backend
        builds it (:func:`~.samplers.check_sampler`)."""
        if inspect.isclass(factory) and not issubclass(factory, Sampler):
            raise PluginError(f"plugin {plugin!r}, sampler {name!r}: {factory.__qualname__} must subclass "
                              f"skyrl_sdk.sampling.Sampler (docs/engines.md, Samplers)")
        return self._register_factory("sampler", self.samplers, plugin, name, factory, description)

    def _register_factory(self, kind: str, table: dict, plugin: str, name: str, factory: Callable,
                          description: str) -> FactorySpec:
        if not callable(factory):
            raise PluginError(f"plugin {plugin!r}, {kind} {name!r}: factory must be callable")
        if inspect.isclass(factory) and inspect.isabstract(factory):  # it would fail at every build
            # an abstract class has it; mypy's type[object] does not
            missing = ", ".join(sorted(factory.__abstractmethods__))  # type: ignore[attr-defined]
            raise PluginError(f"plugin {plugin!r}, {kind} {name!r}: {factory.__name__} does not implement the "
                              f"abstract method(s) {missing}")
        if not isinstance(description, str):
            raise PluginError(f"plugin {plugin!r}, {kind} {name!r}: description must be a string")
        spec = FactorySpec(kind=kind, name=name, factory=factory, description=description)
        self._claim(kind, name, plugin)
        table[name] = spec
        return spec

    def engine_spec(self, name: str) -> FactorySpec:
        """The engine registered as ``name`` (see :meth:`lookup`)."""
        return self.lookup("engine", name)

    def sampler_spec(self, name: str) -> FactorySpec:
        """The sampler registered as ``name`` (see :meth:`lookup`)."""
        return self.lookup("sampler", name)

    def lookup(self, kind: str, name: Any) -> Any:
        """The ``kind`` ("dialect", "engine" or "sampler") registered as ``name``, or
        :class:`UnknownNameError` listing the available ones with a "did you mean" for a typo:
        the one message the Backend, the server and the CLI give."""
        table = self._table(kind)
        spec = table.get(name) if isinstance(name, str) else None
        if spec is None:
            raise UnknownNameError(f"unknown {kind} {name!r}; available: {sorted(table)}"
                                   f"{did_you_mean(name, table)}{_INSTALL_HINTS.get((kind, name), '')}")
        return spec
