"""Experts as sites: fused mixture-of-experts modules read and edited through the tap.

Every reference here is made without hookscope: the experts module's arguments from a raw
pre-hook, its 3-D weights, float64 arithmetic, and raw hooks that change the routing.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._arch.experts import fused_experts
from hookscope._core.op_sites import op_pattern
from hookscope._core.sites import Site
from hookscope.errors import EditError, SpecError
from tests.models import track

pytestmark = pytest.mark.transformers

#: Five families whose tiny configs transformers builds here: gated (concatenated and interleaved
#: with clamps and biases: gpt-oss), a shared expert beside them (Qwen2-MoE), a MoE block named
#: ``block_sparse_moe`` (Granite-MoE).
FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe")


@cache
def _built(model_type: str) -> nn.Module:
    from zoo.tiny import build_tiny

    model: nn.Module = build_tiny(model_type).model
    return model.eval()


def tiny(model_type: str) -> nn.Module:
    return track(_built(model_type))


def experts_of(model: nn.Module, layer: int = 1) -> tuple[str, nn.Module]:
    found = [(n, m) for n, m in model.named_modules() if fused_experts(m) is not None and f".{layer}." in n]
    return found[0]


def tokens(batch: int = 3, seq: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits  # type: ignore[no-any-return]


def raw_arguments(model: nn.Module, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    seen: dict[str, tuple[torch.Tensor, ...]] = {}
    handle = module.register_forward_pre_hook(lambda _, args: seen.__setitem__("args", args))
    try:
        logits(model, x)
    finally:
        handle.remove()
    return seen["args"]


def rerouted(model: nn.Module, module: nn.Module, x: torch.Tensor, expert: int, factor: float) -> torch.Tensor:
    """The logits with expert ``expert``'s routing weights times ``factor``, by a raw pre-hook."""

    def change(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, choice, weights = args
        return hidden, choice, torch.where(choice == expert, weights * factor, weights)

    handle = module.register_forward_pre_hook(change)
    try:
        return logits(model, x)
    finally:
        handle.remove()


def reference(module: Any, args: tuple[torch.Tensor, ...]) -> dict[tuple[str, int], torch.Tensor]:
    """Every expert's values in float64, from the fused weights, written out by hand."""
    hidden, choice, weights = args
    hidden = hidden.double()
    values: dict[tuple[str, int], torch.Tensor] = {}
    for e in range(module.num_experts):
        token, slot = (choice == e).nonzero(as_tuple=True)
        rows = hidden[token]
        first = module.gate_up_proj[e].double()
        projected = rows @ first if module.is_transposed else rows @ first.T
        if module.has_bias:
            projected = projected + module.gate_up_proj_bias[e].double()
        half = projected.shape[-1] // 2
        if module.is_concatenated:
            gate, up = projected[:, :half], projected[:, half:]
        else:
            gate, up = projected[:, 0::2], projected[:, 1::2]
        post = module._apply_gate(projected)
        down = module.down_proj[e].double()
        out = post @ down if module.is_transposed else post @ down.T
        if module.has_bias:
            out = out + module.down_proj_bias[e].double()
        values.update(
            {
                ("in", e): rows,
                ("pre", e): gate,
                ("up", e): up,
                ("post", e): post,
                ("out", e): out,
                ("tokens", e): token,
                ("weights", e): weights[token, slot].double(),
            }
        )
    return values


def test_expert_sites_round_trip_and_selectors_name_every_expert() -> None:
    site = Site.parse("model.layers.0.mlp.experts#0:expert.post#3")
    assert (site.module, site.op, str(site)) == ("model.layers.0.mlp.experts", "expert.post#3", str(site))
    every = op_pattern("model.layers.*.mlp.experts:expert.out")
    assert every is not None
    assert every.matches("expert.out", 7)
    assert not every.matches("expert.in", 7)
    assert str(op_pattern("x#1:expert.pre#2")) == "x#1:expert.pre#2"
    with pytest.raises(SpecError, match="expert.in, expert.pre"):
        op_pattern("x:expert.gate")
    with pytest.raises(SpecError, match="e.g. ':expert.pre#0'"):
        Site.parse("x:expert.pre")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_expert_value_equals_the_float64_reference_and_the_output_stays(model_type: str) -> None:
    model = tiny(model_type)
    name, module = experts_of(model)
    x = tokens()
    clean = logits(model, x)
    want = reference(module, raw_arguments(model, module, x))
    kinds = ("in", "pre", "up", "post", "out", "tokens", "weights")
    with torch.no_grad():
        out, cache_ = hs.run_with_capture(model, x, layers=[f"{name}:expert.{kind}" for kind in kinds])
    assert torch.equal(out.logits, clean)  # grouped_mm, the default: bit for bit
    for (kind, e), value in want.items():
        got = cache_[f"{name}#0:expert.{kind}#{e}"]
        if kind == "tokens":
            assert torch.equal(got, value), (kind, e)
        else:
            assert got.shape == value.shape, (kind, e)
            assert torch.allclose(got.double(), value, rtol=1e-4, atol=1e-6), (kind, e)
    assert (
        sum(want[("tokens", e)].numel() for e in range(module.num_experts))
        == x.numel() * module.config.num_experts_per_tok
    )  # type: ignore[attr-defined]


def test_untapped_experts_run_transformers_own_function_and_the_interface_is_put_back() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model, 0)
    _, other = experts_of(model, 1)
    fused = fused_experts(module)
    assert fused is not None
    before = dict(fused.interface._local_mapping)  # type: ignore[attr-defined]
    x = tokens()
    seen: dict[str, torch.Tensor] = {}
    handle = other.register_forward_hook(lambda _, __, output: seen.__setitem__("raw", output))
    try:
        clean = logits(model, x)
        raw = seen["raw"]
        with hs.capture(model, layers=[f"{name}:expert.out#0"]) as cap:
            tapped = logits(model, x)
            assert fused.interface._local_mapping  # type: ignore[attr-defined]  # dispatchers while tapped
        assert torch.equal(seen["raw"], raw)
        assert torch.equal(tapped, clean)
    finally:
        handle.remove()
    assert fused.interface._local_mapping == before  # type: ignore[attr-defined]
    assert cap.cache[f"{name}#0:expert.out#0"].shape[-1] == module.hidden_dim  # type: ignore[operator]


