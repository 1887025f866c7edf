"""``hookscope layers --std`` on the architectures whose interiors have names of their own:
experts of a fused mixture of experts, a Mamba mixer's values, a vision-language model's stacks
and image positions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli import run_cli

pytestmark = pytest.mark.transformers

FACTORY = """
def build():
    from zoo.tiny import build_tiny

    return build_tiny({model_type!r}).model.eval()
"""


def factory(tmp_path: Path, model_type: str) -> str:
    path = tmp_path / f"{model_type}_factory.py"
    path.write_text(FACTORY.format(model_type=model_type))
    return f"{path}:build"


def test_layers_std_shows_each_expert_s_values_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "layers", factory(tmp_path, "qwen3_moe"), "--std")
    assert code == 0, err
    assert "blocks.{i}.mlp.experts.{e}.post" in out
    assert "model.layers.{i}.mlp.experts:expert.post#{e}" in out
    assert "blocks.{i}.mlp.router.choice" in out


def test_layers_std_shows_a_vision_language_model_s_stacks_and_image_positions(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run_cli(capsys, "layers", factory(tmp_path, "llava"), "--std")
    assert code == 0, err
    for name in ("vision.blocks.{i}.resid_post", "text.blocks.{i}.attn.pattern", "projector.in", "projector "):
        assert name in out, name
    assert "image positions: 16 of 32 tokens of row 0 (1-16; image token 999;" in out


def test_layers_std_shows_a_mamba_mixer_s_values(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mamba2_factory.py"
    path.write_text(
        "def build():\n"
        "    import torch\n"
        "    from transformers import Mamba2Config, Mamba2ForCausalLM\n"
        "    torch.manual_seed(0)\n"
        "    return Mamba2ForCausalLM(Mamba2Config(hidden_size=32, expand=2, num_heads=4, head_dim=16, n_groups=2,\n"
        "        state_size=8, chunk_size=4, num_hidden_layers=2, vocab_size=100, use_cache=False)).eval()\n"
    )
    code, out, err = run_cli(capsys, "layers", f"{path}:build", "--std")
    assert code == 0, err
    assert "blocks.{i}.mixer.pattern" in out
    assert "backbone.layers.{i}.mixer:ssm.pattern#0" in out
