"""Test helpers for skyrl-sdk, its engine plugins and third-party loss plugins.

Data builders give the same datums for the same seed everywhere, so a plugin's tests can
compare against ours. The comparison helpers accept torch tensors or numpy arrays. The
pytest fixtures are plain functions: import them into a ``conftest.py``::

    from skyrl_sdk.testing import sft_data, tiny_backend  # noqa: F401

``fresh_plugins`` and ``plugin_site`` let a plugin's tests install it (or a broken variant)
through a real entry point into a temporary site directory, without pip.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .errors import install_hint

try:
    import pytest
except ImportError as exc:  # pytest is not a runtime dependency
    raise ImportError(f"skyrl_sdk.testing needs pytest: {install_hint('testing')}") from exc

from . import types
from .models.tiny_vlm import make_tiny_vlm  # noqa: F401  (a tiny random vision-language model, offline)


def make_sft_data(lengths: Sequence[int], seed: int = 0, vocab: int = 256, shifted: bool = False) -> list[types.Datum]:
    """Datums with random tokens and weights; targets are random unless ``shifted`` (next token)."""
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        targets = seq[1:] if shifted else rng.integers(0, vocab, n)
        weights = (rng.random(n) > 0.3).astype(np.float32)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": targets, "weights": weights},
        ))
    return data


def make_rl_data(
    lengths: Sequence[int], seed: int = 0, vocab: int = 256, with_logprobs: bool = True
) -> list[types.Datum]:
    """RL datums: the first third of each sequence is "prompt" (advantage 0), sampler logprobs near -5.8."""
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        adv = rng.normal(size=n).astype(np.float32)
        adv[: n // 3] = 0.0
        inputs: dict[str, Any] = {"target_tokens": seq[1:], "advantages": adv}
        if with_logprobs:
            inputs["logprobs"] = (-5.8 + 0.3 * rng.normal(size=n)).astype(np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return data


def make_group_data(
    groups: Sequence[tuple[int, int]] = ((24, 3), (30, 4)), seed: int = 0, vocab: int = 256, odd_cases: bool = True,
) -> list[types.Datum]:
    """RL datums shaped like GRPO groups, in a shuffled order: each ``(prompt length, group
    size)`` gives that many datums on one random prompt, each with its own completion (3-9
    tokens). ``odd_cases`` adds a singleton, a pair sharing only an 18-token head, an exact
    duplicate and a strict prefix of another datum. Every position (prompt included) carries
    a weight, an advantage, sampler logprobs and reference logprobs (for a KL term)."""
    rng = np.random.default_rng(seed)
    seqs = []
    for prompt_len, size in groups:
        prompt = rng.integers(0, vocab, prompt_len)
        seqs += [np.concatenate([prompt, rng.integers(0, vocab, int(rng.integers(3, 10)))]) for _ in range(size)]
    if odd_cases:
        head = rng.integers(0, vocab, 18)
        seqs += [rng.integers(0, vocab, 21), np.concatenate([head, rng.integers(0, vocab, 6)]),
                 np.concatenate([head, rng.integers(0, vocab, 9)]), seqs[0].copy(), seqs[1][:-2].copy()]
    data = []
    for i in rng.permutation(len(seqs)):
        seq = np.append(seqs[i], rng.integers(0, vocab))  # model_input = seq[:-1], targets = seq[1:]
        n = len(seq) - 1
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
            "target_tokens": seq[1:], "weights": (rng.random(n) > 0.2).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
            "logprobs": (-5.8 + 0.3 * rng.normal(size=n)).astype(np.float32),
            "ref_logprobs": (-5.8 + 0.3 * rng.normal(size=n)).astype(np.float32),
        }))
    return data


def grads_of(backend: Any) -> dict[str, torch.Tensor]:
    """Accumulated gradients of an in-process (local-engine) Backend's trainable parameters."""
    return {n: p.grad.detach().clone() for n, p in backend.engine.runner.named_trainable() if p.grad is not None}


def weights_of(backend: Any) -> dict[str, torch.Tensor]:
    """Trainable parameters of an in-process (local-engine) Backend."""
    return {n: p.detach().clone() for n, p in backend.engine.runner.named_trainable()}