def test_a_forward_that_raises_leaves_no_tap() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model)
    fused = fused_experts(module)
    assert fused is not None
    before = dict(fused.interface._local_mapping)  # type: ignore[attr-defined]
    with pytest.raises(IndexError), hs.capture(model, layers=[f"{name}:expert.in"]):
        model(torch.tensor([[10**6]]))  # an id past the vocabulary: the embedding raises
    assert fused.interface._local_mapping == before  # type: ignore[attr-defined]


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_zero_at_an_expert_output_is_a_routing_weight_of_zero(model_type: str) -> None:
    model = tiny(model_type)
    name, module = experts_of(model)
    x = tokens()
    expected = rerouted(model, module, x, 2, 0.0)
    with torch.no_grad():
        out, editor = hs.run_with_edits(model, x, edits={f"{name}:expert.out#2": hs.edits.zero()})
        by_weight, _ = hs.run_with_edits(model, x, edits={f"{name}:expert.weights#2": hs.edits.zero()})
    assert torch.equal(out.logits, expected)
    assert torch.equal(by_weight.logits, expected)
    assert editor.applied == {f"{name}:expert.out#2": 1}
    assert not torch.equal(expected, logits(model, x))  # the ablation moved the output


def test_steering_one_expert_adds_its_weight_times_the_vector_at_its_tokens() -> None:
    model = tiny("qwen3_moe")
    name, module = experts_of(model)
    x = tokens()
    vector = torch.randn(module.hidden_dim, generator=torch.Generator().manual_seed(1))  # type: ignore[arg-type]

    def steer(_: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        _, choice, weights = args
        return output + (weights * (choice == 1)).sum(-1, keepdim=True) * vector

    handle = module.register_forward_hook(steer)
    try:
        expected = logits(model, x)
    finally:
        handle.remove()
    with torch.no_grad():
        out, _ = hs.run_with_edits(model, x, edits={f"{name}:expert.out#1": hs.edits.add(vector)})
    assert torch.allclose(out.logits, expected, atol=1e-5)
    assert not torch.allclose(out.logits, logits(model, x), atol=1e-4)


def test_an_edit_of_the_gate_feeds_the_rest_of_the_expert() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model)
    x = tokens()
    expected = rerouted(model, module, x, 0, 0.0)
    with torch.no_grad():  # silu(0) * up = 0: the expert's output is 0, as if its weight were
        out, _ = hs.run_with_edits(model, x, edits={f"{name}:expert.pre#0": hs.edits.zero()})
        doubled, _ = hs.run_with_edits(model, x, edits={f"{name}:expert.weights#3": hs.edits.scale(2.0)})

    expected_doubled = rerouted(model, module, x, 3, 2.0)
    assert torch.equal(out.logits, expected)
    assert torch.equal(doubled.logits, expected_doubled)


