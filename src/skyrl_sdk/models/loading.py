"""Model and tokenizer loading: the built-in ``tiny`` model or any local HF directory.

``tiny`` is a small Llama (byte-level tokenizer, 320-token vocabulary) that needs no
network: its config and tokenizer ship in the package and its weights come from the seed,
so the same seed gives bit-identical initial weights on every machine.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..errors import ModelLoadError, did_you_mean, install_hint
from ..types import LoraConfig
from .attention import DEFAULT_ATTN_IMPLEMENTATION
from .value_head import CONFIG_FIELD, VALUE_HEAD, ValueHeadModel, initial_value_head
from .vlm import (
    auto_class,
    check_supported,
    freeze_vision_tower,
    in_vision_tower,
    is_vision_language,
    text_config,
    vision_tower_prefixes,
)
from .weight_files import read_rows, weight_files

if TYPE_CHECKING:
    import peft
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast
    from transformers.models.llama import LlamaConfig
logger = logging.getLogger(__name__)

TINY_NAME = "tiny"
TINY_DIR = Path(__file__).parent.parent / "assets" / "tiny"  # src/skyrl_sdk/assets/tiny
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
TINY_VOCAB_SIZE = 320  # 256 bytes + 3 specials, rounded up for alignment


#: Weights below this size load in well under a second: no "Loading weights" progress bar.
QUIET_LOAD_BYTES = 256 * 1024**2


def _weights_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in directory.glob(pattern))


@contextlib.contextmanager
def _quiet_progress(enabled: bool) -> Iterator[None]:
    """Turn transformers' progress bars off for one small load, then restore the user's setting."""
    from transformers.utils import logging as hf_logging

    if not enabled or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _byte_to_unicode() -> dict[int, str]:
    """A printable unicode character per byte (the usual byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tiny_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS, *, bos: str | None = "<|bos|>",
                         eos: str = "<|eos|>", pad: str = "<|pad|>") -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: token id = byte value, then the special tokens (the tiny
    vision-language models add Qwen's chat and vision markers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    for offset, special in enumerate(special_tokens):
        vocab[special] = 256 + offset
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special_tokens))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        model_max_length=2048,
    )


def tiny_config() -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        architectures=["LlamaForCausalLM"],
    )


@attrs.define
class LoadedModel:
    """A model ready for an engine: the HF module, its tokenizer, and where they came from."""

    module: Any  # transformers PreTrainedModel (possibly wrapped by peft)
    tokenizer: Any
    tokenizer_dir: str | None
    name: str
    role: str
    lora: LoraConfig | None
    #: False: parameters are on the meta device (buffers are real); an engine fills them
    #: from :attr:`weights_dir`'s files and :attr:`generated` (see :func:`load_model`).
    materialized: bool = True
    #: Full initial values of the tensors no checkpoint file holds (LoRA adapters, a new value
    #: head), by the HF model's state-dict names; only when not :attr:`materialized`.
    generated: dict = attrs.field(factory=dict)
    #: The directory the weights come from (``None`` for ``tiny``: generated from the seed).
    weights_dir: str | None = None

    @property
    def config(self) -> PretrainedConfig:
        return hf_model(self.module).config

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.config).vocab_size)

    @property
    def pad_token_id(self) -> int:
        """Padding id for batched rows (the tokenizer's, else 0; padding is never scored)."""
        pad = getattr(self.tokenizer, "pad_token_id", None) if self.tokenizer is not None else None
        return int(pad) if pad is not None else 0

    @property
    def eos_token_id(self) -> int | None:
        """End-of-sequence id: the tokenizer's, else the model config's first one."""
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if eos is None:
            eos = getattr(text_config(self.config), "eos_token_id", None)
            eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        return eos

    @property
    def architecture(self) -> str:
        inner = hf_model(self.module)
        return getattr(inner, "export_architecture", None) or type(inner).__name__


#: config keys that give a model's position limit, in the order they are tried
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def max_positions(config: Any) -> int | None:
    """The longest sequence a model accepts, from its config (a transformers config or its
    config.json as a dict): ``max_position_embeddings`` or an equivalent; ``None`` if it names none.

    Beyond it a model with learned positions (GPT-2) indexes out of its table mid-compute. A
    vision-language model's limit is its language model's (``text_config``)."""
    config = text_config(config)
    for key in POSITION_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def hf_model(module: torch.nn.Module) -> Any:
    """The transformers model inside a possible peft wrapper."""
    get_base = getattr(module, "get_base_model", None)
    return get_base() if callable(get_base) else module