def assert_tensors_close(
    a: Mapping[str, Any], b: Mapping[str, Any], atol: float, rtol: float = 0.0, what: str = ""
) -> None:
    """Same keys, and every pair of tensors (torch or numpy) close; the message names the key."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        torch.testing.assert_close(
            torch.as_tensor(np.asarray(a[k]) if not isinstance(a[k], torch.Tensor) else a[k]),
            torch.as_tensor(np.asarray(b[k]) if not isinstance(b[k], torch.Tensor) else b[k]),
            atol=atol, rtol=rtol, msg=functools.partial(_keyed_message, f"{what} {k}"),
        )


def _keyed_message(where: str, message: str) -> str:
    return f"{where}: {message}".strip()


def assert_outputs_close(out_a: types.ForwardBackwardOutput, out_b: types.ForwardBackwardOutput, atol: float) -> None:
    """Per-datum outputs of two forward/forward_backward results agree."""
    assert len(out_a.loss_fn_outputs) == len(out_b.loss_fn_outputs)
    for i, (x, y) in enumerate(zip(out_a.loss_fn_outputs, out_b.loss_fn_outputs, strict=True)):
        assert x.keys() == y.keys(), i
        for k in x:
            np.testing.assert_allclose(x[k].to_numpy(), y[k].to_numpy(), atol=atol, rtol=0, err_msg=f"datum {i} {k}")


def assert_metrics_close(
    a: Mapping[str, float], b: Mapping[str, float], rtol: float = 1e-5, atol: float = 1e-5
) -> None:
    """Same metric keys, values close; the timing figures (``engines.throughput.THROUGHPUT_KEYS``:
    tokens per second, MFU, seconds) are compared by key only (two runs never take the same time)."""
    from .engines.throughput import without_throughput

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    a, b = without_throughput(dict(a)), without_throughput(dict(b))
    for k in a:
        assert abs(a[k] - b[k]) <= atol + rtol * abs(b[k]), (k, a[k], b[k])


@contextlib.contextmanager
def count_micro_batches() -> Iterator[list[int]]:
    """Count the micro-batch boundaries of the in-process calls this thread makes inside the
    block: a call cut into k micro-batches adds k - 1 (the list holds the running total).

    A test that claims a result does not depend on micro-batching checks with it that more
    than one micro-batch ran (engines computing in other processes, such as ``fsdp``, add none).
    """
    from .engines.turns import count_boundaries

    with count_boundaries() as seen:
        yield seen


@contextlib.contextmanager
def _around(owner: type, method: str, wrapper: Callable[[Callable[[], Any]], Any]) -> Iterator[None]:
    """``owner.method`` runs as ``wrapper(call)`` inside the block (every instance, every thread)."""
    real = getattr(owner, method)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrapper(functools.partial(real, self, *args, **kwargs))

    setattr(owner, method, wrapped)
    try:
        yield
    finally:
        setattr(owner, method, real)


def around_micro_batches(wrapper: Callable[[Callable[[], Any]], Any]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, every micro-batch an in-process runner computes (on any thread) runs as
    ``wrapper(compute)``: ``compute()`` runs its forward (and backward) and returns its per-token
    outputs, which ``wrapper`` returns. A test measures (saved tensors), holds (a scheduler
    test) or records (the thread) around each micro-batch."""
    from .engines.runner import ModelRunner

    return _around(ModelRunner, "_run_micro_batch", wrapper)


def around_image_decodes(wrapper: Callable[[Callable[[], Any]], Any]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, every image a call decodes (on any thread) is decoded by
    ``wrapper(decode)``, which returns what ``decode()`` returned: a test holds or records there."""
    from .models.images import ImageInputs

    return _around(ImageInputs, "_decode", wrapper)


def prepared_call(backend: Any, data: Sequence[Any], loss_fn: str, loss_fn_config: Any = None,
                  *, backward: bool = True) -> tuple[list[types.Datum], Any]:
    """The datums and resolved loss that ``backend.forward_backward`` (``backward=False``:
    ``forward``) hands its engine: checked, a loss's prepare pass run. To drive
    ``backend.engine.run`` without the Backend around it."""
    from .engines.turns import run_to_end

    with backend._slot.call("testing.prepared_call"):
        return run_to_end(backend._prepare(data, loss_fn, loss_fn_config, backward=backward))


@contextlib.contextmanager
def training_call_in_progress(backend: Any) -> Iterator[None]:
    """Hold ``backend`` as a training call in progress does (its call slot), from this thread:
    for tests of what must not wait for training, such as a sampler that runs apart."""
    with backend._slot.call("testing.training_call_in_progress"):
        yield


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads: CPU kernels round differently with another thread
    count (~3e-6 on gradients), which an engine comparison should not measure."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def sft_data() -> list[types.Datum]:
    """Five SFT datums of uneven lengths (51 tokens) for the tiny model."""
    return make_sft_data([7, 12, 3, 20, 9], seed=1)


@pytest.fixture
def tiny_backend() -> Iterator[Any]:
    """A policy Backend on the built-in tiny model (seed 0), closed after the test."""
    from .backend import Backend

    with Backend(model="tiny", seed=0) as backend:
        yield backend


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty plugin cache and no ``SKYRL_SDK_PLUGINS`` before and after the test; what the
    test declared with ``skyrl_sdk.register_loss`` (and its siblings) is forgotten after it."""
    from . import hooks
    from .plugins import manager as plugins

    monkeypatch.delenv(plugins.ENV_VAR, raising=False)
    declared = list(hooks.DECLARED)
    plugins.reset()
    yield
    hooks.DECLARED[:] = declared
    plugins.reset()


@pytest.fixture
def plugin_site(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """A temporary 'site-packages' on ``sys.path``; yields
    ``install(dist, modules, entry_points, version="1.2.3")``: ``modules`` maps module names to
    source, ``entry_points`` maps ``skyrl_sdk`` entry-point names to ``module[:object]``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    installed: list[str] = []

    def install(dist: str, modules: Mapping[str, str], entry_points: Mapping[str, str], version: str = "1.2.3") -> None:
        for module, source in modules.items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            installed.append(module)
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[skyrl_sdk]\n{lines}")

    yield install
    for module in installed:
        sys.modules.pop(module, None)
