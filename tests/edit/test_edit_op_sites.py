"""Editing op sites and attention sub-sites (issue 19): ``hs.edit(model, {"h.0.attn:op[softmax#0]": ...})``.

Every edited forward is checked against a reference computed without hookscope: a plain
``TorchFunctionMode`` switched on by hand hooks around one module, the eager-attention twin of an
SDPA model (one set of weights built twice) with its softmax edited that way, a hand pre-hook on
the attention's output projection, a residual sum done by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from hookscope.errors import EditError, SpecError
from tests.arch.test_attention_math import MODELS, twins
from tests.cli.test_cli import run_cli
from tests.models import Tracked, attention_gpt2, attention_tokens, track

# (model kind, attention module of layer 0, its output projection, head size)
ATTENTION = {
    "gpt2": ("h.0.attn", "c_proj", 16),
    "llama-gqa": ("layers.0.self_attn", "o_proj", 8),
}


def stack_depth() -> int:
    return int(torch._C._len_torch_function_stack())


class EditOp(TorchFunctionMode):
    """Replaces what one torch function returns (``change(args, kwargs, output)``) while ``on``."""

    def __init__(self, name: str, change: Callable[[tuple[Any, ...], dict[str, Any], Any], Any]) -> None:
        super().__init__()
        self.name, self.change, self.on, self.seen = name, change, False, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.on and getattr(func, "__name__", "") == self.name:
            self.seen += 1
            return self.change(tuple(args), kwargs, out)
        return out


@contextmanager
def edited_inside(module: nn.Module, mode: EditOp) -> Iterator[EditOp]:
    """``mode`` on the stack for the whole forward, acting only while ``module``'s forward runs."""

    def enter(_module: nn.Module, _args: Any) -> None:
        mode.on = True

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        mode.on = False

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with mode:
            yield mode
    finally:
        for handle in handles:
            handle.remove()


def first_key_cut(pattern: torch.Tensor) -> torch.Tensor:
    """The edit tested on patterns: key 0 attended by no query, head 1 halved."""
    halved = torch.ones(pattern.size(-3), 1, 1, dtype=pattern.dtype)
    halved[1] = 0.5
    return pattern.index_fill(-1, torch.tensor([0]), 0.0) * halved


def hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(ids).last_hidden_state
    return out


def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(3))


def model_twins(kind: str) -> tuple[nn.Module, nn.Module]:
    config_class, model_class, config = MODELS[kind]
    eager, sdpa = twins(config_class, model_class, **config)
    return track(eager), track(sdpa)


# -- op sites --------------------------------------------------------------------------------------


@pytest.mark.transformers
def test_the_eager_softmax_edited_equals_a_raw_function_mode_on_it() -> None:
    model = attention_gpt2("eager")
    ids = attention_tokens()
    plain = hidden(model, ids)
    with edited_inside(model.h[0].attn, EditOp("softmax", lambda a, k, out: first_key_cut(out))) as mode:
        expected = hidden(model, ids)
    assert mode.seen == 1
    sites: list[str] = []

    def cut(pattern: torch.Tensor, ctx: hs.EditContext) -> torch.Tensor:
        sites.append(ctx.site)
        assert ctx.op == "softmax#0"
        assert ctx.args[0].shape == pattern.shape
        return first_key_cut(pattern)

    with torch.no_grad():
        out, editor = hs.run_with_edits(model, ids, edits={"h.0.attn:op[softmax#0]": cut})
    assert not torch.allclose(plain, expected)
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=0, atol=0)
    assert sites == ["h.0.attn#0:op[softmax#0]"]
    assert editor.applied == {"h.0.attn:op[softmax#0]": 1}
    assert editor.sites == ["h.0.attn:op[softmax#0] (1 edit)"]
    assert torch.equal(hidden(model, ids), plain)  # nothing left behind


