"""Images for a vision-language model: checked against the limits, counted, then decoded.

:meth:`ImageInputs.prepare` turns every ``ImageChunk`` of a call into a
``PreparedImageChunk`` in two passes. The first reads only each image's header (format and
size) and checks everything knowable before compute: the pixel limit per image (a small
PNG can declare a huge canvas), the token count against the client's ``expected_tokens``
(Tinker's count, so that ``loss_fn_inputs`` align), the image-token limits per datum and
per call, and the decode work: the pixels of the call's distinct images together (the token
limits do not bound it: the image processor shrinks any image to a few tokens) and a JPEG's
scans (each scan of a progressive JPEG is a pass over every pixel: one of 115 KB repeating
its last scan 600 times took 13 s). Only then does the second pass decode the pixels and run
the model's image processor, once per distinct image of the call, each decode within a time
budget (checked as the data is fed to the decoder, a few KB at a time), and yielding between
two images (:meth:`ImageInputs.prepare_steps` is a stepped call): the server's compute thread
gives other clients their turns there, as between micro-batches. The server runs this on its compute thread, never on
its event loop.

The processor is the family's PIL one (``Qwen2VLImageProcessorPil``, numpy): the
torchvision one is never imported.
"""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ..errors import InputError, ModelLoadError, install_hint
from ..types import ImageChunk, ModelInput, PreparedImageChunk
from ..types.model_input import ImageFormat

if TYPE_CHECKING:
    from transformers.image_processing_utils import BaseImageProcessor

#: PIL's names of the formats Tinker's image chunks carry.
_PIL_FORMATS: dict[str, ImageFormat] = {"PNG": "png", "JPEG": "jpeg"}


@attrs.frozen
class ImageLimits:
    """Bounds on the image work of one call, checked before any image is decoded."""

    #: Decoded pixels (width x height) of one image, read from its header.
    max_pixels: int = 4096 * 4096
    #: Positions the images of one datum (or prompt) take.
    max_tokens_per_datum: int = 16384
    #: Positions the images of one call (all its datums or prompts) take.
    max_tokens_per_call: int = 65536
    #: Decoded pixels of the call's distinct images together (about 1.5 s of decoding on a CPU).
    max_pixels_per_call: int = 4 * 4096 * 4096
    #: Scans of one JPEG (a progressive one has about 10).
    max_jpeg_scans: int = 32
    #: Seconds one image's decoding may take.
    max_decode_s: float = 10.0


def load_image_processor(directory: str | None, config: Any) -> BaseImageProcessor:
    """The model's image processor, PIL backend: from ``preprocessor_config.json`` when the
    directory has one, else the family's defaults sized to its vision tower."""
    try:
        import PIL  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the install
        raise ModelLoadError(f"vision-language models read images with Pillow: {install_hint('vision')}") from None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if directory is not None and (Path(directory) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        try:
            return AutoImageProcessor.from_pretrained(directory, backend="pil")
        except Exception as exc:
            raise ModelLoadError(f"model {directory!r}: preprocessor_config.json could not be read: {exc}") from None
    vision = config.vision_config
    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                    temporal_patch_size=vision.temporal_patch_size)