def test_the_routing_is_changed_at_the_experts_module_s_inputs() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model)
    x = tokens()
    expected = rerouted(model, module, x, 1, 3.0)
    with torch.no_grad():
        out, editor = hs.run_with_edits(
            model,
            x,
            edits={"std:blocks.1.mlp.router.weights": lambda value, ctx: value.where(ctx.args[1] != 1, value * 3)},
        )
    assert torch.equal(out.logits, expected)
    assert editor.applied == {name: 1}


def test_tokens_cannot_be_edited_and_a_replacement_keeps_the_rows_shape() -> None:
    model = tiny("mixtral")
    name, _ = experts_of(model)
    x = tokens()
    with pytest.raises(EditError, match="cannot be edited; change the routing"):
        hs.run_with_edits(model, x, edits={f"{name}:expert.tokens#0": hs.edits.zero()})
    with pytest.raises(EditError, match=r"the edit returned shape \(1, 64\)"):
        hs.run_with_edits(model, x, edits={f"{name}:expert.out#0": lambda value, ctx: value[:1]})


def test_gradients_at_an_expert_equal_autograd_through_the_fused_weights() -> None:
    model = tiny("olmoe")
    name, module = experts_of(model)
    x = tokens()
    out, cap = hs.run_with_capture(model, x, layers=[f"{name}:expert.post"], grads=True)
    out.logits.square().mean().backward()
    got = {e: cap.grad[f"{name}#0:expert.post#{e}"].clone() for e in range(module.num_experts)}  # type: ignore[arg-type]
    model.zero_grad()
    # by hand: d loss / d post_e = (routing weight x d loss / d experts output at the row's token) @ W_down[e]
    kept: dict[str, Any] = {}

    def keep(_: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        kept["args"] = args
        output.retain_grad()
        kept["output"] = output

    handle = module.register_forward_hook(keep)
    try:
        model(x).logits.square().mean().backward()
    finally:
        handle.remove()
    model.zero_grad()
    upstream = kept["output"].grad
    _, choice, weights = kept["args"]
    for e in range(module.num_experts):  # type: ignore[arg-type]
        token, slot = (choice == e).nonzero(as_tuple=True)
        want = (weights[token, slot, None].detach().double() * upstream[token].double()) @ module.down_proj[
            e
        ].detach().double()
        assert torch.allclose(got[e].double(), want, rtol=1e-4, atol=1e-9), e


def test_batched_mm_models_are_tapped_within_rounding() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model)
    x = tokens()
    model.set_experts_implementation("batched_mm")  # type: ignore[operator]
    try:
        clean = logits(model, x)
        want = reference(module, raw_arguments(model, module, x))
        with torch.no_grad():
            out, cap = hs.run_with_capture(model, x, layers=[f"{name}:expert.post#1"])
    finally:
        model.set_experts_implementation("grouped_mm")  # type: ignore[operator]
    assert torch.allclose(out.logits, clean, atol=1e-6)
    assert torch.allclose(cap[f"{name}#0:expert.post#1"].double(), want[("post", 1)], atol=1e-6)


