"""Errors programs can handle: the facts as fields, no builtin error for bad input, exit codes in the CLI."""

from __future__ import annotations

import pickle
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope import errors
from hookscope.cli.app import EXIT_CODES, exit_code
from hookscope.errors import docs_link
from hookscope.io import load_tensors, save_tensors, tensor_file_format
from hookscope.tensors import parse_dtype
from tests.cli.test_cli import run_cli
from tests.models import LinearInplaceReLU, SharedTwice, SmallCNN

# --- the facts as fields -----------------------------------------------------------------------


class TestSelectionError:
    def test_a_typo_names_the_selector_and_the_closest_names(self) -> None:
        model = SmallCNN()
        with pytest.raises(hs.SelectionError) as info:
            hs.select(model, "conv")
        assert info.value.selector == "conv"
        assert info.value.suggestions == ("conv1",)
        assert info.value.args[0] == "selector 'conv' matched 0 of 5 modules; did you mean 'conv1'?"
        assert set(info.value.suggestions) <= {name for name, _ in model.named_modules()}

    def test_in_a_list_the_member_that_matched_nothing_is_named(self) -> None:
        with pytest.raises(hs.SelectionError) as info:
            hs.capture(SmallCNN(), ["conv1", "fcc"])
        assert info.value.selector == "fcc"
        assert info.value.suggestions == ("fc",)
        assert "(in ['conv1', 'fcc'])" in str(info.value)

    def test_the_first_suggested_pattern_selects_what_was_meant(self) -> None:
        block = lambda: nn.ModuleDict({"attn": nn.Linear(2, 2), "mlp": nn.Linear(2, 2)})  # noqa: E731
        model = nn.ModuleDict({"blocks": nn.ModuleList([block() for _ in range(3)])})
        with pytest.raises(hs.SelectionError) as info:
            hs.select(model, "blocks.*.mpl")
        assert info.value.suggestions[0] == "blocks.*.mlp"
        mlps = [name for name, _ in model.named_modules() if name.endswith(".mlp")]
        assert [name for name, _ in hs.select(model, info.value.suggestions[0])] == mlps

    def test_a_class_or_predicate_has_no_suggestions(self) -> None:
        for selector in (nn.LSTM, lambda name, module: False):
            with pytest.raises(hs.SelectionError) as info:
                hs.select(SmallCNN(), selector)
            assert info.value.selector is selector
            assert info.value.suggestions == ()


class TestSiteNotFoundError:
    def test_a_module_typo_offers_captured_names_that_resolve(self) -> None:
        model, x = SmallCNN().eval(), SmallCNN.example()
        _, cache = hs.run_with_capture(model, x, layers=["conv1", "fc"])
        with pytest.raises(hs.SiteNotFoundError) as info:
            cache["fcc"]
        assert info.value.key == "fcc"
        assert info.value.candidates == ("fc",)
        with torch.no_grad():
            assert torch.equal(cache[info.value.candidates[0]], model(x))

    def test_a_value_that_was_not_kept_offers_the_one_that_was(self) -> None:
        model, x = SmallCNN().eval(), SmallCNN.example()
        _, cache = hs.run_with_capture(model, x, layers="conv1")
        with pytest.raises(hs.SiteNotFoundError) as info:
            cache["conv1:input"]
        assert info.value.key == "conv1:input"
        assert info.value.candidates == ("conv1:output",)
        with torch.no_grad():
            assert torch.equal(cache["conv1:output"], model.conv1(x))

    def test_a_missing_call_offers_every_call_kept(self) -> None:
        model, x = SharedTwice().eval(), torch.randn(2, 4)
        _, cache = hs.run_with_capture(model, x, layers="shared")
        with pytest.raises(hs.SiteNotFoundError) as info:
            cache["shared#5"]
        assert info.value.candidates == ("shared#0:output", "shared#1:output")
        with torch.no_grad():
            first = model.shared(x)
            second = model.shared(torch.relu(first))
        assert [torch.equal(cache[c], v) for c, v in zip(info.value.candidates, (first, second), strict=True)] == [
            True,
            True,
        ]

    def test_a_value_of_several_tensors_offers_each_of_them(self) -> None:
        model = nn.Sequential(nn.Linear(3, 3), _Halves())
        x = torch.randn(2, 3)
        _, cache = hs.run_with_capture(model, x, layers="1")
        with pytest.raises(hs.SiteNotFoundError) as info:
            cache["1"]
        assert info.value.key == "1"
        assert info.value.candidates == ("1#0:output[0]", "1#0:output[1]")
        with torch.no_grad():
            low, high = model[1](model[0](x))
        assert torch.equal(cache[info.value.candidates[0]], low)
        assert torch.equal(cache[info.value.candidates[1]], high)

    def test_a_store_key_offers_the_arrays_it_may_mean(self, tmp_path: Path) -> None:
        model = SmallCNN().eval()
        rows = torch.randn(6, 3, 32, 32)
        store = hs.extract(model, rows, tmp_path / "f.zarr", layers=["conv1", "fc"], batch_size=3, progress=False)
        with pytest.raises(hs.SiteNotFoundError) as info:
            store["fcc"]
        assert info.value.key == "fcc"
        assert info.value.candidates == ("fc",)
        with torch.no_grad():
            assert np.allclose(store[info.value.candidates[0]][:], model(rows).numpy(), atol=1e-6)