def load_config(name: str) -> tuple[PretrainedConfig, str]:
    """``(config, tokenizer directory)`` of ``tiny`` or a local HF directory, reading no
    weights; a missing or unreadable directory is a :class:`ModelLoadError` naming it."""
    from transformers import AutoConfig

    if name == TINY_NAME:
        return tiny_config(), str(TINY_DIR)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {name!r}: not 'tiny' and not a local directory (no model hub is used; "
            f"pass the path of a Hugging Face model directory){did_you_mean(name, [TINY_NAME])}"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {name!r}: directory has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"model {name!r}: config.json could not be read: {exc}") from None
    check_supported(config, name)
    return config, str(path)


def load_tokenizer(directory: str) -> PreTrainedTokenizerBase | None:
    from transformers import AutoTokenizer

    if Path(directory) == TINY_DIR:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as exc:
        logger.warning("no tokenizer loaded from %s: %s", directory, exc)
        return None


def lora_targets(model: PreTrainedModel | ValueHeadModel, lora: LoraConfig, train_vision_tower: bool = False
                 ) -> list[str]:
    """Names of the Linear modules LoRA should wrap, chosen by their role in the block (none in a
    vision-language model's vision tower unless ``train_vision_tower``)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tower = [] if train_vision_tower else vision_tower_prefixes(model)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or in_vision_tower(name, tower):
            continue
        if out_emb is not None and module is out_emb:
            if lora.train_unembed:
                names.append(name)
            continue
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        parent = model.get_submodule(parent_name) if parent_name else model
        kind = type(parent).__name__.lower()
        if "attention" in kind or "attn" in kind:
            if lora.train_attn:
                names.append(name)
        elif "mlp" in kind or "feedforward" in kind or "expert" in kind:
            if lora.train_mlp:
                names.append(name)
    return names


def apply_lora(model: PreTrainedModel | ValueHeadModel, lora: LoraConfig, seed: int,
               train_vision_tower: bool = False) -> peft.PeftModel:
    """Wrap ``model`` with peft LoRA adapters; only the adapters train."""
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelLoadError(f"LoRA needs peft: {install_hint('lora')}") from exc
    targets = lora_targets(model, lora, train_vision_tower)
    if not targets:
        raise ModelLoadError("LoRA: no Linear modules matched train_attn/train_mlp/train_unembed")
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; it divides a float alpha alike
        lora_dropout=0.0,  # the model runs in eval mode: trainer and sampler must agree
        target_modules=targets,
        bias="none",
    )
    swapped = _cpu_placeholders(model, targets)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.seed if lora.seed is not None else seed)
            wrapped = peft_model(model, config)
    finally:
        for layer, weight in swapped:
            weight.requires_grad_(layer.weight.requires_grad)  # peft froze the placeholder
            layer.weight = weight
    head = getattr(hf_model(wrapped), VALUE_HEAD, None)
    if head is not None:  # a critic's value head is new: it always trains
        head.requires_grad_(True)
    return wrapped


def peft_model(model: torch.nn.Module, config: peft.LoraConfig, adapter_name: str = "default") -> Any:
    """``peft.get_peft_model``: every LoRA wrap goes through here (``apply_lora``, the shared
    base's first adapter; later adapters through :func:`quiet_peft_wrap` too)."""
    import peft

    with quiet_peft_wrap():
        return peft.get_peft_model(model, config, adapter_name=adapter_name)


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """Two warnings of peft's while it wraps a model, silenced for the wrap and those messages only:

    - peft's ``PeftModel.__init__`` (0.21.2) reads ``model.is_gradient_checkpointing``, which
      transformers 5 deprecated with a FutureWarning on every read: about peft's code, and
      nothing the caller does can avoid it.
    - "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter" (LoRA on
      the head of a model whose head is its input embedding, ``train_unembed``): the head is
      adapted alone, on purpose, and the complication peft warns of (a merged export) is
      handled: a merged export writes the adapted head beside the embedding and unties them
      in its config (``engines.export.lora_unties_head``).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"Model has `tie_word_embeddings=True` and a tied layer is part "
                                r"of the adapter", category=UserWarning)
        yield


def _cpu_placeholders(model: torch.nn.Module, targets: list[str]) -> list[tuple[torch.nn.Linear, torch.nn.Parameter]]:
    """Give meta-device target layers a zero-byte CPU weight while peft wraps them.

    peft creates each adapter on the CPU (drawing its initial values from the seeded
    generator, in module order) and then moves it to its base layer's device: with a meta
    base the values would be lost. A broadcast (stride 0) CPU placeholder keeps the adapters
    real and the random draws identical to a fully built model's.
    """
    swapped = []
    for name in targets:
        layer = model.get_submodule(name)
        weight = layer.weight
        if weight.device.type == "meta":
            placeholder = torch.zeros((), dtype=weight.dtype).expand(weight.shape)
            layer.weight = torch.nn.Parameter(placeholder, requires_grad=False)
            swapped.append((layer, weight))
    return swapped  # type: ignore[return-value]  # get_submodule says Module: targets are Linear (lora_targets)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters created inside go to the meta device; buffers stay real.

    Buffers (RoPE frequency tables) are small, rarely in checkpoints and computed in the
    constructors: building them for real avoids recomputing them family by family.
    """
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    # a class attribute patched for the block: mypy refuses assignments to methods (and ``module`` is not ``self``)
    torch.nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _build(name: str, config: PretrainedConfig, role: str, *, materialize: bool, dtype: torch.dtype,
           attn_implementation: str | None) -> PreTrainedModel:
    """The causal LM (policy) or its backbone (critic): from the seed, the files, or on meta."""
    auto = auto_class(config, role)
    if not materialize:
        with parameters_on_meta():
            return auto.from_config(config, attn_implementation=attn_implementation)
    if name == TINY_NAME:
        return auto.from_config(config, attn_implementation=attn_implementation)
    return auto.from_pretrained(name, config=config, dtype=dtype, attn_implementation=attn_implementation)


def _value_head_weights(files: dict, config: PretrainedConfig, seed: int, dtype: torch.dtype) -> tuple[dict, bool]:
    """A critic's head: from the files (an exported critic) or new from the seed."""
    names = (f"{VALUE_HEAD}.weight", f"{VALUE_HEAD}.bias")
    if all(n in files for n in names):
        return {n: read_rows(files, n).to(dtype) for n in names}, True
    return initial_value_head(int(text_config(config).hidden_size), seed, dtype), False


def load_model(
    name: str = TINY_NAME,
    *,
    role: str = "policy",
    lora: LoraConfig | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    materialize: bool = True,
    train_vision_tower: bool = False,
    attn_implementation: str | None = DEFAULT_ATTN_IMPLEMENTATION,
) -> LoadedModel:
    """Build or load the model for ``role``: "policy", the causal LM; "critic", its backbone
    with a value head (:class:`~skyrl_sdk.value_head.ValueHeadModel`).

    ``materialize=False`` (sharded engines) builds the parameters on the meta device and
    reads no weights: the caller shards the module and fills each shard from
    ``weights_dir``'s files and ``generated`` (LoRA adapters and a new value head, drawn
    from the seed exactly as a materialized load draws them). A vision-language model's vision
    tower is frozen unless ``train_vision_tower`` (:mod:`.vlm`). ``attn_implementation`` is the
    attention kernel (:mod:`.attention`; the engine checked it can run on its device).
    """
    if role not in ("policy", "critic"):
        raise ModelLoadError(f"role must be 'policy' or 'critic', got {role!r}")
    config, tok_dir = load_config(name)
    if role == "policy" and getattr(config, CONFIG_FIELD, None):  # else: a random lm_head, silently
        raise ModelLoadError(f"model {name!r} is a critic export (a backbone and value head, no lm_head): "
                             f"load it with role='critic'; a policy needs a causal LM directory")
    config.use_cache = False  # packed rows must not be treated as one sequence (PLATFORM_NOTES)
    weights_dir = None if name == TINY_NAME else str(Path(name).expanduser())
    files = weight_files(weights_dir) if weights_dir else {}
    generated: dict[str, torch.Tensor] = {}
    quiet = weights_dir is not None and _weights_bytes(Path(tok_dir)) < QUIET_LOAD_BYTES
    with torch.random.fork_rng(devices=[]), _quiet_progress(quiet):
        torch.manual_seed(seed)
        try:
            model: Any = _build(name, config, role, materialize=materialize, dtype=dtype,
                                attn_implementation=attn_implementation)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"model {name!r} could not be loaded: {exc}") from None
    if role == "critic":
        context = parameters_on_meta() if not materialize else contextlib.nullcontext()
        with context:
            model = ValueHeadModel(model)
        head, from_files = _value_head_weights(files, model.config, seed, dtype)
        if materialize:
            with torch.no_grad():
                for key, value in head.items():
                    model.get_parameter(key).copy_(value)
        elif not from_files:
            generated.update(head)
    model.to(dtype=dtype)
    model.eval()  # no dropout: RL needs the trainer's logprobs to match the sampler's
    if is_vision_language(config) and not train_vision_tower:
        freeze_vision_tower(model)
    if lora is not None:
        model = apply_lora(model, lora, seed, train_vision_tower)
        model.eval()
        if not materialize:
            generated.update({k: v.detach().to(dtype) for k, v in hf_model(model).state_dict().items()
                              if "lora_" in k})
    if materialize:
        model.to(device)
    tokenizer = load_tokenizer(tok_dir)
    return LoadedModel(module=model, tokenizer=tokenizer, tokenizer_dir=tok_dir, name=name, role=role, lora=lora,
                       materialized=materialize, generated=generated, weights_dir=weights_dir)