def test_without_transformers_grouped_product_the_tap_multiplies_expert_by_expert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hookscope._arch.experts as experts_module

    model = tiny("gpt_oss")  # transposed weights with biases
    name, module = experts_of(model)
    x = tokens()
    clean = logits(model, x)
    want = reference(module, raw_arguments(model, module, x))
    monkeypatch.setattr(experts_module, "_transformers_grouped_linear", lambda: None)
    with torch.no_grad():
        out, cap = hs.run_with_capture(model, x, layers=[f"{name}:expert.out"])
    assert torch.allclose(out.logits, clean, atol=1e-5)
    for e in range(module.num_experts):  # type: ignore[arg-type]
        assert torch.allclose(cap[f"{name}#0:expert.out#{e}"].double(), want[("out", e)], atol=1e-5)


def test_refusals_name_what_was_wrong_and_the_fix() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model)
    block = name.rsplit(".", 1)[0]
    with pytest.raises(SpecError, match="not a fused mixture-of-experts module"):
        hs.capture(model, layers=[f"{block}:expert.post"])
    with pytest.raises(SpecError, match="names no expert of .* which has 4: #0 to #3"):
        hs.capture(model, layers=[f"{name}:expert.post#9"])
    with pytest.raises(SpecError, match="own ops do not run"):
        hs.capture(model, layers=[f"{name}:expert.post", f"{name}:op[linear]"])
    with (  # the same, through two features: the op selector that never fired says why
        pytest.raises(hs.CaptureError, match="its experts are tapped"),
        hs.capture(model, layers=f"{name}:op[sort]"),
        hs.edit(model, {f"{name}:expert.out#0": hs.edits.zero()}),
        torch.no_grad(),
    ):
        model(tokens())
    module.config._experts_implementation = "sonicmoe"  # type: ignore[union-attr]
    try:
        with pytest.raises(SpecError, match="experts_implementation='grouped_mm'"):
            hs.capture(model, layers=[f"{name}:expert.post"])
    finally:
        module.config._experts_implementation = "grouped_mm"  # type: ignore[union-attr]


def test_std_names_read_the_experts_and_the_routing() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model)
    x = tokens()
    std = hs.std_map(model)
    assert std["blocks.1.mlp.experts.2.post"].read == f"{name}:expert.post#2"
    assert "blocks.1.mlp.experts.3.weights" in std
    assert "mlp.experts.{e}.pre" in std.missing["blocks.1.mlp.pre"]
    args = raw_arguments(model, module, x)
    with torch.no_grad():
        _, cap = hs.run_with_capture(model, x, layers=["std:blocks.1.mlp.experts.2.post", "std:blocks.1.mlp.router.*"])
    assert torch.equal(cap["std:blocks.1.mlp.router.choice"], args[1])
    assert torch.equal(cap["std:blocks.1.mlp.router.weights"], args[2])
    assert torch.equal(cap["std:blocks.1.mlp.experts.2.post"], cap[f"{name}#0:expert.post#2"])


def test_trace_rows_count_each_expert_s_tokens() -> None:
    model = tiny("mixtral")
    name, module = experts_of(model)
    x = tokens()
    _, choice, _ = raw_arguments(model, module, x)
    trace = hs.trace(model, x, ops=[f"{name}:expert.out"])
    rows = {row.op: row for row in trace.rows if row.op}
    for e in range(module.num_experts):  # type: ignore[arg-type]
        assert rows[f"expert.out#{e}"].outputs[0].shape[0] == int((choice == e).sum())


