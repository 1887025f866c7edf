"""Default shapes of non-token inputs: images (``pixel_values``), raw audio (``input_values``) and
audio features (``input_features``), sized from the config so the model accepts them.

Sizes follow what the model's first layers require: a vision transformer's image size (its
position table), a speech encoder's frames (its convolutions halve them to its positions), a raw
audio encoder's convolution strides (enough samples for ``DEFAULT_FRAMES`` frames).
"""

from __future__ import annotations

import math

from hookscope._arch.samples.config import image_size, int_field, vision_config

__all__ = ["DEFAULT_FRAMES", "DEFAULT_IMAGE_SIZE", "DEFAULT_SAMPLES", "MEDIA_INPUTS", "audio_shape", "pixel_shape"]

DEFAULT_IMAGE_SIZE = 224  # a vision model that states no image size: the size most were trained at
DEFAULT_FRAMES = 16  # audio encoder frames, like DEFAULT_SEQUENCE_LENGTH tokens
DEFAULT_SAMPLES = 16000
MEDIA_INPUTS = ("pixel_values", "input_features", "input_values")


def pixel_shape(config: object, batch: int = 1) -> tuple[int, ...] | None:
    """``(batch, channels, height, width)`` for a vision model (or the vision tower or backbone
    of a composite one): the first stated size, with the channels stated anywhere (RGB if none);
    ``DEFAULT_IMAGE_SIZE`` where only channels are stated; None where neither is."""
    parts = [part for part in (config, vision_config(config), getattr(config, "backbone_config", None)) if part]
    channels = next((found for part in parts if (found := _channels(part)) is not None), None)
    size = next((stated for part in parts if (stated := image_size(part)) is not None), None)
    if size is not None:
        return (batch, channels or 3, *size)
    if channels is not None:
        return (batch, channels, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
    return None


def _channels(config: object) -> int | None:
    return int_field(config, "num_channels", "in_channels", "input_channels", "in_chans")


def audio_shape(config: object, main_input: str, batch: int = 1) -> tuple[int, ...] | None:
    """The shape of ``input_features`` or ``input_values`` for an audio model, or None."""
    if main_input == "input_features":
        return _features_shape(config, batch)
    if main_input == "input_values":
        return _values_shape(config, batch)
    return None


def _features_shape(config: object, batch: int) -> tuple[int, ...] | None:
    parts = [config, getattr(config, "audio_config", None), getattr(config, "encoder_config", None)]
    for part in (part for part in parts if part is not None):
        mels = int_field(part, "num_mel_bins")
        positions = int_field(part, "max_source_positions")
        if mels is not None and positions is not None:  # Whisper-like: mel bins are channels, frames last
            return (batch, mels, 2 * positions)
        per_channel = int_field(part, "input_feat_per_channel")
        features = per_channel * (int_field(part, "input_channels") or 1) if per_channel else None
        features = features or mels or int_field(part, "feature_size", "input_dim", "feature_projection_input_dim")
        if features is not None:  # frames first, features last (Speech2Text, Conformer encoders)
            return (batch, 8 * DEFAULT_FRAMES, features)
    return None


def _values_shape(config: object, batch: int) -> tuple[int, ...] | None:
    """Raw audio: enough samples for the feature encoder's strided convolutions; codecs with
    ``audio_channels`` get a channel dimension."""
    if int_field(config, "num_mel_bins") is not None and int_field(config, "max_length") is not None:
        return (batch, int_field(config, "max_length") or 0, int_field(config, "num_mel_bins") or 0)  # spectrogram
    strides = getattr(config, "conv_stride", None)
    kernels = getattr(config, "conv_kernel", None)
    if isinstance(strides, (list, tuple)) and isinstance(kernels, (list, tuple)) and strides:
        samples = DEFAULT_FRAMES
        for kernel, stride in reversed(list(zip(kernels, strides, strict=False))):  # each layer's input for its output
            samples = (samples - 1) * int(stride) + int(kernel)
        return (batch, samples)
    hop = int_field(config, "hop_length")
    ratios = getattr(config, "upsampling_ratios", None) or getattr(config, "downsampling_ratios", None)
    if hop is None and isinstance(ratios, (list, tuple)) and ratios:
        hop = math.prod(int(ratio) for ratio in ratios)
    channels = int_field(config, "audio_channels", "channels")
    samples = (hop or 320) * DEFAULT_FRAMES
    if channels is not None:
        return (batch, channels, samples)
    if int_field(config, "sampling_rate") is not None or hop is not None:
        return (batch, samples)
    return (batch, DEFAULT_SAMPLES)  # a raw audio model that states nothing: one second at 16 kHz