@pytest.mark.transformers
def test_a_glob_edits_every_layers_op_and_counts_each() -> None:
    model = attention_gpt2("eager")
    ids = attention_tokens()
    with torch.no_grad():
        out, editor = hs.run_with_edits(model, ids, edits={"h.*.attn:op[softmax#*]": hs.edits.scale(0.0)})
    assert editor.applied == {"h.0.attn:op[softmax#*]": 1, "h.1.attn:op[softmax#*]": 1}
    with edited_inside(model, EditOp("softmax", lambda a, k, out: torch.zeros_like(out))) as mode:
        expected = hidden(model, ids)  # every softmax of the model is an attention's
    assert mode.seen == 2
    assert not torch.allclose(hidden(model, ids), expected)
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=0, atol=0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class Stack(Tracked):
    """Two residual blocks, then a head; ``block`` is called twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(self.block(x)))
        return out


def by_hand(model: Stack, x: torch.Tensor, first: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The forward written out, ``first`` applied to the residual sum of the block's first call."""
    fc = model.block.fc
    h = first(x + fc(x))
    out: torch.Tensor = model.head(h + fc(h))
    return out


def test_a_residual_add_edited_on_one_call() -> None:
    model = Stack()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, editor = hs.run_with_edits(model, x, edits={"block:op[add#0]": hs.edits.scale(2.0)}, calls=0)
        expected = by_hand(model, x, lambda h: h * 2)
        assert not torch.allclose(model(x), expected)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert editor.applied == {"block:op[add#0]": 1}  # the second call was left out by calls=0


def test_module_and_op_selectors_mixed_in_one_edit() -> None:
    model = Stack()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    edits = {"block.fc": hs.edits.zero(), "block#0:op[add]": hs.edits.add(torch.ones(4))}
    with torch.no_grad():
        out, editor = hs.run_with_edits(model, x, edits=edits)
        expected = model.head(x + 1)  # fc zeroed in both calls: the second block adds nothing
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert editor.applied == {"block.fc": 2, "block#0:op[add]": 1}
    assert editor.sites == ["block.fc (1 edit)", "block#0:op[add] (1 edit)"]


def test_patching_an_op_site_takes_the_value_a_capture_kept_there() -> None:
    model = Stack()
    clean, corrupt = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2)).unbind(0)
    with torch.no_grad():
        _, cache = hs.run_with_capture(model, clean, layers="block#0:op[add#0]")
        out, _ = hs.run_with_edits(model, corrupt, edits={"block#0:op[add]": hs.edits.patch(cache)})
        assert not torch.allclose(model(corrupt), model(clean))
        # the block's first residual sum is the clean run's: from there on the clean forward
        torch.testing.assert_close(out, model(clean), rtol=0, atol=0)