class _Halves(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :1] * 1, x[:, 1:] * 1


def test_capture_error_names_the_site_that_was_changed_in_place() -> None:
    model = LinearInplaceReLU().eval()
    x = torch.randn(3, 4)
    with hs.capture(model, "fc", copy=False) as cap, torch.no_grad():
        model(x)  # the in-place ReLU writes into the Linear's output after it was captured
    with pytest.raises(hs.CaptureError) as info:
        cap.cache["fc"]
    assert info.value.site == "fc#0:output"
    assert "'fc#0:output' was changed in place" in str(info.value)


def test_capture_error_names_the_site_that_broke_the_budget() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 64)).eval()
    with pytest.raises(hs.CaptureError) as info, hs.capture(model, "*", max_bytes=300), torch.no_grad():
        model(torch.randn(2, 4))  # 2 x 4 floats fit in 300 bytes; 2 x 64 more do not
    assert info.value.site == "1#0:output"
    assert hs.attached(model) == []


# --- DataError: data that breaks its own promises ----------------------------------------------


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2)).eval()


def _row(index: int) -> torch.Tensor:
    return torch.randn(3, generator=torch.Generator().manual_seed(index))


class _Rows(torch.utils.data.Dataset[torch.Tensor]):
    """Twelve rows; the batch that starts at row ``short_at`` comes back one row short."""

    collates_itself = True

    def __init__(self, short_at: int) -> None:
        self.short_at = short_at

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return _row(index)

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        kept = indices[:-1] if indices[0] == self.short_at else indices
        return torch.stack([_row(i) for i in kept])