def _format_of(data: bytes) -> ImageFormat:
    """``'png'`` or ``'jpeg'`` from an encoded image's first bytes (the header check says the rest)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8"):
        return "jpeg"
    raise InputError(f"image: the data is not a PNG or JPEG image ({len(data)} bytes, starting {data[:8]!r})")


class ImageInputs:
    """A vision-language model's image processor, its image token and the limits."""

    def __init__(self, processor: Any, *, image_token_id: int, limits: ImageLimits | None = None) -> None:
        self.processor = processor
        self.image_token_id = int(image_token_id)
        self.merge_size = int(processor.merge_size)
        self.limits = limits or ImageLimits()

    @classmethod
    def load(cls, directory: str | None, config: Any, limits: ImageLimits | None = None) -> ImageInputs:
        return cls(load_image_processor(directory, config), image_token_id=config.image_token_id, limits=limits)

    def count_tokens(self, width: int, height: int) -> int:
        """Positions a ``width`` x ``height`` image takes (Tinker's ``expected_tokens``, computed
        as tinker-cookbook computes it from the same processor)."""
        return self.processor.get_number_of_image_patches(height, width, images_kwargs={}) // self.merge_size**2

    def tokens_of(self, image: Any) -> int:
        """Positions ``image`` takes: an ``ImageChunk`` (ours, or the tinker client's), its encoded
        PNG or JPEG bytes, or a ``(width, height)``; the image's header is read and checked
        against the limits, as a call's would be (nothing is decoded)."""
        if isinstance(image, tuple):
            if len(image) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in image):
                raise InputError(f"image: expected (width, height) as two positive integers, got {image!r}")
            return self.count_tokens(*image)
        data = image if isinstance(image, (bytes, bytearray, memoryview)) else getattr(image, "data", None)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InputError(f"image: expected an ImageChunk, PNG or JPEG bytes, or (width, height), got "
                             f"{type(image).__name__}")
        chunk = ImageChunk(bytes(data), getattr(image, "format", None) or _format_of(bytes(data)))
        return self.count_tokens(*self._header(chunk, lambda msg: InputError(f"image: {msg}")))

    def prepare_steps(self, inputs: Sequence[ModelInput],
                      error: Callable[[int, str], InputError]) -> Generator[None, None, list[ModelInput]]:
        """``inputs`` with every ``ImageChunk`` made a ``PreparedImageChunk``, as a stepped call
        (``engines.turns.Steps``) that yields between two decodes, where its driver may give
        others their turns; ``error(i, message)`` builds the error of input ``i`` (a datum's or a
        prompt's). Nothing is decoded unless every image of the call passes the checks."""
        sizes: dict[tuple[int, int], tuple[int, int]] = {}
        pixels: dict[str, int] = {}  # distinct image -> its pixels
        call_tokens = 0
        for i, model_input in enumerate(inputs):
            datum_tokens = 0
            for j, chunk in enumerate(model_input.chunks):
                if not isinstance(chunk, ImageChunk):
                    continue
                width, height = self._header(chunk, _chunk_error(error, i, j))
                tokens = self.count_tokens(width, height)
                if chunk.expected_tokens is not None and chunk.expected_tokens != tokens:
                    raise error(i, f"model_input.chunks[{j}]: expected_tokens is {chunk.expected_tokens}, but this "
                                   f"model's image processor makes the {width}x{height} image {tokens} tokens")
                sizes[i, j] = (width, height)
                pixels[PreparedImageChunk.digest_of(chunk.data)] = width * height
                datum_tokens += tokens
            if datum_tokens > self.limits.max_tokens_per_datum:
                raise error(i, f"its images take {datum_tokens} positions, over the limit of "
                               f"{self.limits.max_tokens_per_datum} image tokens per datum "
                               f"(max_image_tokens_per_datum)")
            call_tokens += datum_tokens
        if call_tokens > self.limits.max_tokens_per_call:
            raise InputError(f"the images of this call take {call_tokens} positions, over the limit of "
                             f"{self.limits.max_tokens_per_call} image tokens per call (max_image_tokens_per_call)")
        if sum(pixels.values()) > self.limits.max_pixels_per_call:
            raise InputError(f"the {len(pixels)} distinct images of this call are {sum(pixels.values())} pixels "
                             f"together, over the limit of {self.limits.max_pixels_per_call} decoded pixels per call "
                             f"(max_image_pixels_per_call): send them in several calls")
        if not sizes:
            return list(inputs)
        decoded: dict[str, PreparedImageChunk] = {}
        out = []
        for i, model_input in enumerate(inputs):
            if not model_input.has_images:
                out.append(model_input)
                continue
            chunks = []
            for j, chunk in enumerate(model_input.chunks):
                if isinstance(chunk, ImageChunk):
                    digest = PreparedImageChunk.digest_of(chunk.data)
                    if digest not in decoded:
                        if decoded:
                            yield  # others' turns, as between micro-batches
                        decoded[digest] = self._decode(chunk, digest, _chunk_error(error, i, j))
                    chunk = decoded[digest]
                chunks.append(chunk)
            out.append(ModelInput(chunks))
        return out

    def _header(self, chunk: ImageChunk, error: Callable[[str], InputError]) -> tuple[int, int]:
        """(width, height) from the image's header, its format and pixel count checked."""
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(chunk.data))
        except Image.DecompressionBombError:
            assert Image.MAX_IMAGE_PIXELS is not None  # PIL raises it only when a limit is set
            raise error(f"the image declares more than {Image.MAX_IMAGE_PIXELS * 2} pixels, over the limit of "
                        f"{self.limits.max_pixels} pixels per image (max_image_pixels)") from None
        except Exception:
            raise error(f"the data is not a PNG or JPEG image ({len(chunk.data)} bytes could not be read)") from None
        found = _PIL_FORMATS.get(image.format or "")
        if found is None:
            raise error(f"the data is a {image.format} image; image chunks carry 'png' or 'jpeg'")
        if found != chunk.format:
            raise error(f"format is {chunk.format!r} but the data is a {found.upper()} image")
        width, height = image.size
        if width * height > self.limits.max_pixels:
            raise error(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                        f"{self.limits.max_pixels} pixels per image (max_image_pixels)")
        if min(width, height) < 1 or max(width, height) / min(width, height) > 200:
            raise error(f"the image is {width}x{height}: its sides must be at most 200 times apart")
        # every scan starts with an SOS marker, which entropy-coded data never holds (a 0xFF
        # there is followed by 0x00 or a restart marker): the count bounds the scans from above
        scans = chunk.data.count(b"\xff\xda") if found == "jpeg" else 0
        if scans > self.limits.max_jpeg_scans:
            raise error(f"the JPEG has {scans} scans, over the limit of {self.limits.max_jpeg_scans} scans per image "
                        f"(max_jpeg_scans; a progressive JPEG has about 10, each a pass over every pixel)")
        return width, height

    def _decode(self, chunk: ImageChunk, digest: str, error: Callable[[str], InputError]) -> PreparedImageChunk:
        from PIL import Image

        source = _Budgeted(chunk.data)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(source)
                image.decodermaxblock = _DECODE_BLOCK  # the budget is checked before each block is read
                source.deadline = time.monotonic() + self.limits.max_decode_s
                image.load()
                rgb = image.convert("RGB")
        except _OverBudget:
            raise error(f"decoding the image took more than {self.limits.max_decode_s:g} s, the limit per image "
                        f"(max_image_decode_s)") from None
        except Exception as exc:
            raise error(f"the image could not be decoded: {exc}") from None
        batch = self.processor(images=[rgb], return_tensors="np")
        t, h, w = (int(x) for x in np.asarray(batch["image_grid_thw"]).reshape(3))
        grid = (t, h, w)
        pixels = np.ascontiguousarray(np.asarray(batch["pixel_values"], dtype=np.float32))
        return PreparedImageChunk(pixel_values=pixels, grid_thw=grid, merge_size=self.merge_size,
                                  token_id=self.image_token_id, digest=digest)


def _chunk_error(error: Callable[[int, str], InputError], i: int, j: int) -> Callable[[str], InputError]:
    """``error`` of input ``i``'s chunk ``j``."""
    return lambda msg: error(i, f"model_input.chunks[{j}]: {msg}")


#: bytes the decoder is handed at a time (the time budget is checked between two)
_DECODE_BLOCK = 4096


class _OverBudget(Exception):
    """An image's decoding ran past its time budget."""


class _Budgeted(io.BytesIO):
    """The bytes of an image, refusing to be read past ``deadline`` (monotonic; None: no
    deadline yet): the decoder reads them block by block, so its work stops within a block."""

    deadline: float | None = None

    def read(self, size: int | None = -1) -> bytes:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise _OverBudget
        return super().read(size)
