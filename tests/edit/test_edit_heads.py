"""Head ablation where the README says heads live: the input of the attention's output projection."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from tests.models import gpt2_input, tiny_gpt2


@pytest.mark.transformers
def test_zeroing_a_head_at_the_output_projection_input_matches_a_raw_pre_hook() -> None:
    model = tiny_gpt2()  # 2 heads of 16 over n_embd 32
    ids = gpt2_input()
    projection = model.h[0].attn.c_proj

    def zero_head_1(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        merged = args[0].clone()
        merged[..., 16:32] = 0.0  # head 1 of 2: the second block of the merged head dimension
        return (merged,)

    handle = projection.register_forward_pre_hook(zero_head_1)
    try:
        with torch.no_grad():
            expected = model(ids).last_hidden_state
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model(ids).last_hidden_state
        edited, editor = hs.run_with_edits(
            model, ids, edits={"h.0.attn.c_proj": hs.edits.zero(heads=1, num_heads=2)}, on="input"
        )
    assert editor.applied == {"h.0.attn.c_proj": 1}
    assert not torch.allclose(plain, expected)
    torch.testing.assert_close(edited.last_hidden_state, expected, rtol=0, atol=0)