class Squashed(Tracked):
    """``tanh(x + fc(x))`` checkpointed: backward recomputes the add, and tanh saves its output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(lambda t: torch.tanh(self.block(t)), x, use_reentrant=False)
        return out


def test_a_checkpointed_block_is_edited_again_when_backward_recomputes_it() -> None:
    model = Squashed()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    fc = model.block.fc
    torch.tanh((x + fc(x)) * 2).pow(2).sum().backward()
    expected = fc.weight.grad.clone()
    fc.weight.grad = None
    out, _ = hs.run_with_edits(model, x, edits={"block:op[add#0]": hs.edits.scale(2.0)})
    out.pow(2).sum().backward()  # hooks removed: the recomputation is plain, and the gradient wrong
    wrong = fc.weight.grad.clone()
    fc.weight.grad = None
    assert not torch.allclose(wrong, expected)
    with hs.edit(model, {"block:op[add#0]": hs.edits.scale(2.0)}) as editor:
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(fc.weight.grad, expected, rtol=1e-6, atol=1e-6)
    assert editor.applied == {"block:op[add#0]": 1}  # the recomputation is edited, not counted


def test_an_op_selector_that_never_fired_names_the_ops_called() -> None:
    model = Stack()
    x = torch.randn(1, 4)
    with pytest.raises(EditError, match=r"'block:op\[mul\]' matched no op call of 'block', which ran and called: add"):
        hs.run_with_edits(model, x, edits={"block:op[mul]": hs.edits.zero()})
    with pytest.raises(EditError, match=r"did you mean 'block:op\[add\]'"):
        hs.run_with_edits(model, x, edits={"block:op[ad]": hs.edits.zero()})
    with pytest.raises(EditError, match=r"'add' ran 1 time\(s\) per call: indices 0 to 0"):
        hs.run_with_edits(model, x, edits={"block:op[add#1]": hs.edits.zero()})
    assert len(hs.attached(model)) == 0


def test_an_edit_that_raises_inside_an_op_leaves_no_hook_or_mode() -> None:
    model = Stack()
    x = torch.randn(2, 4)
    with torch.no_grad():
        plain = model(x)

    def boom(value: torch.Tensor, ctx: hs.EditContext) -> torch.Tensor:
        raise RuntimeError(f"boom at {ctx.site}")

    with pytest.raises(RuntimeError, match=r"boom at block#0:op\[add#0\]"):
        hs.run_with_edits(model, x, edits={"block:op[add]": boom})
    assert len(hs.attached(model)) == 0
    assert stack_depth() == 0
    with hs.edit(model, {"block#1:op[add]": boom}) as editor:
        with pytest.raises(RuntimeError, match="boom"):
            model(x)
        assert stack_depth() == 0  # the watch is off outside the forward, the editor still attached
        assert editor.live
    assert len(hs.attached(model)) == 0
    assert stack_depth() == 0
    with torch.no_grad():
        assert torch.equal(model(x), plain)


def test_an_edit_returning_the_wrong_shape_names_the_op_site() -> None:
    model = Stack()
    with pytest.raises(EditError, match=r"block#0:op\[add#0\]: the edit returned shape \(4,\)"):
        hs.run_with_edits(model, torch.randn(2, 4), edits={"block:op[add#0]": lambda v, ctx: v[0]})


def test_op_sites_refuse_on_input_and_a_path_inside_a_sub_site() -> None:
    model = Stack()
    with pytest.raises(SpecError, match=r"on='input' edits what a module takes, and 'block:op\[add\]'"):
        hs.edit(model, {"block:op[add]": hs.edits.zero()}, on="input")
    with pytest.raises(SpecError, match="is one tensor, an attention sub-site: its edits take no path="):
        hs.edit(track(attention_gpt2("sdpa")), {"h.0.attn:attn.z": hs.edits.zero(path="[0]")})
    with pytest.raises(SpecError, match="is not of the form"):
        hs.edit(model, {"block:op[add": hs.edits.zero()})
    assert len(hs.attached(model)) == 0


# -- attention sub-sites ---------------------------------------------------------------------------


def halved_scores(args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
    """The eager softmax of its input halved (a mask's large negative stays large and negative)."""
    return functional.softmax(args[0] * 0.5, **kwargs)


# sub-site: (the edit through hookscope, the same edit of the eager twin's softmax by hand)
TWIN_EDITS: dict[str, tuple[Callable[[torch.Tensor, Any], torch.Tensor], Callable[..., torch.Tensor]]] = {
    "pattern": (lambda p, ctx: first_key_cut(p), lambda a, k, out: first_key_cut(out)),
    "scores": (hs.edits.scale(0.5), halved_scores),
}


@pytest.mark.transformers
@pytest.mark.parametrize("sub", list(TWIN_EDITS))
@pytest.mark.parametrize("kind", list(ATTENTION))
def test_an_edited_sub_site_equals_the_same_edit_of_the_eager_twins_softmax(kind: str, sub: str) -> None:
    eager, sdpa = model_twins(kind)
    attn, _, _ = ATTENTION[kind]
    ids = tokens()
    edit, by_hand = TWIN_EDITS[sub]
    with edited_inside(eager.get_submodule(attn), EditOp("softmax", by_hand)) as mode:
        expected = hidden(eager, ids)
    assert mode.seen == 1
    with torch.no_grad():
        out, editor = hs.run_with_edits(sdpa, ids, edits={f"{attn}:attn.{sub}": edit})
    assert editor.applied == {f"{attn}:attn.{sub}": 1}
    assert not torch.allclose(hidden(sdpa, ids), expected, atol=1e-4)
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.transformers
@pytest.mark.parametrize("kind", list(ATTENTION))
def test_a_head_zeroed_at_attn_z_equals_a_pre_hook_on_the_output_projection(kind: str) -> None:
    _, sdpa = model_twins(kind)
    attn, projection, size = ATTENTION[kind]
    ids = tokens()

    def zero_head_1(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        merged = args[0].clone()
        merged[..., size : 2 * size] = 0.0  # head 1: the second block of the merged heads
        return (merged,)

    handle = sdpa.get_submodule(f"{attn}.{projection}").register_forward_pre_hook(zero_head_1)
    try:
        expected = hidden(sdpa, ids)
    finally:
        handle.remove()
    seen: list[tuple[str, tuple[int, ...]]] = []

    def spy(z: torch.Tensor, ctx: hs.EditContext) -> torch.Tensor:
        seen.append((ctx.site, tuple(z.shape)))
        return z

    with torch.no_grad():
        out, _ = hs.run_with_edits(sdpa, ids, edits={f"{attn}:attn.z": [spy, hs.edits.zero(heads=1)]})
        by_function, _ = hs.run_with_edits(
            sdpa, ids, edits={f"{attn}:attn.z": lambda z, ctx: z.index_fill(1, torch.tensor([1]), 0.0)}
        )
    assert seen == [(f"{attn}#0:attn.z", (2, 4 if kind == "llama-gqa" else 2, 8, size))]
    assert not torch.allclose(hidden(sdpa, ids), expected)
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(by_function.last_hidden_state, out.last_hidden_state, rtol=0, atol=0)


@pytest.mark.transformers
def test_an_edited_value_reruns_the_kernel_with_the_calls_own_arguments() -> None:
    _, sdpa = model_twins("llama-gqa")  # two key/value heads for four query heads
    ids = tokens()

    def doubled_value(args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        q, k, v, *rest = args
        return functional.scaled_dot_product_attention(q, k, v * 2, *rest, **kwargs)

    with edited_inside(sdpa.get_submodule("layers.0.self_attn"), EditOp("scaled_dot_product_attention", doubled_value)):
        expected = hidden(sdpa, ids)
    with torch.no_grad():
        out, editor = hs.run_with_edits(sdpa, ids, edits={"layers.0.self_attn:attn.v": hs.edits.scale(2.0)})
    assert editor.applied == {"layers.0.self_attn:attn.v": 1}
    assert not torch.allclose(hidden(sdpa, ids), expected)
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=0, atol=1e-6)


@pytest.mark.transformers
def test_a_sub_site_on_an_eager_model_and_a_pattern_edit_under_dropout_are_refused() -> None:
    eager, sdpa = model_twins("gpt2")
    ids = tokens()
    with pytest.raises(EditError, match="never called torch.nn.functional.scaled_dot_product_attention"):
        hs.run_with_edits(eager, ids, edits={"h.0.attn:attn.pattern": hs.edits.zero()})
    sdpa.train()  # GPT-2's attn_pdrop 0.1 goes to the kernel
    try:
        with pytest.raises(EditError, match=r"h.0.attn#0:attn.pattern: .* dropout_p=0.1"):
            hs.run_with_edits(sdpa, ids, edits={"h.0.attn:attn.pattern": hs.edits.zero()})
    finally:
        sdpa.eval()
    assert len(hs.attached(sdpa)) == 0
    assert len(hs.attached(eager)) == 0


@pytest.mark.transformers
def test_heads_alone_is_refused_outside_an_attention_sub_site() -> None:
    model = attention_gpt2("sdpa")
    with pytest.raises(EditError, match=r"h.0.attn#0:op\[scaled_dot_product_attention#0\]: heads=\[1\] without"):
        hs.run_with_edits(
            model, attention_tokens(), edits={"h.0.attn:op[scaled_dot_product_attention]": hs.edits.zero(heads=1)}
        )
    with pytest.raises(EditError, match=r"h.0.attn#0:attn.z: num_heads=2 reads the last dim.*drop num_heads="):
        hs.run_with_edits(model, attention_tokens(), edits={"h.0.attn:attn.z": hs.edits.zero(heads=1, num_heads=2)})


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.transformers
def test_cli_edits_op_sites_and_attention_sub_sites(capsys: pytest.CaptureFixture[str]) -> None:
    model = "hf-config:gpt2?n_layer=2&n_embd=32&n_head=2"
    code, out, err = run_cli(
        capsys, "edit", model, "-s", "1x8", "-e", "h.0.attn:attn.z=zero:heads=1", "-e", "h.1:op[add#0]=scale:factor=0"
    )
    assert code == 0, err
    assert "edits on h.0.attn:attn.z (1 edit), h.1:op[add#0] (1 edit)" in out
    assert "cosine similarity 1.000000" not in out
    code, _, err = run_cli(capsys, "edit", model, "-s", "1x8", "-e", "h.0.attn:op[sofmax]=zero")
    assert code == 2
    assert "matched no op call of 'h.0.attn'" in err
    assert "Traceback" not in err