def test_trace_experts_gives_each_expert_s_load_and_the_router_entropy() -> None:
    model = tiny("qwen3_moe")
    name, module = experts_of(model)
    router_name = name.rsplit(".", 1)[0] + ".gate"
    router = model.get_submodule(router_name)
    x = tokens()
    seen: dict[str, Any] = {}
    handles = [
        router.register_forward_hook(lambda _, __, output: seen.__setitem__("logits", output[0])),
        module.register_forward_pre_hook(lambda _, args: seen.__setitem__("args", args)),
    ]
    try:
        logits(model, x)
    finally:
        for handle in handles:
            handle.remove()
    _, choice, weights = seen["args"]
    probabilities = torch.softmax(seen["logits"].double(), dim=-1)
    entropy = float(-(probabilities * probabilities.log()).sum(-1).mean())
    load = hs.trace(model, x, experts=True).experts()
    rows = [row for row in load.rows if row.module == name]
    assert [row.tokens for row in rows] == [int((choice == e).sum()) for e in range(module.num_experts)]  # type: ignore[arg-type]
    for row in rows:
        assert row.mean_weight == pytest.approx(float(weights[choice == row.expert].double().mean()), rel=1e-5)
    assert sum(row.share for row in rows) == pytest.approx(1.0)
    assert load.entropy[name] == [pytest.approx(entropy, rel=1e-5)]
    assert load.imbalance(name) == pytest.approx(max(r.tokens for r in rows) / (sum(r.tokens for r in rows) / 4))
    assert f"{name}#0" in str(load)
    assert "router entropy" in str(load)
    with pytest.raises(SpecError, match="holds no expert rows"):
        hs.trace(model, x).experts()
    with pytest.raises(SpecError, match="experts=True and ops=True"):
        hs.trace(model, x, experts=True, ops=True)


def test_extract_stores_each_expert_per_token(tmp_path: Path) -> None:
    model = tiny("mixtral")
    name, _ = experts_of(model)
    x = tokens(6, 7)
    store = hs.extract(
        model, x, layers=[f"{name}:expert.post#1", f"{name}:expert.tokens#1", f"{name}:expert.weights#1"],
        out=tmp_path / "experts.zarr", batch_size=4, progress=False,
    )  # fmt: skip
    with torch.no_grad():
        _, cap = hs.run_with_capture(model, x, layers=[f"{name}:expert.post#1", f"{name}:expert.tokens#1"])
    rows, token = cap[f"{name}#0:expert.post#1"], cap[f"{name}#0:expert.tokens#1"]
    dense = torch.zeros(42, rows.shape[-1])
    dense[token] = rows
    stored = torch.as_tensor(store[f"{name}#0:expert.post#1"][:])
    assert stored.shape == (6, 7, rows.shape[-1])
    assert torch.allclose(stored, dense.view(6, 7, -1))
    routed = torch.zeros(42, dtype=torch.bool)
    routed[token] = True
    assert torch.equal(torch.as_tensor(store[f"{name}#0:expert.tokens#1"][:]), routed.view(6, 7))
    assert {str(s) for s in store.sites} == {f"{name}#0:expert.{k}#1" for k in ("post", "tokens", "weights")}
    with pytest.raises(SpecError, match="stored per token"):
        hs.extract(model, x, layers=[f"{name}:expert.post#1"], out=tmp_path / "r.zarr", reduce="mean:1")


def test_verify_rates_the_experts_supported() -> None:
    model = tiny("granitemoe")
    report = hs.verify(model, checks=["experts", "std"], compile=False)
    rows = {row.check: row for row in report.rows}
    assert rows["experts"].status == "SUPPORTED"
    assert "bit for bit" in rows["experts"].detail
    assert rows["edit expert"].status == "SUPPORTED"
    assert report.ok
