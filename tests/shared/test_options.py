"""One options object per feature, and one verb scheme: every way in takes the same options."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from hookscope.errors import SpecError
from tests.models import SharedTwice, SmallCNN, gpt2_input, tiny_gpt2, track

#: Each options class and the public functions that take it.
FORMS: list[tuple[type[Any], list[Callable[..., Any]]]] = [
    (hs.CaptureOptions, [hs.capture, hs.run_with_capture]),
    (hs.TraceOptions, [hs.tracing, hs.trace, hs.run_with_trace]),
    (hs.EditOptions, [hs.edit, hs.run_with_edits]),
    (hs.ExtractConfig, [hs.extract]),
]


def option_fields(options: type[Any]) -> list[dataclasses.Field[Any]]:
    return [field for field in dataclasses.fields(options) if field.init]


@pytest.mark.parametrize(("options", "forms"), FORMS, ids=lambda value: getattr(value, "__name__", ""))
def test_every_form_shows_every_option_with_its_default(options: type[Any], forms: list[Callable[..., Any]]) -> None:
    for form in forms:
        parameters = inspect.signature(form).parameters
        for field in option_fields(options):
            assert field.name in parameters, f"{form.__name__} does not show {field.name}="
            assert parameters[field.name].default == field.default, (form.__name__, field.name)
            assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert "options" in parameters
        assert "opts" not in parameters  # the catch-all is replaced by the fields


def test_the_one_shot_capture_takes_every_capture_option_including_passes() -> None:
    model = SharedTwice()
    x = torch.randn(2, 4)
    # passes= was missing from run_with_capture before the options had one declaration: it went
    # to the model's forward, which has no such argument.
    _, cache = hs.run_with_capture(model, x, layers="shared", passes="all", calls="first")
    with torch.no_grad():
        want = model.shared(x)  # the first of its two calls
    assert cache.sites() == [hs.Site("shared", 0, "output", "")]
    assert torch.equal(cache["shared"], want)
    with pytest.raises(SpecError, match="passes='every' is not 'latest'"):
        hs.run_with_capture(model, x, layers="shared", passes="every")


def test_a_model_keyword_named_options_is_pointed_to_model_kwargs() -> None:
    class TakesOptions(nn.Module):
        def forward(self, x: torch.Tensor, options: str = "") -> torch.Tensor:
            return x * 2 if options == "double" else x

    model = TakesOptions()
    for run in (
        lambda **kw: hs.run_with_capture(model, torch.ones(1), layers="", **kw),
        lambda **kw: hs.run_with_trace(model, torch.ones(1), **kw),
        lambda **kw: hs.run_with_edits(model, torch.ones(1), edits={"": hs.edits.scale(1.0)}, **kw),
    ):
        with pytest.raises(SpecError, match=r"to pass options= to the model, use model_kwargs=\{'options': \.\.\.\}"):
            run(options="double")
        out, _ = run(model_kwargs={"options": "double"})
        assert torch.equal(out, torch.full((1,), 2.0))


@pytest.mark.slow
@pytest.mark.transformers
def test_an_options_object_and_keywords_capture_the_same_values_on_gpt2() -> None:
    model = tiny_gpt2()
    ids = gpt2_input()
    reference: dict[str, torch.Tensor] = {}
    handles = [
        model.h[i].mlp.register_forward_hook(
            lambda _m, _a, out, i=i: reference.__setitem__(f"h.{i}.mlp", out.detach().mean(1).to(torch.bfloat16))
        )
        for i in range(2)
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    options = hs.CaptureOptions(dtype="bf16", reduce="mean:1")
    with torch.no_grad():
        _, by_object = hs.run_with_capture(model, input_ids=ids, layers="h.*.mlp", options=options)
        _, by_keywords = hs.run_with_capture(model, input_ids=ids, layers="h.*.mlp", dtype="bf16", reduce="mean:1")
        with hs.capture(model, layers=["h.0.mlp", "h.1.mlp"], options=options) as scoped:
            model(input_ids=ids)
    for name, want in reference.items():
        for cache in (by_object, by_keywords, scoped.cache):
            assert cache[name].dtype == torch.bfloat16
            assert torch.equal(cache[name], want), name
    assert scoped.options == options


def test_keywords_change_an_options_object_without_touching_it() -> None:
    base = hs.CaptureOptions(keep="both")
    model = SmallCNN()
    with hs.capture(model, "fc", options=base, detach=False) as made:
        model(torch.randn(1, 3, 32, 32))
    assert made.options == dataclasses.replace(base, detach=False)
    assert made["fc"].requires_grad  # keep="both" and detach=False, together
    assert made["fc:input"].requires_grad
    assert base.detach is True  # frozen: the caller's object is never changed


def test_a_bad_option_is_refused_before_any_hook_is_attached() -> None:
    model = track(SmallCNN())
    for bad in ({"copy": 3}, {"keep": "weights"}, {"calls": "last", "stop": True}, {"device": "gpu:7"}):
        with pytest.raises(SpecError):
            hs.capture(model, "fc", **bad)
        assert hs.attached(model) == []
    with pytest.raises(SpecError, match=r"capture has no option 'detatch'; did you mean 'detach'\?"):
        hs.capture(model, "fc", detatch=False)
    with pytest.raises(SpecError, match="options= takes capture's options, a CaptureOptions"):
        hs.capture(model, "fc", options=hs.TraceOptions())  # type: ignore[arg-type]
    assert hs.attached(model) == []


def test_a_bad_device_is_a_spec_error_not_a_torch_runtime_error() -> None:
    with pytest.raises(SpecError, match="device='gpu:7' is not a torch device"):
        hs.CaptureOptions(device="gpu:7")


def test_extract_accepts_exactly_what_a_capture_accepts(tmp_path: Path) -> None:
    model = SmallCNN()
    data = torch.randn(4, 3, 32, 32)
    for bad in ({"keep": "weights"}, {"calls": -1}, {"dtype": "int8"}):
        with pytest.raises(SpecError) as by_capture:
            hs.capture(model, "fc", **bad)
        with pytest.raises(SpecError) as by_extract:
            hs.extract(model, data, tmp_path / "never.zarr", layers="fc", progress=False, **bad)
        assert str(by_extract.value) == str(by_capture.value)
    assert not (tmp_path / "never.zarr").exists()


def test_the_store_records_what_the_config_says_it_records(tmp_path: Path) -> None:
    pytest.importorskip("zarr")
    model = SmallCNN()
    config = hs.ExtractConfig(dtype="fp16", calls="first", batch_size=2, progress=False, compression_level=None)
    store = hs.extract(model, torch.randn(4, 3, 32, 32), tmp_path / "f.zarr", layers=["fc"], options=config)
    stored = store.meta["config"]
    # Spelled as stores made before the options object spelled them, so those still resume.
    expected = {"keep": "output", "calls": "first", "dtype": "float16", "mask": "attention_mask"}
    assert {key: stored[key] for key in expected} == expected
    assert (stored["eval_mode"], stored["compression_level"]) == (True, None)
    assert store["fc"].dtype == "float16"


def test_an_option_name_given_a_tensor_was_meant_for_the_model() -> None:
    model = nn.TransformerDecoderLayer(d_model=8, nhead=2, batch_first=True).eval()
    x, memory = torch.randn(1, 3, 8), torch.randn(1, 4, 8)
    with pytest.raises(SpecError, match=r"memory= is trace's own option.*model_kwargs=\{'memory': \.\.\.\}"):
        hs.run_with_trace(model, x, memory=memory)
    out, traced = hs.run_with_trace(model, x, model_kwargs={"memory": memory})
    with torch.no_grad():
        assert torch.equal(out, model(x, memory))
    assert traced[0].name == ""


@pytest.mark.transformers
def test_run_with_trace_returns_the_output_and_the_trace_of_the_same_forward() -> None:
    model = tiny_gpt2()
    ids = gpt2_input()
    out, traced = hs.run_with_trace(model, input_ids=ids, layers=r"re:h\.\d+$", options=hs.TraceOptions(stats=True))
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state
    assert torch.equal(out.last_hidden_state, want)
    assert [row.name for row in traced] == ["h.0", "h.1"]
    seen: dict[str, torch.Tensor] = {}

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        seen["h.1"] = output if isinstance(output, torch.Tensor) else output[0]

    handle = model.h[1].register_forward_hook(keep)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    expected = seen["h.1"].double()
    stats = traced["h.1"].outputs[0].stats
    assert stats is not None
    assert stats.max == pytest.approx(expected.max().item(), rel=1e-6)
    assert stats.mean == pytest.approx(expected.mean().item(), rel=1e-5, abs=1e-6)
    assert [row.name for row in hs.trace(model, input_ids=ids, layers=r"re:h\.\d+$")] == ["h.0", "h.1"]


def test_grad_is_a_run_option_of_the_one_shot_trace() -> None:
    model = nn.Linear(2, 2)
    out, _ = hs.run_with_trace(model, torch.ones(1, 2), grad=True)
    assert out.requires_grad
    out, _ = hs.run_with_trace(model, torch.ones(1, 2))
    assert not out.requires_grad
    with pytest.raises(SpecError, match="grad= is trace's own option"):
        hs.run_with_trace(model, torch.ones(1, 2), grad=torch.ones(1))


def test_layers_chooses_modules_everywhere() -> None:
    model = SmallCNN()
    x = torch.randn(2, 3, 32, 32)
    with hs.capture(model, layers="fc") as positional_free:
        model(x)
    with hs.capture(model, "fc") as positional:
        model(x)
    assert torch.equal(positional_free["fc"], positional["fc"])
    with pytest.raises(SpecError, match="both positionally and as layers="):
        hs.capture(model, "fc", layers="conv1")
    with hs.watch_grads(model, layers="fc", params=False) as monitor:
        model(x).sum().backward()
        monitor.step()
    assert {record.module for step in monitor.records for record in step.records} == {"fc"}


@pytest.mark.slow
def test_the_old_sites_name_of_report_and_plots_still_works_with_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = SmallCNN()
    x = torch.randn(1, 3, 32, 32)
    with pytest.warns(FutureWarning, match="sites= is now layers="):
        page = hs.report(model, x, out=tmp_path / "r.html", sites="conv1").read_text()
    assert "feature maps of conv1#0" in page
    assert "feature maps of relu#0" not in page
    with pytest.raises(SpecError, match="both layers= and sites="):
        hs.report(model, x, out=tmp_path / "r.html", layers="fc", sites="conv1")


def test_run_with_edits_returns_the_output_and_the_editor() -> None:
    model = SmallCNN()
    x = torch.randn(2, 3, 32, 32)
    out, editor = hs.run_with_edits(model, x, edits={"conv1": hs.edits.zero(channels=[0])})
    with torch.no_grad(), hs.edit(model, {"conv1": hs.edits.zero(channels=[0])}):
        want = model(x)
    assert torch.equal(out, want)
    assert isinstance(editor, hs.Editor)
    assert editor.applied == {"conv1": 1}
    assert not editor.live
    assert hs.attached(model) == []


@settings(max_examples=60, deadline=None)
@given(
    keep=st.sampled_from(["output", "input", "both", ("input", "output"), ["output"]]),
    detach=st.booleans(),
    device=st.sampled_from([None, "cpu", torch.device("cpu"), "meta"]),
    dtype=st.sampled_from([None, "bf16", "float16", torch.float64]),
    reduce=st.sampled_from([None, "mean:1", "last:1", "norm:-1"]),
    calls=st.one_of(
        st.sampled_from(["all", "first", "last"]), st.integers(0, 5), st.lists(st.integers(0, 5), min_size=1)
    ),
    max_bytes=st.one_of(st.none(), st.integers(1, 1 << 40), st.sampled_from(["1GiB", "512MiB"])),
    copy=st.sampled_from(["auto", True, False]),
    passes=st.sampled_from(["latest", "all"]),
)
def test_capture_options_survive_a_round_trip_through_a_dict(**values: Any) -> None:
    options = hs.CaptureOptions(**values)
    again = hs.CaptureOptions.from_dict(json.loads(json.dumps(options.to_dict())))  # as a file would hold it
    assert again == options
    assert hash(again) == hash(options)
    assert (again.sides, again.torch_dtype, again.budget) == (options.sides, options.torch_dtype, options.budget)
    assert pickle.loads(pickle.dumps(options)) == options


def test_equal_choices_spelled_differently_are_equal_options() -> None:
    assert hs.CaptureOptions(keep=("input", "output"), dtype="bf16", calls=[2, 0], max_bytes="1KiB") == (
        hs.CaptureOptions(keep="both", dtype=torch.bfloat16, calls=(0, 2), max_bytes=1024)
    )
    assert hs.CaptureOptions(keep=["output"], dtype="float32").changes() == {"dtype": torch.float32}
    assert hs.EditOptions(calls=[1, 0]) == hs.EditOptions(calls=(0, 1))


def test_a_function_reduction_is_named_in_a_dict_and_refused_back() -> None:
    def my_reduce(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.sum(0)

    stored = hs.CaptureOptions(reduce=my_reduce).to_dict()
    assert stored["reduce"] == "<test_a_function_reduction_is_named_in_a_dict_and_refused_back.<locals>.my_reduce>"
    with pytest.raises(
        SpecError, match=r"reduce=<.*my_reduce> in the stored CaptureOptions stands for a Python object"
    ):
        hs.CaptureOptions.from_dict(stored)
    with_keys = hs.ExtractConfig(reduce={nn.Linear: "mean:1", "fc": my_reduce}, inputs=lambda b: ((b,), {}))
    text = json.dumps(with_keys.to_dict())  # class keys and functions are named, so a store's JSON can hold them
    assert '"<Linear>": "mean:1"' in text
    with pytest.raises(SpecError, match="stands for a Python object"):
        hs.ExtractConfig.from_dict(json.loads(text))


def test_a_stored_dict_of_another_version_is_refused() -> None:
    stored = {**hs.TraceOptions(timing=True).to_dict(), "version": 99}
    with pytest.raises(SpecError, match="TraceOptions of version 99"):
        hs.TraceOptions.from_dict(stored)
    assert hs.TraceOptions.from_dict(hs.TraceOptions(timing=True).to_dict()) == hs.TraceOptions(timing=True)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("on", ["output", "input"])
def test_applied_does_not_count_a_checkpointed_block_recomputing(reentrant: bool, on: str) -> None:
    model = Checkpointed(reentrant)
    x = torch.randn(3, 4, requires_grad=True)
    with hs.edit(model, {"block.0": hs.edits.scale(2.0)}, on=on) as editor:  # type: ignore[arg-type]
        model(x).sum().backward()  # block.0 runs again in backward, edited again
    assert editor.applied == {"block.0": 1}
    got = x.grad
    x.grad = None
    lin, head = model.block[0], model.head
    reference = head(torch.tanh(2 * lin(x) if on == "output" else lin(2 * x)))  # the edit by hand
    (want,) = torch.autograd.grad(reference.sum(), x)
    torch.testing.assert_close(got, want)


def test_the_classes_still_take_their_options_as_keywords() -> None:
    model = SmallCNN()
    with hs.Tracer(model, layers="fc", stats=False) as tracer:
        model(torch.randn(1, 3, 32, 32))
    assert [row.name for row in tracer.trace] == ["fc"]
    assert tracer.options == hs.TraceOptions(stats=False)
    with hs.Editor(model, {"fc": hs.edits.zero()}, on="output", calls="all") as editor:
        assert not model(torch.randn(1, 3, 32, 32)).any()
    assert editor.options == hs.EditOptions()


def test_edit_options_refuse_what_cannot_be_edited() -> None:
    model = SmallCNN()
    with pytest.raises(SpecError, match="on='grad' is not 'output'"):
        hs.edit(model, {"fc": hs.edits.zero()}, on="grad")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="calls='last'"):
        hs.edit(model, {"fc": hs.edits.zero()}, calls="last")
    assert hs.attached(model) == []
