"""``save_tensors`` / ``load_tensors`` / ``tensor_file_format``: bit-exact round trips,
metadata, atomic writes, files from other tools, refusals."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

import hookscope as hs
from hookscope._capture.files import SUPPORTED_SUFFIXES
from hookscope.errors import FileFormatError, SpecError
from hookscope.io import load_tensors, save_tensors, tensor_file_format

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.complex64,
    torch.complex128,
]
FLOAT_DTYPES = [dtype for dtype in DTYPES if dtype.is_floating_point or dtype.is_complex]
SHAPES = [(4, 5), (), (0, 3)]
SITE_KEYS = ["layer1.conv2#0:output", "h.0#1:output[0]", "enc#0:input['scale']", "b#0:grad_output", "ä#2:input"]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``shape`` whose bits are random (every NaN payload, subnormal and sign can occur)."""
    generator = torch.Generator().manual_seed(seed)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=generator).bool().reshape(shape)
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count * width,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor``: NaN-safe to compare with ``torch.equal``."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.device.type == "cpu"
    assert torch.equal(bits(actual), bits(expected))


def leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


class Exploit:
    """Pickles as a call to ``record_call``: loading it would run code."""

    calls: list[str] = []  # noqa: RUF012

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Exploit.calls.append, ("ran",))


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_round_trip_is_bit_exact(tmp_path: Path, suffix: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = random_tensor(dtype, shape)
    path = save_tensors(tmp_path / f"t{suffix}", {"x#0:output": tensor}, {})
    assert path == tmp_path / f"t{suffix}"
    loaded, meta = load_tensors(path)
    assert list(loaded) == ["x#0:output"]
    assert meta == {}
    assert_same_bits(loaded["x#0:output"], tensor)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_special_values_survive(tmp_path: Path, suffix: str, dtype: torch.dtype) -> None:
    values = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.5, -2.25, 1e-8, 3e38])
    tensor = values.to(dtype)
    loaded, _ = load_tensors(save_tensors(tmp_path / f"s{suffix}", {"v": tensor}, {}))
    assert_same_bits(loaded["v"], tensor)


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_many_dtypes_in_one_file_keep_order_and_meta(tmp_path: Path, suffix: str) -> None:
    tensors = {f"m#{i}:output[{dtype}]": random_tensor(dtype, (3,), seed=i) for i, dtype in enumerate(DTYPES)}
    tensors = dict(reversed(list(tensors.items())))  # not sorted, not insertion-by-dtype
    meta = {"model": "gpt2", "n": 3, "ratio": 0.25, "ok": True, "none": None, "nested": {"a": [1, "two", [3.5]]}}
    loaded, loaded_meta = load_tensors(save_tensors(tmp_path / f"m{suffix}", tensors, meta))
    assert list(loaded) == list(tensors)
    assert loaded_meta == meta
    for key, tensor in tensors.items():
        assert_same_bits(loaded[key], tensor)


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_site_keys_keep_their_order(tmp_path: Path, suffix: str) -> None:
    keys = [*reversed(SITE_KEYS), "z", "a", "m#0:output[1]['k'].x"]
    tensors = {key: torch.full((2,), float(i)) for i, key in enumerate(keys)}
    loaded, _ = load_tensors(save_tensors(tmp_path / f"k{suffix}", tensors, {}))
    assert list(loaded) == keys
    for key, tensor in tensors.items():
        assert torch.equal(loaded[key], tensor)


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_keys_that_clash_with_library_arguments(tmp_path: Path, suffix: str) -> None:
    keys = ["file", "allow_pickle", "arr_0", "metadata", "tensors", "hookscope", "x.npy", "", " "]
    tensors = {key: torch.full((1,), float(i)) for i, key in enumerate(keys)}
    loaded, _ = load_tensors(save_tensors(tmp_path / f"c{suffix}", tensors, {}))
    assert list(loaded) == keys
    assert all(torch.equal(loaded[key], tensor) for key, tensor in tensors.items())


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_meta_round_trips_with_unicode_and_numbers(tmp_path: Path, suffix: str) -> None:
    meta = {"text": "naïve ∑ 😀", "big": 2**62, "neg": -7, "float": 1 / 3, "list": [], "dict": {}, "tuple": (1, 2)}
    _, loaded = load_tensors(save_tensors(tmp_path / f"u{suffix}", {"x": torch.zeros(1)}, meta))
    assert loaded == {**meta, "tuple": [1, 2]}  # JSON has no tuples


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_uppercase_suffix_and_missing_parent_folders(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / "new" / "deeper" / f"A{suffix.upper()}"
    assert save_tensors(str(path), {"x": torch.ones(2)}, {"k": 1}) == path
    loaded, meta = load_tensors(str(path))
    assert torch.equal(loaded["x"], torch.ones(2))
    assert meta == {"k": 1}


# --- memory layout ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_tensors_sharing_storage_save_and_load_apart(tmp_path: Path, suffix: str) -> None:
    base = torch.arange(12, dtype=torch.float32)
    tensors = {"base": base, "same": base, "slice": base[2:5], "grid": base.view(3, 4), "empty1": base[:0]}
    tensors["empty2"] = torch.empty(0, 3)
    loaded, _ = load_tensors(save_tensors(tmp_path / f"shared{suffix}", tensors, {}))
    for key, tensor in tensors.items():
        assert_same_bits(loaded[key], tensor)
    loaded["base"].add_(100)
    assert torch.equal(loaded["same"], base)
    assert torch.equal(loaded["slice"], base[2:5])


@pytest.mark.parametrize("dtype", [torch.complex128, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_empty_tensor_with_zero_strides(tmp_path: Path, suffix: str, dtype: torch.dtype) -> None:
    empty = torch.empty(0, 3, dtype=dtype).as_strided((0, 3), (0, 0))
    loaded, _ = load_tensors(save_tensors(tmp_path / f"e{suffix}", {"e": empty}, {}))
    assert loaded["e"].shape == (0, 3)
    assert loaded["e"].dtype == dtype
    assert loaded["e"].view(torch.uint8).shape == (0, 3 * empty.element_size())


def test_pt_slice_of_big_tensor_saves_only_the_slice(tmp_path: Path) -> None:
    big = torch.zeros(1_000_000)
    path = save_tensors(tmp_path / "slice.pt", {"s": big[10:20]}, {})
    assert path.stat().st_size < 100_000


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_non_contiguous_and_special_tensors(tmp_path: Path, suffix: str) -> None:
    source = torch.randn(4, 6)
    complex_values = torch.randn(3, dtype=torch.complex64)
    tensors = {
        "transposed": source.t(),
        "strided": source[::2, 1::3],
        "expanded": torch.ones(1, 3).expand(4, 3),
        "bf16_transposed": source.to(torch.bfloat16).t(),
        "grad": torch.ones(2, requires_grad=True) * 2,
        "conj": complex_values.conj(),
        "neg": complex_values.conj().imag,
    }
    loaded, _ = load_tensors(save_tensors(tmp_path / f"nc{suffix}", tensors, {}))
    for key, tensor in tensors.items():
        expected = tensor.detach().resolve_conj().resolve_neg()
        assert_same_bits(loaded[key], expected)
        assert loaded[key].is_contiguous()
        assert not loaded[key].requires_grad


# --- atomic writes ---------------------------------------------------------------------------


BAD_SAVES: list[tuple[dict[Any, Any], dict[Any, Any], str]] = [
    ({"x": torch.ones(2)}, {"fn": object()}, "meta['fn']"),
    ({"x": torch.ones(2)}, {"cfg": {"layers": [1, {2: "x"}]}}, "meta['cfg']['layers'][1]"),
    ({"x": torch.ones(2)}, {"cfg": {"v": np.float32(1.0)}}, "meta['cfg']['v']"),
    ({"x": torch.ones(2), "y": np.ones(2)}, {}, "tensors['y']"),
    ({"x": torch.ones(2), "y": [1.0, 2.0]}, {}, "tensors['y']"),
    ({"x": torch.ones(2), "__hookscope__": torch.ones(1)}, {}, "'__hookscope__' is reserved"),
    ({"x": torch.ones(2), 3: torch.ones(1)}, {}, "tensor key 3"),
    ({"x": torch.empty(2, device="meta")}, {}, "tensors['x'] is a meta tensor"),
    ({"x": torch.ones(2).to_sparse()}, {}, "tensors['x'] is a torch.sparse_coo tensor"),
]


@pytest.mark.parametrize(("tensors", "meta", "named"), BAD_SAVES)
@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_failed_save_leaves_nothing_and_keeps_old_file(
    tmp_path: Path, suffix: str, tensors: dict[str, Any], meta: dict[str, Any], named: str
) -> None:
    fresh = tmp_path / f"fresh{suffix}"
    with pytest.raises(SpecError, match=re.escape(named)):
        save_tensors(fresh, tensors, meta)
    assert leftovers(tmp_path) == []

    existing = save_tensors(tmp_path / f"old{suffix}", {"old": torch.arange(5)}, {"v": 1})
    before = existing.read_bytes()
    with pytest.raises(SpecError):
        save_tensors(existing, tensors, meta)
    assert existing.read_bytes() == before
    assert leftovers(tmp_path) == [existing.name]


def test_cyclic_meta_is_refused(tmp_path: Path) -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(SpecError, match="contains itself"):
        save_tensors(tmp_path / "c.npz", {"x": torch.ones(1)}, {"loop": cycle})
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_overwrite_replaces_whole_file(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"o{suffix}"
    save_tensors(path, {"a": torch.ones(100), "b": torch.ones(3)}, {"v": 1})
    save_tensors(path, {"c": torch.zeros(2)}, {"v": 2})
    loaded, meta = load_tensors(path)
    assert list(loaded) == ["c"]
    assert meta == {"v": 2}
    assert leftovers(tmp_path) == [path.name]


# --- suffixes and dependencies ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["x.h5", "x.npy", "x", "x.safetensor", "x.pt.bak"])
def test_unknown_suffix_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(SpecError, match=r"\.safetensors, \.npz, \.pt.*e\.g\. 'activations\.safetensors'") as info:
        save_tensors(tmp_path / name, {"x": torch.ones(1)}, {})
    assert repr(Path(name).suffix or "(none)") in str(info.value)
    assert leftovers(tmp_path) == []
    with pytest.raises(SpecError, match="cannot read"):
        load_tensors(tmp_path / name)
    with pytest.raises(SpecError, match=re.escape(f"{str(tmp_path / name)!r}: suffix")):
        tensor_file_format(tmp_path / name)


@pytest.mark.parametrize(("name", "format_name"), [("a.safetensors", "safetensors"), ("b.NPZ", "npz"), ("c.pt", "pt")])
def test_the_format_a_name_picks_is_the_one_written(tmp_path: Path, name: str, format_name: str) -> None:
    assert tensor_file_format(name) == format_name
    path = save_tensors(tmp_path / name, {"x": torch.arange(4)})  # meta is optional
    members = zipfile.ZipFile(path).namelist() if zipfile.is_zipfile(path) else []
    written = {  # a zip of .npy members, torch's zip around a pickle, or safetensors' length + JSON header
        "npz": bool(members) and all(name.endswith(".npy") for name in members),
        "pt": any(name.endswith("data.pkl") for name in members),
        "safetensors": not members and path.read_bytes()[8:9] == b"{",
    }
    assert [name for name, found in written.items() if found] == [format_name]
    assert load_tensors(path)[1] == {}


def test_the_public_names_are_the_functions_cache_save_and_load_use(tmp_path: Path) -> None:
    cache = hs.Cache({hs.Site("fc", 0): torch.ones(2, dtype=torch.bfloat16)}, meta={"model": "mlp"})
    tensors, meta = load_tensors(cache.save(tmp_path / "c.npz"))
    assert list(tensors) == ["fc"]  # the short name; the full site is in the metadata
    assert tensors["fc"].dtype == torch.bfloat16
    assert meta == {"model": "mlp", "hookscope_sites": {"fc": "fc#0:output"}}
    assert hs.load(tmp_path / "c.npz").meta == {"model": "mlp"}
    save_tensors(tmp_path / "d.pt", {"fc#0:output": torch.zeros(3)}, {"model": "other"})
    assert hs.load(tmp_path / "d.pt").meta == {"model": "other"}


@pytest.mark.slow
def test_missing_safetensors_package_is_named(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["safetensors"] = None
        import torch
        from hookscope._capture.files import save_tensors
        from hookscope.errors import MissingDependencyError
        try:
            save_tensors(sys.argv[1], {"x": torch.ones(2)}, {})
        except MissingDependencyError as error:
            print(error.args[0])
        """
    )
    target = tmp_path / "out" / "x.safetensors"
    result = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == (
        "saving .safetensors files needs safetensors: pip install safetensors (or save to .npz or .pt)"
    )
    assert not target.exists()
    assert not target.parent.exists()


# --- files from elsewhere --------------------------------------------------------------------


def test_foreign_safetensors_loads_with_empty_meta(tmp_path: Path) -> None:
    path = tmp_path / "foreign.safetensors"
    tensors = {"w": random_tensor(torch.bfloat16, (2, 3)), "b": random_tensor(torch.float8_e4m3fn, (4,))}
    safetensors.torch.save_file(tensors, str(path), metadata={"author": "someone"})
    loaded, meta = load_tensors(path)
    assert meta == {}
    assert sorted(loaded) == ["b", "w"]
    for key, tensor in tensors.items():
        assert_same_bits(loaded[key], tensor)


def test_foreign_npz_loads_with_empty_meta(tmp_path: Path) -> None:
    path = tmp_path / "foreign.npz"
    big_endian = np.arange(4, dtype=">f4")
    np.savez(path, x=np.arange(6, dtype=np.int16).reshape(2, 3), y=big_endian, z=np.asfortranarray(np.eye(3)))
    loaded, meta = load_tensors(path)
    assert meta == {}
    assert list(loaded) == ["x", "y", "z"]
    assert torch.equal(loaded["x"], torch.arange(6, dtype=torch.int16).reshape(2, 3))
    assert torch.equal(loaded["y"], torch.arange(4, dtype=torch.float32))
    assert torch.equal(loaded["z"], torch.eye(3, dtype=torch.float64))


def test_foreign_pt_state_dict_loads_with_empty_meta(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    state = torch.nn.Linear(3, 2).state_dict()
    torch.save(state, path)
    loaded, meta = load_tensors(path)
    assert meta == {}
    assert list(loaded) == ["weight", "bias"]
    assert torch.equal(loaded["weight"], state["weight"])


def test_saved_files_are_readable_without_hookscope(tmp_path: Path) -> None:
    tensors = {"h.0#1:output[0]": random_tensor(torch.bfloat16, (2, 2)), "f": torch.arange(3.0)}
    npz = save_tensors(tmp_path / "a.npz", tensors, {"k": "v"})
    with np.load(npz, allow_pickle=False) as archive:
        assert archive["h.0#1:output[0]"].dtype == np.uint16  # bf16 bits, as documented
        assert np.array_equal(archive["f"], np.arange(3.0))
        stored = json.loads(str(archive["__hookscope__"]))
    assert stored["version"] == 1
    assert stored["meta"] == {"k": "v"}
    bf16_bits = bits(tensors["h.0#1:output[0]"]).numpy()
    checksum = hashlib.blake2b(bf16_bits, digest_size=16).hexdigest()
    assert stored["tensors"]["h.0#1:output[0]"] == {"dtype": "bfloat16", "shape": [2, 2], "blake2b": checksum}

    st = save_tensors(tmp_path / "a.safetensors", tensors, {"k": "v"})
    plain = safetensors.torch.load_file(str(st))
    assert_same_bits(plain["h.0#1:output[0]"], tensors["h.0#1:output[0]"])

    pt = save_tensors(tmp_path / "a.pt", tensors, {"k": "v"})
    raw = torch.load(pt, weights_only=True)
    assert set(raw) == {"tensors", "hookscope"}
    assert json.loads(raw["hookscope"])["meta"] == {"k": "v"}


# --- bad files -------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
@pytest.mark.parametrize("content", [b"", b"garbage" * 50, b"\x00" * 3], ids=["empty", "text", "zeros"])
def test_garbage_file_raises_file_format_error(tmp_path: Path, suffix: str, content: bytes) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_bytes(content)
    with pytest.raises(FileFormatError, match=suffix.lstrip(".")) as info:
        load_tensors(path)
    assert str(path) in str(info.value)
    assert info.value.__cause__ is not None or "damaged" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_truncated_file_raises_file_format_error(tmp_path: Path, suffix: str) -> None:
    path = save_tensors(tmp_path / f"cut{suffix}", {"x": torch.randn(1000)}, {"a": 1})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(FileFormatError, match=re.escape(str(path))):
        load_tensors(path)


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_missing_file_raises_file_not_found(tmp_path: Path, suffix: str) -> None:
    with pytest.raises(FileNotFoundError):
        load_tensors(tmp_path / f"absent{suffix}")


def test_pt_with_pickled_object_is_refused_without_running_it(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"x": torch.ones(1), "payload": Exploit()}, path)
    Exploit.calls.clear()
    with pytest.raises(FileFormatError, match="weights_only"):
        load_tensors(path)
    assert Exploit.calls == []


def test_pt_with_non_tensor_values_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    torch.save([torch.ones(1)], path)
    with pytest.raises(FileFormatError, match="holds a list"):
        load_tensors(path)


def test_npz_holding_a_single_npy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "single.npz"
    with path.open("wb") as handle:
        np.save(handle, np.arange(3))
    with pytest.raises(FileFormatError, match="holds one array"):
        load_tensors(path)


def test_npz_with_pickled_object_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "objects.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(FileFormatError, match="npz"):
        load_tensors(path)


def test_newer_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.safetensors"
    header = {"format": "hookscope.tensors", "version": 99, "tensors": {}, "meta": {}}
    safetensors.torch.save_file({"x": torch.ones(1)}, str(path), metadata={"hookscope": json.dumps(header)})
    with pytest.raises(FileFormatError, match=r"format version 99.*upgrade"):
        load_tensors(path)


def test_metadata_naming_a_missing_tensor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "edited.npz"
    save_tensors(path, {"x": torch.ones(1), "y": torch.ones(1)}, {})
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(tmp_path / "cut.npz", "w") as target:
        for info in source.infolist():
            if info.filename != "y.npy":
                target.writestr(info, source.read(info))
    with pytest.raises(FileFormatError, match="'y'"):
        load_tensors(tmp_path / "cut.npz")


@pytest.mark.parametrize("suffix", SUPPORTED_SUFFIXES)
def test_a_flipped_bit_in_a_tensor_is_named_on_load(tmp_path: Path, suffix: str) -> None:
    marker = torch.full((64,), 1.2345, dtype=torch.float32)
    path = hs.Cache({hs.Site("fc", 0): torch.zeros(3), hs.Site("head", 0): marker}).save(tmp_path / f"c{suffix}")
    data = bytearray(path.read_bytes())
    start = bytes(data).find(marker.numpy().tobytes())
    assert start >= 0, "the tensor's bytes are stored as they are"
    data[start + 100] ^= 0x01  # one bit of one element
    path.write_bytes(bytes(data))
    with pytest.raises(FileFormatError) as info:
        hs.load(path)
    assert str(path) in str(info.value)
    if suffix != ".npz":  # the zip's own CRC finds it first there, and names the member
        assert "'head'" in str(info.value)
        assert "checksum" in str(info.value)


def test_saved_names_are_short_where_they_say_one_site(tmp_path: Path) -> None:
    """numpy alone reads a saved .npz by module name; a module of several calls keeps full
    names; hs.load gives every site back exactly."""
    from tests.models import SharedTwice

    model = SharedTwice()
    x = torch.randn(2, 4)
    _, cache = hs.run_with_capture(model, x, layers=["shared", "head"])
    with torch.no_grad():
        first = model.shared(x)
    path = cache.save(tmp_path / "c.npz")
    with np.load(path, allow_pickle=False) as arrays:
        names = set(arrays.files) - {"__hookscope__"}
        assert names == set(cache.short_names().values())
        assert names == {"shared#0:output", "shared#1:output", "head"}  # two calls: full names
        np.testing.assert_array_equal(arrays["shared#0:output"], first.numpy())
    assert hs.load(path).sites() == cache.sites()
    single = hs.Cache({hs.Site("fc", 0): torch.arange(3.0)})
    with np.load(single.save(tmp_path / "one.npz"), allow_pickle=False) as arrays:
        np.testing.assert_array_equal(arrays["fc"], np.arange(3.0, dtype=np.float32))
    assert list(hs.load(tmp_path / "one.npz")) == ["fc#0:output"]
