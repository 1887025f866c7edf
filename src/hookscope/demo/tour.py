"""The guided tour behind ``hookscope demo``: the classic hook scenarios on a small CNN.

Each step is what people hand-write with ``register_forward_hook`` today, done with hookscope:
print shapes, extract features to numpy and save them, print value ranges, show that every hook
is gone afterwards -- also after a forward that raised -- then capture in one line, and show a
value that a hand-written hook gets wrong because an in-place op rewrites it later; finally
trace every call with its statistics, find the layer that makes the first NaN, and watch the
gradients of a deep sigmoid MLP vanish with a poor initialisation and flow with a good one;
and edit what a layer returns: ablate a channel, patch activations from one run into another;
and stream the features of a whole data set to a zarr store, resuming after a run that failed;
and last, on a small CNN trained on generated shapes, ablate the channels most active on circles
(and see that they answer to squares too) and
write a self-contained HTML report of it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hookscope import edits
from hookscope._capture import load, run_with_capture
from hookscope._core.live_hooks import attached
from hookscope._core.names import module_label
from hookscope._edit import run_with_edits
from hookscope._hooks import hooks
from hookscope._layers import layers
from hookscope._monitor.grads import watch_grads
from hookscope._shared.files import atomic_path
from hookscope._trace import trace
from hookscope._trace.nonfinite import detect_nonfinite
from hookscope.demo.models import SmallCNN, load_shapes_cnn
from hookscope.demo.shapes import CLASSES, make_shapes
from hookscope.errors import MissingDependencyError, NonFiniteError

__all__ = ["run_tour"]

Write = Callable[[str], None]


def run_tour(out_dir: Path, write: Write = print) -> Path:
    """Run every step on ``SmallCNN`` with a fixed seed; return the saved features file.

    >>> import tempfile
    >>> path = run_tour(Path(tempfile.mkdtemp()), write=lambda line: None)
    >>> np.load(path).shape
    (1, 16, 30, 30)
    """
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 32, 32)
    write("hookscope demo: SmallCNN (conv1 = Conv2d(3, 16, 3) -> ReLU -> pool -> fc) on randn(1, 3, 32, 32)")

    _step(write, 1, "what can be hooked", "hs.layers(model, x)")
    for line in str(layers(model, x)).splitlines():
        write("   " + line)

    _step(write, 2, "a forward hook that prints shapes", 'hs.hooks(model, {"*": print_shapes})')
    with hooks(model, {"*": _shape_printer(model, write)}), torch.no_grad():
        model(x)

    _step(write, 3, "extract conv1's features to numpy and save them", 'hs.hooks(model, {"conv1": keep})')
    saved = _extract_conv1(model, x, out_dir / "conv1_features.npy", write)

    _step(write, 4, "shapes and value ranges", 'hs.hooks(model, {("conv1", "relu", "fc"): print_ranges})')
    with hooks(model, {("conv1", "relu", "fc"): _range_printer(model, write)}) as group, torch.no_grad():
        model(x)
        live = attached(model)
        write(f"   while attached: {group!r}, on {', '.join(f'{h.module} ({h.kind})' for h in live)}")

    _step(write, 5, "clean-up, also when the forward raises", "with hs.hooks(...): ...")
    write(f"   after the with-block: {len(attached(model))} hookscope hooks attached")
    try:
        with hooks(model, {"relu": _raise_in_hook}), torch.no_grad():
            model(x)
    except RuntimeError as exc:
        write(f"   a hook raised {type(exc).__name__}({exc}); the error propagated unchanged")
    write(f"   after the failed forward: {len(attached(model))} hookscope hooks attached")

    _step(write, 6, "capture in one line, save, load back", 'hs.run_with_capture(model, x, layers=["conv1", "fc"])')
    _capture_and_save(model, x, out_dir / "features.npz", write)

    _step(write, 7, "a value an in-place op overwrites later", "Linear -> ReLU(inplace=True)")
    _inplace_safety(write)

    _step(write, 8, "every call, its shapes and value ranges", "print(hs.trace(model, x))")
    for line in str(trace(model, x)).splitlines():
        write("   " + line)

    _step(write, 9, "which layer makes the first NaN", "with hs.detect_nonfinite(model): model(x)")
    _nan_origin(model, x, write)

    _step(write, 10, "gradients through 20 sigmoid layers", "with hs.watch_grads(mlp, nn.Linear): ...")
    for label, std in (("weights N(0, 0.1^2)", 0.1), ("weights N(0, (8/sqrt(16))^2)", 2.0)):
        _gradient_flow(label, std, write)

    _step(
        write,
        11,
        "zero the channels most active on circles",
        'hs.run_with_edits(shapes, x, edits={"conv3": zero(...)})',
    )
    _ablate_circle_channels(write)

    _step(write, 12, "activation patching on GPT-2", "edits={blocks: hs.edits.patch(clean_cache)}")
    _patch_gpt2(write)

    _step(
        write, 13, "a data set's features to a zarr store, resumed", 'hs.extract(model, data, layers, "features.zarr")'
    )
    _extract_data_set(model, out_dir / "features.zarr", write)

    _step(write, 14, "a self-contained HTML report", 'hs.report(shapes, images, out="report.html", loss_fn=...)')
    _write_report(out_dir / "report.html", write)
    return saved


def _step(write: Write, number: int, title: str, code: str) -> None:
    write("")
    write(f"{number}. {title}  [{code}]")


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    if isinstance(value, (tuple, list)):
        return ", ".join(_shape(item) for item in value)
    return type(value).__name__


def _label(model_names: dict[nn.Module, str], module: nn.Module) -> str:
    return f"{module_label(model_names.get(module, '?'))} ({type(module).__name__})"


def _shape_printer(model: nn.Module, write: Write) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    names = {module: name for name, module in model.named_modules()}  # worked out once, not per call

    def print_shapes(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        write(f"   {_label(names, module):<26} input {_shape(args):<16} -> output {_shape(output)}")

    return print_shapes


def _extract_conv1(model: nn.Module, x: torch.Tensor, path: Path, write: Write) -> Path:
    kept: list[torch.Tensor] = []

    def keep(_module: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> None:
        kept.append(output.detach().clone())

    with hooks(model, {"conv1": keep}), torch.no_grad():
        model(x)
    features = kept[0].numpy()
    with atomic_path(path) as tmp, tmp.open("wb") as stream:
        np.save(stream, features)
    reloaded = np.load(path)
    write(f"   conv1 output -> numpy {features.dtype} {features.shape} -> {path} ({path.stat().st_size:,} bytes)")
    write(f"   reloaded from disk: {'identical' if np.array_equal(reloaded, features) else 'DIFFERENT'}")
    return path


def _range_printer(model: nn.Module, write: Write) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    names = {module: name for name, module in model.named_modules()}

    def print_ranges(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        inp = args[0]
        zeros = (output == 0).float().mean().item()
        write(
            f"   {names[module]:<6} input {tuple(inp.shape)} in [{inp.min().item():.3f}, {inp.max().item():.3f}]"
            f" -> output {tuple(output.shape)} in [{output.min().item():.3f}, {output.max().item():.3f}],"
            f" mean {output.mean().item():.3f}, {zeros:.0%} zeros"
        )

    return print_ranges


def _capture_and_save(model: nn.Module, x: torch.Tensor, path: Path, write: Write) -> None:
    _, cache = run_with_capture(model, x, layers=["conv1", "fc"])
    for line in repr(cache).splitlines():
        write("   " + line)
    saved = cache.save(path)
    loaded = load(saved)
    same = all(torch.equal(loaded[key], cache[key]) for key in cache)
    write(f"   saved to {saved} ({saved.stat().st_size:,} bytes); loaded back: {'identical' if same else 'DIFFERENT'}")


def _inplace_safety(write: Write) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(8, 4)
    with torch.no_grad():
        truth = model[0](x)
    kept: list[torch.Tensor] = []
    with hooks(model, {"0": lambda _m, _a, output: kept.append(output.detach())}):  # the usual hand-written hook
        model(x)
    _, cache = run_with_capture(model, x, layers="0")
    write(f"   Linear output, computed by hand:        {int((truth < 0).sum())} negative values")
    write(
        f"   kept by a hook storing output.detach(): {int((kept[0] < 0).sum())} negative values (the ReLU rewrote it)"
    )
    write(
        f"   kept by hs.capture:                     {int((cache['0'] < 0).sum())} negative values"
        f" ({'equal' if torch.equal(cache['0'], truth) else 'DIFFERENT'} to the truth)"
    )


def _nan_origin(model: nn.Module, x: torch.Tensor, write: Write) -> None:
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.get_parameter("fc.weight")[0, 0] = math.nan
    write("   a copy of the model with one NaN weight in fc:")
    try:
        with detect_nonfinite(broken), torch.no_grad():
            broken(x)
    except NonFiniteError as error:
        write(f"   NonFiniteError: {str(error).split(': its inputs')[0]}")
    culprit = trace(broken, x).first_nonfinite()
    if culprit is not None and culprit.stats is not None:
        inputs = "finite" if all(info.finite for info in culprit.inputs) else "not finite"
        write(f"   hs.trace(...).first_nonfinite(): {culprit.site}, inputs {inputs}, {culprit.stats.nan} NaN out")


def _sigmoid_mlp(std: float, depth: int = 20, width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        linear = nn.Linear(width, width)
        nn.init.normal_(linear.weight, std=std)
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.Sigmoid()]
    return nn.Sequential(*layers)


def _gradient_flow(label: str, std: float, write: Write) -> None:
    """Three SGD steps of a 20-layer sigmoid MLP; how much gradient reaches the first layer."""
    model = _sigmoid_mlp(std)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    with watch_grads(model, layers=nn.Linear, params=False) as monitor:
        for _ in range(3):
            model(torch.randn(8, 16, generator=generator)).pow(2).mean().backward()
            monitor.step()
            optimizer.step()
            optimizer.zero_grad()
    norms = [record.norm for record in monitor.records[-1].of("grad_output")]
    vanishing = monitor.summary().layers("vanishing")
    write(
        f"   {label:<30} first/last layer gradient norm {norms[0] / norms[-1]:.1e}: "
        + (f"{len(vanishing)} of {len(norms)} layers flagged vanishing" if vanishing else "no layer flagged")
    )


def _ablate_circle_channels(write: Write) -> None:
    """The trained shapes classifier: zero the conv3 channels most selective for circles."""
    model = load_shapes_cnn()
    images, labels = make_shapes(400, seed=7)
    with torch.no_grad():
        plain, cache = run_with_capture(model, images, layers="conv3")
        activity = cache["conv3"].clamp(min=0).mean((2, 3))  # (images, channels)
        circle = CLASSES.index("circle")
        selectivity = activity[labels == circle].mean(0) - activity[labels != circle].mean(0)
        channels = selectivity.argsort(descending=True)[:3].tolist()
        ablated, _ = run_with_edits(model, images, edits={"conv3": edits.zero(channels=channels)})
        per_class = [activity[labels == k][:, channels].mean().item() for k in range(len(CLASSES))]
    write(f"   ShapesCNN, trained ({sum(p.numel() for p in model.parameters()):,} parameters), on 400 new images")
    write(f"   conv3 channels most active on circles, more than on other shapes: {channels}")
    levels = "  ".join(f"{name} {level:.1f}" for name, level in zip(CLASSES, per_class, strict=True))
    write(f"   their mean activity per class: {levels}")
    write("   so they answer to filled, compact shapes (circles most, squares next), not to circles alone:")
    for label, logits in (("accuracy per class", plain), ("with those zeroed", ablated)):
        right = logits.argmax(1) == labels
        rates = "  ".join(f"{name} {right[labels == k].float().mean().item():4.0%}" for k, name in enumerate(CLASSES))
        write(f"   {label:<19} {rates}")


def _write_report(out: Path, write: Write) -> None:
    from hookscope._report import report

    model = load_shapes_cnn()
    images, labels = make_shapes(8, seed=3)
    try:
        path = report(
            model,
            images,
            out=out,
            loss_fn=lambda logits: torch.nn.functional.cross_entropy(logits, labels),
            title="hookscope demo: ShapesCNN on 8 generated shapes",
        )
    except MissingDependencyError as error:
        write(f"   (skipped: {error})")
        return
    write(f"   model, trace table, histograms, feature maps and gradients in one file: {path.stat().st_size >> 10} KiB")
    write(f"   open it in a browser: {path.resolve()}")


def _patch_gpt2(write: Write) -> None:
    try:
        from transformers import GPT2Config, GPT2Model
    except ImportError:
        write("   (needs transformers: pip install transformers; a 2-layer GPT-2 is built from a config)")
        return
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2Model(config).eval()  # type: ignore[no-untyped-call]
    clean = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    corrupted = clean.clone()
    corrupted[0, 2] = (corrupted[0, 2] + 1) % 64  # one token changed
    blocks = r"re:h\.\d+"

    def gap(output: Any) -> float:
        return float((output.last_hidden_state[0, -1] - target).abs().max())

    with torch.no_grad():
        reference, cache = run_with_capture(model, input_ids=clean, layers=blocks)
        target = reference.last_hidden_state[0, -1]
        broken = gap(model(input_ids=corrupted))
        write(f"   token 2 corrupted: the last position's output moves by {broken:.3f}")
        for name, positions in (("h.0", [2]), ("h.1", [2]), ("h.1", None)):
            patched, _ = run_with_edits(
                model, input_ids=corrupted, edits={name: edits.patch(cache, positions=positions)}
            )
            where = "at position 2" if positions else "at every position"
            write(f"   clean {name} output patched in {where:<18} restores {1 - gap(patched) / broken:6.1%} of it")


class _FailsOnce(torch.utils.data.Dataset[torch.Tensor]):
    """Generated images; fetching row ``fail_at`` raises the first time, as a crash would stop a run."""

    def __init__(self, rows: int, fail_at: int) -> None:
        self.images = torch.randn(rows, 3, 32, 32, generator=torch.Generator().manual_seed(2))
        self.fail_at = fail_at

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.fail_at:
            self.fail_at = -1
            raise RuntimeError(f"reading row {index} failed")
        return self.images[index]


def _extract_data_set(model: nn.Module, out: Path, write: Write) -> None:
    try:
        from hookscope._extract import extract
        from hookscope._store import open_store

        data = _FailsOnce(512, fail_at=300)
        options: dict[str, Any] = {"reduce": {"conv1": "mean:2,3"}, "batch_size": 64, "chunk_rows": 128}
        try:
            extract(model, data, out, layers=["conv1", "fc"], overwrite=True, progress=False, **options)
        except RuntimeError as error:
            done = len(open_store(out, partial=True).done_chunks())
            write(f"   the first run stopped: {error}; {done} of 4 chunks had landed")
        store = extract(model, data, out, layers=["conv1", "fc"], progress=False, **options)
    except ImportError as error:  # zarr 3 needs Python 3.11
        write(f"   (skipped: {error})")
        return
    write("   the same call again resumed after them:")
    for line in repr(store).splitlines():
        write("   " + line)
    write(f"   hs.open_store({out.name!r})['fc'][:2].shape == {open_store(out)['fc'][:2].shape}")


def _raise_in_hook(_module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
    raise RuntimeError("something went wrong inside the forward")
