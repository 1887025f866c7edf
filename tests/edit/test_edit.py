"""hs.edit: ablate, patch, steer, scale, clamp, replace; scoped, composable, checked."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.errors import EditError, SpecError
from tests.models import KeywordOnly, SharedTwice, SmallCNN, gpt2_input, tiny_gpt2, track


@pytest.mark.transformers
def test_the_identity_edit_changes_nothing_bit_for_bit() -> None:
    model = tiny_gpt2()
    ids = gpt2_input()
    with torch.no_grad():
        plain = model(input_ids=ids).last_hidden_state
        with hs.edit(model, {"h.*": lambda value, ctx: value}):
            edited = model(input_ids=ids).last_hidden_state
    assert torch.equal(plain, edited)


@pytest.mark.transformers
def test_patching_every_block_reproduces_the_clean_run_bit_for_bit() -> None:
    model = tiny_gpt2()
    clean_ids = gpt2_input()
    corrupted_ids = (clean_ids + 7) % 64
    with torch.no_grad():
        blocks = r"re:h\.\d+"  # the blocks themselves ("h.*" would also reach inside them)
        clean, cache = hs.run_with_capture(model, input_ids=clean_ids, layers=blocks)
        corrupted = model(input_ids=corrupted_ids).last_hidden_state
        patched, _ = hs.run_with_edits(model, input_ids=corrupted_ids, edits={blocks: hs.edits.patch(cache)})
    assert not torch.equal(corrupted, clean.last_hidden_state)
    assert torch.equal(patched.last_hidden_state, clean.last_hidden_state)


def test_mean_ablation_equals_the_hand_computation() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)))
    reference_batch, x = torch.randn(10, 4), torch.randn(3, 4)
    with torch.no_grad():
        _, cache = hs.run_with_capture(model, reference_batch, layers="0")
        out, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.mean(cache, neurons=[1, 4])})
        hidden = model[0](x)
        average = model[0](reference_batch).mean(0)
        hidden[:, [1, 4]] = average[[1, 4]]
        want = model[2](torch.tanh(hidden))
    assert torch.allclose(out, want, rtol=0, atol=1e-6)


def test_zeroing_a_conv_channel_equals_zeroing_the_next_input_by_hand() -> None:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = SmallCNN.example()
    with torch.no_grad():
        out, _ = hs.run_with_edits(model, x, edits={"conv1": hs.edits.zero(channels=[2, 7])})
        features = model.conv1(x)
        features[:, [2, 7]] = 0
        want = model.fc(torch.flatten(model.pool(model.relu(features)), 1))
    assert torch.equal(out, want)


@pytest.mark.transformers
def test_steering_one_position_leaves_earlier_positions_alone() -> None:
    model = tiny_gpt2()
    ids = gpt2_input()
    vector = torch.randn(32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).last_hidden_state
        steered = hs.run_with_edits(
            model, input_ids=ids, edits={"h.0": hs.edits.add(vector, scale=4.0, positions=[3])}
        )[0].last_hidden_state
    assert torch.equal(steered[:, :3], plain[:, :3])  # the causal mask: earlier positions see nothing
    assert not torch.allclose(steered[:, 3:], plain[:, 3:])


@pytest.mark.slow
def test_scale_clamp_replace_noise_and_heads() -> None:
    model = track(nn.Sequential(nn.Identity()))
    x = torch.arange(8.0).view(1, 2, 4)
    cases = {
        "scale": (hs.edits.scale(2.0, neurons=[0]), x * torch.tensor([2.0, 1, 1, 1])),
        "clamp": (hs.edits.clamp(max=3.0), x.clamp(max=3.0)),
        "replace": (
            hs.edits.replace(torch.tensor(-1.0), positions=[1]),
            torch.cat([x[:, :1], -torch.ones(1, 1, 4)], 1),
        ),
        "heads": (hs.edits.zero(heads=[1], num_heads=2), x * torch.tensor([1.0, 1, 0, 0])),
        "mask": (hs.edits.zero(mask=x > 5), x.masked_fill(x > 5, 0)),
    }
    for name, (edit, want) in cases.items():
        assert torch.equal(hs.run_with_edits(model, x, edits={"0": edit})[0], want), name
    first, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.noise(0.5, seed=3)})
    second, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.noise(0.5, seed=3)})
    assert torch.equal(first, second)
    assert not torch.equal(first, x)


def test_several_edits_on_one_site_apply_in_order() -> None:
    model = track(nn.Sequential(nn.Identity()))
    x = torch.ones(1, 3)
    out, _ = hs.run_with_edits(model, x, edits={"0": [hs.edits.scale(3.0), hs.edits.clamp(max=2.0)]})
    assert torch.equal(out, torch.full((1, 3), 2.0))
    out, _ = hs.run_with_edits(model, x, edits={"0": [hs.edits.clamp(max=2.0), hs.edits.scale(3.0)]})
    assert torch.equal(out, torch.full((1, 3), 3.0))


def test_a_capture_sees_the_edit_when_attached_after_it() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(3, 3), nn.Tanh()))
    x = torch.randn(2, 3)
    with hs.edit(model, {"0": hs.edits.zero()}), hs.capture(model, "0") as after:
        model(x)
    assert torch.equal(after["0"], torch.zeros(2, 3))
    with hs.capture(model, "0") as before, hs.edit(model, {"0": hs.edits.zero()}):
        out = model(x)
    assert not torch.equal(before["0"], torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))  # the model itself saw the edit either way


def test_edits_keep_autograd() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    x = torch.randn(4, 3)
    with hs.edit(model, {"0": hs.edits.scale(2.0, neurons=[0])}):
        model(x).sum().backward()
    edited = model[0].weight.grad.clone()  # type: ignore[union-attr]
    model.zero_grad()
    hidden = model[0](x)
    hidden = hidden * torch.tensor([2.0, 1.0, 1.0])
    model[1](hidden).sum().backward()
    assert torch.allclose(edited, model[0].weight.grad)  # type: ignore[arg-type]


def test_calls_choose_which_call_of_a_shared_module() -> None:
    torch.manual_seed(0)
    model = SharedTwice()
    x = torch.randn(2, 4)
    with torch.no_grad():
        out, editor = hs.run_with_edits(model, x, edits={"shared": hs.edits.zero()}, calls=1)
        want = model.head(torch.zeros(2, 4))
    assert torch.equal(out, want)
    assert editor.applied == {"shared": 1}  # of its two calls, the second alone was edited
    with torch.no_grad():
        first_only, editor = hs.run_with_edits(model, x, edits={"shared": hs.edits.zero()}, calls=[0])
        want = model.head(model.shared(torch.relu(torch.zeros(2, 4))))
    assert torch.equal(first_only, want)
    assert editor.applied == {"shared": 1}
    assert not editor.live  # the one-shot form removes its hooks before returning
    _, every = hs.run_with_edits(model, x, edits={"shared": hs.edits.zero(), "head": hs.edits.scale(1.0)})
    assert every.applied == {"shared": 2, "head": 1}


def test_applied_shows_an_edit_whose_module_never_ran() -> None:
    model = nn.ModuleDict({"used": nn.Linear(2, 2), "unused": nn.Linear(2, 2)})
    with hs.edit(model, {"used": hs.edits.scale(2.0), "unused": hs.edits.zero()}) as editor:
        model["used"](torch.ones(1, 2))
        model["used"](torch.ones(1, 2))
    assert editor.applied == {"used": 2, "unused": 0}


def test_input_edits_reach_keyword_inputs() -> None:
    torch.manual_seed(0)
    model = KeywordOnly()
    x = torch.randn(2, 4)
    with torch.no_grad():
        out, _ = hs.run_with_edits(
            model, x, edits={"block": hs.edits.replace(torch.tensor([5.0]), path="['scale']")}, on="input"
        )
        want = model.block.fc(x) * 5.0
    assert torch.equal(out, want)


@pytest.mark.transformers
def test_a_wrong_shape_is_an_edit_error_naming_the_site_and_no_hook_stays() -> None:
    model = tiny_gpt2()
    with pytest.raises(EditError, match=r"h\.1#0:output: the edit returned shape \(2, 8\)") as raised:
        hs.run_with_edits(model, input_ids=gpt2_input(), edits={"h.1": lambda value, ctx: value.sum(-1)})
    assert "expected shape (2, 8, 32) float32" in str(raised.value)
    assert not hs.attached(model)


def test_bad_parts_and_paths_are_named() -> None:
    model = track(nn.Sequential(nn.Linear(2, 3)))
    x = torch.randn(1, 2)
    with pytest.raises(EditError, match=r"0#0:output: neurons=\[5\] outside the 3"):
        hs.run_with_edits(model, x, edits={"0": hs.edits.zero(neurons=[5])})
    with pytest.raises(EditError, match="no tensor at 'output.logits'; the tensors are at output"):
        hs.run_with_edits(model, x, edits={"0": hs.edits.zero(path="output.logits")})
    with pytest.raises(EditError, match="not a multiple of num_heads=2"):
        hs.run_with_edits(model, x, edits={"0": hs.edits.zero(heads=[0], num_heads=2)})
    with pytest.raises(EditError, match=r"heads=\[0\] without num_heads= names dim 1 of a value held per head"):
        hs.run_with_edits(model, x, edits={"0": hs.edits.zero(heads=[0])})
    with pytest.raises(SpecError, match="num_heads= needs heads="):
        hs.edits.zero(num_heads=2)
    with pytest.raises(SpecError, match="not callables"):
        hs.edit(model, {"0": "zero"})  # type: ignore[dict-item]
    with pytest.raises(SpecError, match="calls="):
        hs.edit(model, {"0": hs.edits.zero()}, calls=-1)
    with pytest.raises(hs.SelectionError):
        hs.edit(model, {"1": hs.edits.zero()})
    assert not hs.attached(model)


def test_patch_refuses_a_cache_of_another_shape() -> None:
    model = track(nn.Sequential(nn.Linear(2, 3)))
    _, cache = hs.run_with_capture(model, torch.randn(4, 2), layers="0")
    with pytest.raises(EditError, match="the cached value has shape"):
        hs.run_with_edits(model, torch.randn(2, 2), edits={"0": hs.edits.patch(cache)})
    _, other = hs.run_with_capture(model, torch.randn(4, 2), layers="")
    with pytest.raises(EditError, match="the cache holds no value"):
        hs.run_with_edits(model, torch.randn(4, 2), edits={"0": hs.edits.patch(other)})


def test_repr_of_edits_and_editor() -> None:
    edit = hs.edits.zero(channels=[1, 2])
    assert repr(edit) == "hs.edits.zero(channels=[1, 2])"
    model = track(nn.Sequential(nn.Linear(2, 2)))
    with hs.edit(model, {"0": [edit, hs.edits.scale(2.0)]}) as editor:
        assert repr(editor) == "<Editor on outputs of 0 (2 edits); live>"
    assert repr(editor) == "<Editor on outputs of 0 (2 edits); removed>"


def test_in_place_ops_after_an_edit_write_neither_the_cache_nor_the_users_tensor() -> None:
    torch.manual_seed(0)
    model = track(nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True)))
    x = torch.randn(4, 3)
    _, cache = hs.run_with_capture(model, x, layers="0")
    kept = cache["0"].clone()
    for _ in range(2):  # the second run reads the cache again
        out, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.patch(cache)})
        assert torch.equal(out, kept.relu())
    assert torch.equal(cache["0"], kept)
    replacement = torch.full((3,), -1.0)
    hs.run_with_edits(model, x, edits={"0": hs.edits.replace(replacement)})
    assert torch.equal(replacement, torch.full((3,), -1.0))
    hs.run_with_edits(model, x, edits={"0": hs.edits.mean(cache)})  # a broadcast mean, then ReLU(inplace)


def test_a_reduced_cache_cannot_be_used_for_mean_ablation() -> None:
    model = track(nn.Sequential(nn.Linear(3, 4)))
    _, cache = hs.run_with_capture(model, torch.randn(5, 3), layers="0", reduce="mean:0")
    with pytest.raises(EditError, match="reduce='mean:0'"):
        hs.run_with_edits(model, torch.randn(2, 3), edits={"0": hs.edits.mean(cache)})


def test_positions_need_a_sequence_and_masks_must_fit() -> None:
    model = track(nn.Sequential(nn.Identity()))
    with pytest.raises(EditError, match="positions= needs a"):
        hs.run_with_edits(model, torch.ones(2, 4), edits={"0": hs.edits.zero(positions=[1])})
    with pytest.raises(EditError, match="does not broadcast to the value's"):
        hs.run_with_edits(
            model, torch.ones(2, 4), edits={"0": hs.edits.zero(mask=torch.ones(3, 2, 4, dtype=torch.bool))}
        )
    out, _ = hs.run_with_edits(model, torch.ones(1, 4), edits={"0": hs.edits.zero(heads=[-1], num_heads=2)})
    assert torch.equal(out, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))


def test_noise_is_the_same_in_every_run_and_differs_between_sites() -> None:
    model = track(nn.Sequential(nn.Identity(), nn.Identity()))
    x = torch.zeros(1, 6)
    edit = hs.edits.noise(1.0, seed=5)
    first, _ = hs.run_with_edits(model, x, edits={"0": edit})
    again, _ = hs.run_with_edits(model, x, edits={"0": edit})
    assert torch.equal(first, again)
    both, _ = hs.run_with_edits(model, x, edits={"0": edit, "1": hs.edits.noise(1.0, seed=5)})
    assert not torch.equal(both - first, first)  # the second site drew other numbers


def test_input_paths_may_be_written_as_errors_show_them() -> None:
    torch.manual_seed(0)
    model = KeywordOnly()
    x = torch.randn(2, 4)
    with torch.no_grad():
        out, _ = hs.run_with_edits(
            model, x, edits={"block": hs.edits.replace(torch.tensor([5.0]), path="input['scale']")}, on="input"
        )
        assert torch.equal(out, model.block.fc(x) * 5.0)


def test_a_misspelt_keyword_is_a_spec_error_with_a_hint() -> None:
    with pytest.raises(SpecError, match="did you mean 'channels'"):
        hs.edits.zero(chanels=[1])


@pytest.mark.parametrize(
    ("part", "shape"),
    [({"positions": [0]}, (2, 1, 3)), ({"neurons": [0]}, (2, 3, 1)), ({"channels": [1, 2]}, (2, 3, 4, 4))],
)
def test_zero_along_one_dim_matches_a_mask(part: dict[str, list[int]], shape: tuple[int, ...]) -> None:
    model = track(nn.Sequential(nn.Identity()))
    x = torch.arange(float(torch.Size(shape).numel())).view(shape) + 1
    fast, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.zero(**part)})
    dim = {"positions": 1, "channels": 1, "neurons": x.dim() - 1}[next(iter(part))]
    want = x.clone()
    want.index_fill_(dim, torch.tensor(next(iter(part.values()))), 0)
    assert torch.equal(fast, want)
    masked, _ = hs.run_with_edits(model, x, edits={"0": hs.edits.zero(mask=want == 0)})
    assert torch.equal(masked, want)


def test_an_edit_with_the_wrong_arity_is_refused_before_the_forward() -> None:
    model = SmallCNN().eval()
    with pytest.raises(SpecError, match=r"takes \(value\), but an edit is called as edit\(value, ctx\)"):
        hs.edit(model, {"fc": lambda value: value * 2})
    assert not model.fc._forward_hooks  # nothing was attached
    x = SmallCNN.example()
    with torch.no_grad():
        with hs.edit(model, {"fc": lambda value, ctx: value * 2}):  # both parameters: accepted
            edited = model(x)
        assert torch.equal(edited, model(x) * 2)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: hs.edits.scale("0.5"), r"scale\(factor='0.5'\): expected a number or a tensor, got str"),
        (lambda: hs.edits.clamp(max="1"), r"clamp\(max='1'\): expected a number, got str"),
        (lambda: hs.edits.noise(None), r"noise\(std=None\): expected a number"),
        (lambda: hs.edits.noise(0.1, seed=1.5), r"noise\(seed=1.5\): expected an int"),
        (lambda: hs.edits.add(torch.ones(4), scale="2"), r"add\(scale='2'\)"),
    ],
)
def test_what_an_edit_cannot_compute_with_is_refused_when_it_is_made(make: Callable[[], object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        make()


def test_a_tensor_factor_scales_per_channel() -> None:
    model = SmallCNN().eval()
    x = SmallCNN.example()
    factor = torch.arange(16.0).reshape(1, 16, 1, 1)
    with torch.no_grad():
        edited, _ = hs.run_with_edits(model, x, edits={"conv1": hs.edits.scale(factor)})
        by_hand = model.fc(torch.flatten(model.pool(model.relu(model.conv1(x) * factor)), 1))
    assert torch.allclose(edited, by_hand, atol=1e-6)


@pytest.mark.transformers
def test_an_edit_context_prints_as_one_short_line() -> None:
    model = tiny_gpt2()
    seen: list[hs.EditContext] = []

    def record(value: torch.Tensor, ctx: hs.EditContext) -> torch.Tensor:
        seen.append(ctx)
        return value

    with torch.no_grad():
        hs.run_with_edits(model, input_ids=gpt2_input(), edits={"h.1.mlp": record})
    ctx = seen[0]
    hidden = tuple(ctx.args[0].shape)  # what plain PyTorch handed the module
    for text in (repr(ctx), str(ctx)):
        assert "\n" not in text, text
        assert len(text) < 160, text
        assert "h.1.mlp#0:output" in text
        assert "GPT2MLP" in text
        assert f"input[0] [{', '.join(map(str, hidden))}] float32" in text
        assert "tensor(" not in text
        assert "Conv1D(" not in text