class _Shrinking:
    """A batch sampler whose second pass stops one batch earlier than the first (the pass that counted)."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.passes += 1
        batches = 3 if self.passes == 1 else 2
        return iter([[4 * b + i for i in range(4)] for b in range(batches)])

    def __len__(self) -> int:
        return 3


def _expected(model: nn.Module, rows: range) -> np.ndarray:
    with torch.no_grad():
        result: np.ndarray = model(torch.stack([_row(i) for i in rows])).numpy()
    return result


def test_a_batch_shorter_than_asked_is_a_data_error_and_earlier_chunks_stay(tmp_path: Path) -> None:
    model, out = _linear(), tmp_path / "f.zarr"
    with pytest.raises(hs.DataError, match=r"the batch of rows 4..7 has 3 rows, not 4") as info:
        hs.extract(model, _Rows(short_at=4), out, layers="0", batch_size=4, chunk_rows=4, progress=False)
    assert info.value.rows == range(4, 8)
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, hs.SpecError)
    store = hs.open_store(out, partial=True)
    assert store.done_chunks() == {0}
    assert np.allclose(store["0"][:4], _expected(model, range(4)), atol=1e-6)


def test_a_stream_that_ends_before_its_count_is_a_data_error(tmp_path: Path) -> None:
    model, out = _linear(), tmp_path / "f.zarr"
    dataset = torch.utils.data.TensorDataset(torch.stack([_row(i) for i in range(12)]))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=_Shrinking())  # type: ignore[arg-type]
    with pytest.raises(hs.DataError, match=r"the data yielded 8 rows; expected 12") as info:
        hs.extract(model, loader, out, layers="0", chunk_rows=4, progress=False)
    assert info.value.rows == range(8, 12)
    store = hs.open_store(out, partial=True)
    assert store.done_chunks() == {0, 1}
    assert np.allclose(store["0"][:8], _expected(model, range(8)), atol=1e-6)


# --- backwards compatible, and fields that survive a pickle --------------------------------------


@pytest.mark.parametrize(
    ("error", "fields"),
    [
        (hs.SelectionError("m"), {"selector": None, "suggestions": ()}),
        (hs.SiteNotFoundError("m"), {"key": None, "candidates": ()}),
        (hs.CaptureError("m"), {"site": None}),
        (hs.DataError("m"), {"rows": None}),
    ],
)
def test_old_call_sites_still_work(error: Exception, fields: dict[str, Any]) -> None:
    assert error.args[0] == "m"
    assert str(error) == f"m (docs: {docs_link(type(error))})"
    assert {name: getattr(error, name) for name in fields} == fields


@pytest.mark.parametrize(
    "error",
    [
        hs.SelectionError("m", selector="fcc", suggestions=("fc",)),
        hs.SiteNotFoundError("m", key="fcc", candidates=("fc", "fc#0:output")),
        hs.CaptureError("m", site="fc#0:output"),
        hs.DataError("m", rows=range(8, 12)),
        hs.StoreReadError("m", array="h.0", chunk=3),  # raised in a DataLoader worker
    ],
)
def test_fields_survive_a_pickle(error: Exception) -> None:
    # DataLoader workers and torch.distributed ranks hand errors on pickled
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert vars(back) == vars(error)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (errors.SelectionError, LookupError),
        (errors.SiteNotFoundError, KeyError),
        (errors.SpecError, ValueError),
        (errors.FileFormatError, ValueError),
        (errors.DataError, ValueError),
        (errors.UnsupportedModelError, TypeError),
        (errors.MissingDependencyError, ImportError),
        (errors.CaptureError, RuntimeError),
        (errors.NonFiniteError, FloatingPointError),
        (errors.EditError, ValueError),
        (errors.StoreError, OSError),
    ],
)
def test_each_error_is_drawn_in_the_tree_with_its_builtin(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, errors.HookscopeError)
    assert issubclass(error, builtin)
    assert f"{error.__name__} ({builtin.__name__})" in (errors.__doc__ or "")


def test_no_error_carries_an_exit_code() -> None:
    classes = [getattr(errors, name) for name in errors.__all__]
    assert [cls.__name__ for cls in classes if hasattr(cls, "exit_code")] == []


# --- no builtin error for bad input ------------------------------------------------------------

BAD_INPUT: dict[str, Callable[[Path], object]] = {
    "a selector of the wrong type": lambda _: hs.select(SmallCNN(), 3),  # type: ignore[arg-type]
    "an unknown keep": lambda _: hs.capture(SmallCNN(), "fc", keep="bogus"),  # type: ignore[arg-type]
    "a cache key of the wrong type": lambda _: hs.run_with_capture(SmallCNN(), SmallCNN.example(), layers="fc")[1][
        3  # type: ignore[index]
    ],
    "a factor that is no number": lambda _: hs.edits.scale("half"),  # type: ignore[arg-type]
    "a std that is no number": lambda _: hs.edits.noise("wide"),  # type: ignore[arg-type]
    "an edit without ctx": lambda _: hs.edit(SmallCNN(), {"fc": lambda value: value}),  # type: ignore[dict-item]
    "b's inputs as a list": lambda _: hs.diff(
        SmallCNN(),
        SmallCNN(),
        SmallCNN.example(),
        inputs_b=[SmallCNN.example()],  # type: ignore[arg-type]
    ),
    "a tensor file of no format": lambda _: tensor_file_format("acts.csv"),
    "saving a number as a tensor": lambda path: save_tensors(path / "a.npz", {"x": 3}),  # type: ignore[dict-item]
    "loading a file of no format": lambda path: load_tensors(path / "a.h5"),
    "an integer dtype": lambda _: parse_dtype("int8"),
    "a model class, not a model": lambda _: hs.ensure_module(SmallCNN),
    "a report that is no HTML file": lambda path: hs.report(SmallCNN(), SmallCNN.example(), out=path / "r.txt"),
    "a store that is not there": lambda path: hs.open_store(path / "none.zarr"),
}


@pytest.mark.parametrize("call", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_raises_a_hookscope_error_that_is_also_a_builtin(
    call: Callable[[Path], object], tmp_path: Path
) -> None:
    with pytest.raises(hs.HookscopeError) as info:
        call(tmp_path)
    assert isinstance(info.value, (LookupError, ValueError, TypeError, OSError))


# --- exit codes: one table in the CLI ----------------------------------------------------------


class _Narrower(hs.DataError):
    pass


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (hs.SpecError("x"), 2),
        (hs.SelectionError("x"), 2),
        (hs.SiteNotFoundError("x"), 2),
        (hs.StoreError("x"), 2),
        (hs.MissingDependencyError("x"), 2),
        (hs.StoreWriteError("x"), 1),
        (hs.StoreReadError("x"), 1),  # the network failed, not the command
        (hs.DataError("x"), 1),
        (_Narrower("x"), 1),  # a subclass takes its nearest listed class's code
        (RuntimeError("x"), 1),
        (OSError(28, "No space left on device"), 1),
        (KeyboardInterrupt(), 130),
    ],
)
def test_exit_code_table(error: BaseException, code: int) -> None:
    assert exit_code(error) == code


def test_every_hookscope_error_has_a_code_in_the_table() -> None:
    classes = [getattr(errors, name) for name in errors.__all__]
    exceptions = [cls for cls in classes if issubclass(cls, Exception) and not issubclass(cls, Warning)]
    assert {cls.__name__: exit_code(cls("x")) in (1, 2) for cls in exceptions} == dict.fromkeys(
        (cls.__name__ for cls in exceptions), True
    )
    assert set(EXIT_CODES.values()) == {1, 2, 130}


def _extract_argv(tmp_path: Path, source: str, factory: str, *options: str) -> tuple[list[str], Path]:
    """``hookscope extract demo:cnn`` over the data ``factory`` of ``source``, written to ``tmp_path/data.py``."""
    (tmp_path / "data.py").write_text(source)
    out = tmp_path / "f.zarr"
    data = f"{tmp_path / 'data.py'}:{factory}"
    return ["extract", "demo:cnn", "--data", data, "-o", str(out), "--no-progress", *options], out


CHANGING_BATCHES = (
    "import torch\n"
    "def batches():\n"
    "    g = torch.Generator().manual_seed(0)\n"
    "    return [torch.randn(4, 3, 32, 32, generator=g), torch.randn(4, 3, 40, 40, generator=g)]\n"
)


def test_cli_data_error_exits_1_and_keeps_the_chunks_before_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv, out = _extract_argv(tmp_path, CHANGING_BATCHES, "batches", "-l", "conv1", "--chunk-rows", "4")
    code, _, err = run_cli(capsys, *argv)
    assert code == 1  # the data broke its promise: no option fixes that
    assert err.strip().splitlines() == [
        "error: site 'conv1#0:output' gave (4, 16, 38, 38) float32 for rows 4..7; the store holds "
        "(4, 16, 30, 30) float32 per batch; reduce the varying dimension (e.g. reduce='mean:1' over tokens) "
        "or pad every batch to one length" + f" (docs: {docs_link(hs.DataError)})"
    ]
    torch.manual_seed(0)  # the command's --seed 0 builds the same weights
    conv1 = SmallCNN().eval().conv1
    first = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert np.allclose(hs.open_store(out, partial=True)["conv1"][:4], conv1(first).numpy(), atol=1e-6)


def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "extract", "demo:cnn", "--data", "random:8", "-l", "fcc", "-o", str(tmp_path / "f"))
    assert code == 2
    assert (
        err.strip()
        == f"error: selector 'fcc' matched 0 of 5 modules; did you mean 'fc'? (docs: {docs_link(hs.SelectionError)})"
    )


INTERRUPTED_ROWS = (
    "from pathlib import Path\n"
    "import torch\n"
    "class Rows(torch.utils.data.Dataset):\n"
    "    def __len__(self):\n"
    "        return 64\n"
    "    def __getitem__(self, index):\n"
    "        if index == 40 and (Path(__file__).parent / 'stop').exists():\n"
    "            raise KeyboardInterrupt\n"
    "        return torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(index))\n"
)


def test_cli_ctrl_c_in_extract_exits_130_says_what_is_kept_and_resumes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv, out = _extract_argv(tmp_path, INTERRUPTED_ROWS, "Rows", "-l", "fc", "-b", "8", "--chunk-rows", "16")
    (tmp_path / "stop").write_text("")
    code, _, err = run_cli(capsys, *argv)
    assert code == 130
    assert err.strip().splitlines()[-1] == (
        f"error: interrupted (Ctrl-C): 2 of 4 chunks (32 of 64 rows) are recorded in {out}; run the same command "
        f"again to resume after them: hookscope {shlex.join(argv)}"
    )
    assert hs.open_store(out, partial=True).done_chunks() == {0, 1}
    (tmp_path / "stop").unlink()
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "resumed after 2 chunks: 32 of 64 rows were recorded by an earlier run" in stdout
    torch.manual_seed(0)  # the command's --seed 0 builds the same weights
    rows = torch.stack([torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(64)])
    with torch.no_grad():
        assert np.allclose(hs.open_store(out)["fc"][:], SmallCNN().eval()(rows).numpy(), atol=1e-6)


def test_cli_ctrl_c_elsewhere_exits_130_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stops.py").write_text(
        "import torch\nclass Stops(torch.nn.Module):\n    def forward(self, x):\n        raise KeyboardInterrupt\n"
    )
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "trace", "stops.py:Stops", "-s", "1x4")
    assert code == 130
    assert err.strip().splitlines() == [
        "error: interrupted (Ctrl-C) before the command finished; run it again to do it all"
    ]


class TestForwardRaisesNote:
    """A forward that raises inside a feature gets a note naming the module it came out of."""

    @staticmethod
    def note_of(error: BaseException) -> str:
        return "\n".join(getattr(error, "__notes__", []))

    @pytest.mark.parametrize("feature", ["capture", "run_with_capture", "edit", "layers", "detect_nonfinite"])
    def test_each_feature_names_the_module(self, feature: str) -> None:
        from tests.models import RaisesMidForward

        model, x = RaisesMidForward(), torch.randn(2, 4)

        def run() -> None:
            if feature == "capture":
                with hs.capture(model, "first"):
                    model(x)
            elif feature == "run_with_capture":
                hs.run_with_capture(model, x, layers="first")
            elif feature == "edit":
                with hs.edit(model, {"first": hs.edits.scale(2.0)}):
                    model(x)
            elif feature == "layers":
                hs.layers(model, x)
            else:
                with hs.detect_nonfinite(model):
                    model(x)

        with pytest.raises(RuntimeError, match="boom") as raised:
            run()
        note = self.note_of(raised.value)
        assert "the error went through boom (Boom)" in note
        assert note.count("went through") == 1

    def test_extract_names_the_module(self, tmp_path: Path) -> None:
        from tests.models import RaisesMidForward

        with pytest.raises(RuntimeError, match="boom") as raised:
            hs.extract(RaisesMidForward(), torch.randn(4, 4), tmp_path / "s.zarr", layers="first", progress=False)
        assert "the error went through boom (Boom)" in self.note_of(raised.value)

    def test_a_gpt2_block_that_raises_is_named_with_its_dotted_name(self) -> None:
        from tests.models import gpt2_input, tiny_gpt2

        model = tiny_gpt2()

        def fail(_module: nn.Module, _args: object) -> None:
            raise ValueError("refused")

        handle = model.h[1].mlp.c_fc.register_forward_pre_hook(fail)
        try:
            with pytest.raises(ValueError, match="refused") as raised, hs.capture(model, "h.0"):
                model(gpt2_input())
        finally:
            handle.remove()
        assert "went through h.1.mlp.c_fc (Conv1D)" in self.note_of(raised.value)  # its pre-hook raised


# --- every message ends with its entry on the errors page ------------------------------------------

ERROR_TYPES = [value for value in vars(hs).values() if isinstance(value, type) and issubclass(value, hs.HookscopeError)]
ERRORS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "errors.md"


@pytest.mark.parametrize("error_type", ERROR_TYPES, ids=lambda error_type: error_type.__name__)
def test_a_message_ends_with_the_entry_of_its_error_on_the_errors_page(error_type: type[hs.HookscopeError]) -> None:
    error = error_type("something was wrong; expected this; do that")
    link = f"https://hookscope.readthedocs.io/en/latest/reference/errors.html#hookscope.{error_type.__name__}"
    assert str(error) == f"something was wrong; expected this; do that (docs: {link})"
    page = ERRORS_PAGE.read_text()
    assert f"## {error_type.__name__}\n" in page  # what it means, its causes, the fix
    assert f".. autoexception:: hookscope.{error_type.__name__}\n" in page  # the anchor the link names


def test_a_wrapped_message_ends_with_the_wrapping_errors_link_only() -> None:
    inner = hs.SelectionError("selector 'fcc' matched 0 of 5 modules")
    outer = hs.SpecError(f"layers=['fcc']: {inner}")
    assert str(outer) == f"layers=['fcc']: selector 'fcc' matched 0 of 5 modules (docs: {docs_link(hs.SpecError)})"


def test_a_message_made_of_several_arguments_keeps_them_all() -> None:
    assert str(hs.HookscopeError("a", 2)).startswith("('a', 2) (docs: ")
