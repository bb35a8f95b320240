"""tinker-cookbook's supervised recipe, unchanged, against ``skyrl-sdk serve``.

    pip install --no-deps tinker-cookbook
    pip install blobfile chz datasets tiktoken termcolor aiohttp pillow pyrage
    python examples/cookbook_sl.py                     # tiny model, the cookbook's example chats
    python examples/cookbook_sl.py --model ./my-hf-model
    python examples/cookbook_sl.py --base-url http://127.0.0.1:8000 --model ./tiny-hf  # your own server

It starts ``skyrl-sdk serve`` as a separate process (as you would in a terminal), waits for
its banner, points the cookbook at it (base_url, TINKER_API_KEY=tml-...), trains one epoch
of LoRA SFT on the cookbook's example conversations and prints the train NLL per step. With
``--base-url`` it trains on a server you started yourself (``--model``: the directory that
server serves), whose console (the banner's link) shows the loss falling while it trains.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, state_dir: Path) -> subprocess.Popen:
    """``skyrl-sdk serve`` in a child process; returns once its banner says it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyrl_sdk.cli", "serve", "--model", model, "--port", str(port),
         "--state-dir", str(state_dir)],
        stderr=subprocess.PIPE, text=True,
    )
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "listening on" in line:
            print(line, end="")
            # keep draining its stderr so the server never blocks on a full pipe
            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
            return proc
    proc.wait()
    raise SystemExit(f"skyrl-sdk serve did not start (exit {proc.returncode}):\n{''.join(lines)}")


def conversations_file(workdir: Path, limit: int | None) -> str:
    source = importlib.resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    if limit is None:
        return str(source)
    subset = workdir / "conversations.jsonl"
    subset.write_text("".join(source.read_text().splitlines(keepends=True)[:limit]))
    return str(subset)


def train(model: str, base_url: str, workdir: Path, conversations: str, batch_size: int, test_size: int) -> None:
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train as sl_train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon",
                                            max_length=512, batch_size=batch_size,
                                            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = sl_train.Config(
        log_path=str(workdir / "log"), model_name=model, recipe_name="skyrl_sdk_example",
        renderer_name="role_colon", lora_rank=8, learning_rate=5e-3, base_url=base_url,
        eval_every=3, save_every=3, num_epochs=1,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=conversations,
                                                    test_size=test_size),
    )
    asyncio.run(sl_train.main(config))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF model directory (default: tiny, exported)")
    parser.add_argument("--workdir", default="./cookbook-sl-out", help="logs, checkpoints, server state")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=None, help="use only the first N conversations")
    parser.add_argument("--base-url", default=None,
                        help="train on this running skyrl-sdk serve instead of starting one (needs --model)")
    args = parser.parse_args(argv)
    if args.base_url and args.model is None:
        parser.error("--base-url needs --model: the model directory that server serves (its --model)")

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:  # no model hub here: the cookbook needs a directory as model and tokenizer
        import skyrl_sdk

        model = str(workdir / "tiny-hf")
        with skyrl_sdk.Backend(model="tiny") as backend:
            backend.save_weights_for_sampler(model, overwrite=True)
    os.environ.setdefault("TINKER_API_KEY", "tml-local")  # the client insists on a tml- key
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    test_size = min(16, max(1, (args.conversations or 128) // 4))
    conversations = conversations_file(workdir, args.conversations)
    if args.base_url:
        train(model, args.base_url, workdir, conversations, args.batch_size, test_size)
    else:
        port = free_port()
        server = start_server(model, port, workdir / "state")
        try:
            train(model, f"http://127.0.0.1:{port}", workdir, conversations, args.batch_size, test_size)
        finally:
            server.terminate()
            server.wait(timeout=60)
    metrics = [json.loads(line) for line in (workdir / "log" / "metrics.jsonl").read_text().splitlines()]
    nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    print("train NLL per step:", " ".join(f"{x:.3f}" for x in nll))


if __name__ == "__main__":
    main()
