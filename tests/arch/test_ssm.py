"""State-space sub-sites: Mamba and Mamba-2 mixers read and edited through the forward tap.

The reference is written out here without hookscope: the mixer's arguments from a raw pre-hook,
its weights, and the recurrence token by token in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

import hookscope as hs
from hookscope.errors import EditError, SpecError, UnsupportedModelError
from tests.models import track

pytestmark = pytest.mark.transformers

MIXER = "backbone.layers.1.mixer"
KINDS2 = ("z", "conv", "x", "B", "C", "dt", "decay", "pattern", "y", "out")


def mamba2() -> nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(
        hidden_size=32, expand=2, num_heads=4, head_dim=16, n_groups=2, state_size=8, chunk_size=4,
        num_hidden_layers=2, vocab_size=100, use_cache=False,
    )  # fmt: skip
    return track(Mamba2ForCausalLM(config).eval())


def mamba1() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(
        hidden_size=32, intermediate_size=64, state_size=8, num_hidden_layers=2, vocab_size=100, time_step_rank=4,
        use_cache=False,
    )  # fmt: skip
    return track(MambaForCausalLM(config).eval())


def tokens(batch: int = 2, seq: int = 9) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(0))


def mixer_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    seen: dict[str, torch.Tensor] = {}
    handle = model.get_submodule(MIXER).register_forward_pre_hook(
        lambda _, args: seen.__setitem__("hidden", args[0]), prepend=True
    )
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return seen["hidden"]


def reference2(m: Any, hidden: torch.Tensor, edit: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Mamba-2's values in float64, token by token; ``edit[kind](value)`` changes one on the way."""
    edit = edit or {}
    change = lambda kind, value: edit[kind](value) if kind in edit else value  # noqa: E731
    heads, head_dim, groups, n = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size
    inner = heads * head_dim
    h = hidden.double()
    projected = h @ m.in_proj.weight.double().T
    z, branch, dt_raw = projected.split([inner, projected.shape[-1] - inner - heads, heads], dim=-1)
    z = change("z", z)
    seq = h.shape[1]
    conv = functional.conv1d(
        branch.transpose(1, 2), m.conv1d.weight.double(), m.conv1d.bias.double(), padding=m.conv1d.kernel_size[0] - 1,
        groups=branch.shape[-1],
    )[..., :seq]  # fmt: skip
    conv = change("conv", functional.silu(conv).transpose(1, 2))
    x, b, c = conv.split([inner, groups * n, groups * n], dim=-1)
    x = change("x", x.reshape(*x.shape[:2], heads, head_dim))
    b = change("B", b.reshape(*b.shape[:2], groups, n)).repeat_interleave(heads // groups, dim=2)
    c = change("C", c.reshape(*c.shape[:2], groups, n)).repeat_interleave(heads // groups, dim=2)
    dt = change("dt", functional.softplus(dt_raw + m.dt_bias.double()))
    decay = change("decay", torch.exp(-torch.exp(m.A_log.double()) * dt))
    state = torch.zeros(h.shape[0], heads, head_dim, n, dtype=torch.float64)
    states, ys = [], []
    for t in range(seq):
        state = decay[:, t, :, None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        states.append(state)
        ys.append(torch.einsum("bhpn,bhn->bhp", state, c[:, t]) + m.D.double()[:, None] * x[:, t])
    pattern = torch.zeros(h.shape[0], heads, seq, seq, dtype=torch.float64)
    for t in range(seq):
        for s in range(t + 1):
            pattern[:, :, t, s] = (c[:, t] * b[:, s]).sum(-1) * decay[:, s + 1 : t + 1].prod(dim=1)
    y = torch.stack(ys, dim=1)
    if "pattern" in edit:
        pattern = edit["pattern"](pattern)
        y = torch.einsum("bhts,bshp->bthp", pattern, x * dt[..., None]) + m.D.double()[:, None] * x
    y = change("y", y.reshape(*y.shape[:2], inner))
    gated = y * functional.silu(z)
    grouped = gated.reshape(*gated.shape[:2], groups, -1)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + m.norm.variance_epsilon)
    out = change("out", m.norm.weight.double() * normed.reshape(gated.shape))
    values = {
        "z": z,
        "conv": conv,
        "x": x,
        "dt": dt,
        "decay": decay,
        "pattern": pattern,
        "y": y,
        "out": out,
        "states": torch.stack(states, 1),
    }
    values["B"], values["C"] = b[:, :, :: heads // groups], c[:, :, :: heads // groups]
    values["output"] = out @ m.out_proj.weight.double().T
    return values


def with_mixer_output(model: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The logits with the mixer's output replaced by ``output``, by a raw forward hook."""
    handle = model.get_submodule(MIXER).register_forward_hook(lambda *_: output.float())
    try:
        with torch.no_grad():
            return model(x).logits  # type: ignore[no-any-return]
    finally:
        handle.remove()


def test_every_mamba2_value_equals_the_float64_recurrence_and_the_output_stays() -> None:
    model = mamba2()
    x = tokens()
    mixer = model.get_submodule(MIXER)
    want = reference2(mixer, mixer_input(model, x))
    with torch.no_grad():
        clean = model(x).logits
        out, cache = hs.run_with_capture(
            model, x, layers=[*(f"{MIXER}:ssm.{kind}" for kind in KINDS2), f"{MIXER}:ssm.state"]
        )
    assert torch.equal(out.logits, clean)
    for kind in KINDS2:
        got = cache[f"{MIXER}#0:ssm.{kind}#0"].double()
        assert got.shape == want[kind].shape, kind
        assert torch.allclose(got, want[kind], rtol=1e-4, atol=1e-6), kind
    for t in range(x.shape[1]):
        assert torch.allclose(cache[f"{MIXER}#0:ssm.state#{t}"].double(), want["states"][:, t], atol=1e-6)
    # the pattern's definition: y = pattern (dt x) + D x, per head
    stepped = want["x"] * want["dt"][..., None]
    via = torch.einsum("bhts,bshp->bthp", cache[f"{MIXER}#0:ssm.pattern#0"].double(), stepped)
    via = via + mixer.D.double()[:, None] * want["x"]  # type: ignore[index]
    assert torch.allclose(via.reshape(want["y"].shape), want["y"], atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("decay", lambda value: value * 0.5),
        ("B", lambda value: value.flip(1)),
        ("z", lambda value: torch.zeros_like(value)),
        (
            "pattern",
            lambda value: torch.diagonal_scatter(value, torch.zeros_like(value.diagonal(0, -2, -1)), 0, -2, -1),
        ),
    ],
)
def test_an_edit_of_a_mamba2_value_feeds_the_rest_of_the_mixer(kind: str, change: Any) -> None:
    model = mamba2()
    x = tokens()
    mixer = model.get_submodule(MIXER)
    want = reference2(mixer, mixer_input(model, x), {kind: change})
    expected = with_mixer_output(model, x, want["output"])
    with torch.no_grad():
        out, editor = hs.run_with_edits(
            model, x, edits={f"{MIXER}:ssm.{kind}": lambda value, ctx: change(value.double()).to(value.dtype)}
        )
    assert torch.allclose(out.logits, expected, atol=1e-5)
    assert not torch.allclose(out.logits, model(x).logits, atol=1e-4)
    assert editor.applied == {f"{MIXER}:ssm.{kind}": 1}


def test_mamba1_values_and_an_edit_equal_the_float64_recurrence() -> None:
    model = mamba1()
    x = tokens()
    m: Any = model.get_submodule(MIXER)
    hidden = mixer_input(model, x).double()
    projected = hidden @ m.in_proj.weight.double().T
    branch, z = projected.chunk(2, dim=-1)
    seq = x.shape[1]
    conv = functional.conv1d(
        branch.transpose(1, 2), m.conv1d.weight.double(), m.conv1d.bias.double(), padding=m.conv1d.kernel_size[0] - 1,
        groups=branch.shape[-1],
    )[..., :seq]  # fmt: skip
    xs = functional.silu(conv).transpose(1, 2)
    rank, n = m.time_step_rank, m.ssm_state_size
    step, b, c = (xs @ m.x_proj.weight.double().T).split([rank, n, n], dim=-1)
    dt = functional.softplus(step @ m.dt_proj.weight.double().T + m.dt_proj.bias.double())

    def run(decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = torch.zeros(x.shape[0], xs.shape[-1], n, dtype=torch.float64)
        ys = []
        for t in range(seq):
            state = decay[:, t] * state + (dt[:, t, :, None] * b[:, t, None, :]) * xs[:, t, :, None]
            ys.append(state @ c[:, t, :, None])
        y = torch.cat(ys, dim=-1).transpose(1, 2) + m.D.double() * xs
        return y, (y * functional.silu(z)) @ m.out_proj.weight.double().T

    decay = torch.exp(-torch.exp(m.A_log.double())[None, None] * dt[..., None])
    y, _ = run(decay)
    with torch.no_grad():
        _, cache = hs.run_with_capture(model, x, layers=[f"{MIXER}:ssm.{k}" for k in ("dt", "decay", "B", "y")])
        out, _ = hs.run_with_edits(model, x, edits={f"{MIXER}:ssm.decay": hs.edits.scale(0.25)})
    for kind, value in (("dt", dt), ("decay", decay), ("B", b), ("y", y)):
        assert torch.allclose(cache[f"{MIXER}#0:ssm.{kind}#0"].double(), value, rtol=1e-4, atol=1e-6), kind
    _, edited = run(decay * 0.25)
    assert torch.allclose(out.logits, with_mixer_output(model, x, edited), atol=1e-5)


def test_what_the_tap_cannot_do_is_refused_with_the_reason() -> None:
    model = mamba2()
    x = tokens()
    with pytest.raises(EditError, match="read only"):
        hs.run_with_edits(model, x, edits={f"{MIXER}:ssm.state#2": hs.edits.zero()})
    with pytest.raises(SpecError, match="is not a Mamba or Mamba-2 mixer"):
        hs.capture(model, layers="backbone.layers.1:ssm.y")
    with pytest.raises(SpecError, match="only ssm.state takes a position"):
        hs.capture(model, layers=f"{MIXER}:ssm.y#3")
    with pytest.raises(SpecError, match="no one attention matrix per head"):
        hs.capture(mamba1(), layers=f"{MIXER}:ssm.pattern")
    with torch.no_grad():
        first = model(x[:, :-1], use_cache=True)
        with pytest.raises(UnsupportedModelError, match="use_cache=False"), hs.capture(model, layers=f"{MIXER}:ssm.y"):
            model(x[:, -1:], cache=first.cache, use_cache=True)


def test_a_mixer_whose_arithmetic_differs_is_refused_not_read_wrongly() -> None:
    model = mamba2()
    mixer = model.get_submodule(MIXER)
    handle = mixer.out_proj.register_forward_hook(lambda _, __, output: output * 2)  # a variant: twice the output
    try:
        with pytest.raises(UnsupportedModelError, match="does not reproduce its output"):
            hs.run_with_capture(model, tokens(), layers=f"{MIXER}:ssm.y")
    finally:
        handle.remove()


def test_std_names_name_the_mixer_and_its_values_on_both_mambas() -> None:
    for model in (mamba2(), mamba1()):
        std = hs.std_map(model)
        assert std["blocks.1.mixer"].read == f"{MIXER}:output"
        assert std["blocks.1.mixer.decay"].read == f"{MIXER}:ssm.decay#0"
        assert "mixer in place of attention" in std.missing["blocks.1.attn"]
        assert "ssm.state#5" in std.missing["blocks.1.mixer.state"]
        x = tokens()
        with torch.no_grad():
            _, cache = hs.run_with_capture(model, x, layers=["std:blocks.1.mixer.*", "std:blocks.1.mixer", f"{MIXER}"])
        assert torch.equal(cache["std:blocks.1.mixer"], cache[MIXER])
        assert torch.equal(cache["std:blocks.1.mixer.y"], cache[f"{MIXER}#0:ssm.y#0"])
    assert "pattern" in hs.std_map(mamba2())["blocks.0.mixer.pattern"].read
    assert "no one attention matrix" in hs.std_map(mamba1()).missing["blocks.0.mixer.pattern"]


@pytest.mark.parametrize("build", [mamba2, mamba1])
def test_verify_rates_the_mixers_supported(build: Any) -> None:
    report = hs.verify(build(), checks=["ssm", "std"], compile=False)
    rows = {row.check: row for row in report.rows}
    assert rows["state-space mixers"].status == "SUPPORTED"
    assert rows["edit state-space"].status == "SUPPORTED"
    assert report.ok


def test_an_edit_beside_a_hook_inside_the_mixer_is_refused_not_dropped() -> None:
    model = mamba2()
    mixer = model.get_submodule(MIXER)
    x = tokens()
    with pytest.raises(UnsupportedModelError, match="a hook inside it"):
        hs.run_with_edits(model, x, edits={f"{MIXER}.out_proj": hs.edits.zero(), f"{MIXER}:ssm.y": hs.edits.scale(1.0)})
    assert mixer is model.get_submodule(MIXER)
    with pytest.raises(SpecError, match="separate runs"):
        hs.capture(model, layers=[f"{MIXER}:ssm.y", f"{MIXER}:op[cat]"])
    with pytest.raises(hs.CaptureError, match="no gradient"):
        hs.capture(model, layers=f"{MIXER}:ssm.x", grads=True)
