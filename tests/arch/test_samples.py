"""``hs.sample_input`` on real transformers models built tiny: each input kind it makes is one
the model accepts (a plain forward runs) and holds the values the forward needs: token ids in
range and clear of placeholders, one image placeholder per image feature, ordered word boxes,
enough audio for the encoder."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hookscope as hs
from hookscope._arch.samples.tokens import random_tokens
from hookscope.errors import SpecError

pytestmark = pytest.mark.transformers


def _tiny(model_type: str) -> Any:
    from zoo.tiny import build_tiny

    return build_tiny(model_type).model


def _runs(model: Any, kwargs: dict[str, Any]) -> Any:
    with torch.no_grad():
        return model(**kwargs)


def test_random_tokens_step_over_reserved_ids_and_are_plain_randint_without_them() -> None:
    plain = SimpleNamespace(bos_token_id=1, eos_token_id=2)  # ordinary ids may appear in text
    drawn = random_tokens(plain, 50, (4, 64), torch.Generator().manual_seed(0))
    assert torch.equal(drawn, torch.randint(0, 50, (4, 64), generator=torch.Generator().manual_seed(0)))
    media = SimpleNamespace(image_token_id=3, video_token_index=7, eos_token_id=2)
    drawn = random_tokens(media, 10, (64, 64), torch.Generator().manual_seed(0))
    assert set(drawn.unique().tolist()) == {0, 1, 2, 4, 5, 6, 8, 9}


def test_a_vision_language_model_gets_one_placeholder_per_image_feature() -> None:
    model = _tiny("llava")
    args, kwargs = hs.sample_input(model)
    assert args == ()
    assert set(kwargs) == {"input_ids", "pixel_values"}
    image_token = model.config.image_token_id
    placeholders = int((kwargs["input_ids"] == image_token).sum())
    features = model.get_image_features(pixel_values=kwargs["pixel_values"]).pooler_output
    assert placeholders == sum(piece.shape[-2] for piece in features) > 0
    assert kwargs["input_ids"][0, 0] != image_token  # the image follows the first text token
    assert int(kwargs["input_ids"].max()) < model.config.text_config.vocab_size
    assert _runs(model, kwargs).last_hidden_state.shape[1] == kwargs["input_ids"].shape[1]


def test_qwen2_vl_gets_patches_their_grid_and_the_token_types_of_its_rotary_positions() -> None:
    model = _tiny("qwen2_vl")
    _, kwargs = hs.sample_input(model)
    grid = kwargs["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]
    assert kwargs["pixel_values"].shape[0] == 16  # one row per patch of the 4 x 4 grid
    is_image = kwargs["input_ids"] == model.config.image_token_id
    assert int(is_image.sum()) == 4  # 16 patches merged 2 x 2
    assert torch.equal(kwargs["mm_token_type_ids"], is_image.int())
    assert kwargs["input_ids"][0, 1] == model.config.vision_start_token_id
    _runs(model, kwargs)


def test_a_dual_encoder_gets_an_image_beside_its_text() -> None:
    model = _tiny("clip")
    _, kwargs = hs.sample_input(model)
    assert kwargs["pixel_values"].shape == (
        1,
        3,
        model.config.vision_config.image_size,
        model.config.vision_config.image_size,
    )
    assert _runs(model, kwargs).logits_per_image.shape == (1, 1)


def test_a_document_model_gets_ordered_word_boxes_on_its_page_grid() -> None:
    model = _tiny("layoutlm")
    _, kwargs = hs.sample_input(model, (2, 12))
    box = kwargs["bbox"]
    assert box.shape == (2, 12, 4)
    assert bool((box[..., 0] <= box[..., 2]).all())
    assert bool((box[..., 1] <= box[..., 3]).all())
    assert int(box.min()) >= 0
    assert int(box.max()) <= 1000
    _runs(model, kwargs)


def test_a_raw_audio_model_gets_enough_samples_for_its_convolutions() -> None:
    model = _tiny("wav2vec2")
    _, kwargs = hs.sample_input(model)
    assert set(kwargs) == {"input_values"}
    assert _runs(model, kwargs).last_hidden_state.shape[1] == 16  # DEFAULT_FRAMES, exactly


def test_a_spectrogram_model_gets_frames_by_mel_bins() -> None:
    model = _tiny("audio-spectrogram-transformer")
    _, kwargs = hs.sample_input(model)
    assert kwargs["input_values"].shape == (1, model.config.max_length, model.config.num_mel_bins)
    _runs(model, kwargs)


def test_a_frames_first_speech_model_gets_features_and_decoder_start_tokens() -> None:
    model = _tiny("speech_to_text")
    _, kwargs = hs.sample_input(model)
    assert kwargs["input_features"].shape == (1, 128, model.config.input_feat_per_channel)
    assert kwargs["decoder_input_ids"].shape == (1, 4)
    _runs(model, kwargs)


def test_an_image_model_that_states_no_channels_gets_rgb() -> None:
    model = _tiny("blip-2")
    assert hs.default_input_shape(model) == (1, 3, *(2 * [model.config.vision_config.image_size]))


def test_a_required_input_it_cannot_make_is_a_spec_error_naming_it() -> None:
    model = _tiny("blip_2_qformer")
    with pytest.raises(SpecError, match=r"Blip2QFormerModel.forward requires `query_embeds`"):
        hs.sample_input(model)


def test_a_patch_encoder_gets_flattened_patches_and_their_grid() -> None:
    model = _tiny("cosmos3_edge_vision")
    _, kwargs = hs.sample_input(model)
    assert kwargs["grid_thw"].tolist() == [[1, 4, 4]]
    assert kwargs["pixel_values"].shape[0] == 16
    _runs(model, kwargs)


def test_a_detector_whose_config_states_no_image_size_gets_an_rgb_image() -> None:
    model = _tiny("detr")
    assert hs.default_input_shape(model) == (1, 3, 224, 224)
    _, kwargs = hs.sample_input(model)
    assert _runs(model, kwargs).last_hidden_state.shape[0] == 1


def test_a_video_model_gets_frames_of_images() -> None:
    model = _tiny("videomae")
    config = model.config
    assert hs.default_input_shape(model) == (1, config.num_frames, 3, config.image_size, config.image_size)
    _, kwargs = hs.sample_input(model)
    _runs(model, kwargs)


def test_a_raw_audio_model_that_states_no_rate_gets_a_second_at_16_khz() -> None:
    model = _tiny("moonshine")
    _, kwargs = hs.sample_input(model)
    assert kwargs["input_values"].shape == (1, 16000)
    assert kwargs["decoder_input_ids"].shape == (1, 4)
    _runs(model, kwargs)


def test_a_vision_tower_without_its_own_main_input_gets_pixels() -> None:
    model = _tiny("siglip_vision_model")
    assert model.main_input_name == "pixel_values"  # the control: a tower that names its input
    tower = _tiny("deepseek_ocr2_vision")
    assert tower.main_input_name == "input_ids"  # transformers' class default, and no vocabulary
    assert hs.default_input_shape(tower)[1] == 3
