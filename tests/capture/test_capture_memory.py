"""Captures and the C allocator: freed memory is kept for the next forward, once, on glibc only.

The allocator settings are process-wide and cannot be undone, so every test that lets a capture
apply them runs in a fresh Python process (``_run``), which prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import hookscope as hs
from hookscope._shared import malloc as allocator
from tests.models import track

ROOT = Path(__file__).resolve().parents[2]
GLIBC = allocator._mallopt() is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="the allocator settings exist on glibc only")
slow = pytest.mark.slow  # each starts a Python process of its own

# 16 Tanh layers on a 1024 x 4096 float32 input: 16 values of 16 MiB each, 256 MiB kept per pass
# (above allocator.MIN_BYTES; each value below glibc's 32 MiB mmap threshold).
BIG_MODEL = """
import gc, json, resource, sys
import torch
from torch import nn
import hookscope as hs
from hookscope._shared import malloc as allocator

torch.manual_seed(0)
model = nn.Sequential(*[nn.Tanh() for _ in range(16)])
x = torch.randn(1024, 4096)

def faults_of_pass():
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with hs.capture(model, nn.Tanh) as cap, torch.no_grad():
        model(x)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del cap
    return faults
"""


def _run(script: str, **env: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter (environment ``env`` added, allocator variables
    cleared); return the JSON object it printed last."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != allocator.ENV}
    clean.pop("GLIBC_TUNABLES", None)
    clean |= {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])} | env
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=clean,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@needs_glibc
@slow
def test_a_big_capture_sets_the_allocator_once_and_bounded() -> None:
    seen = _run(
        BIG_MODEL
        + """
states, changed = [], []
for _ in range(3):
    faults_of_pass()
    states.append(allocator.allocator_state())
changed.append(allocator.keep_freed_memory(256 << 20))   # what every pass asks: set already
changed.append(allocator.keep_freed_memory(1536 << 20))  # a bigger capture raises it, to the cap
changed.append(allocator.keep_freed_memory(512 << 20))   # and a smaller one never lowers it
print(json.dumps({"states": states, "changed": changed, "final": allocator.allocator_state()}))
"""
    )
    kept = 16 * (16 << 20)
    first = {"mmap_threshold": 32 << 20, "trim_threshold": 2 * kept, "skipped": None}
    assert seen["states"] == [first] * 3  # set by the first pass, unchanged by the next ones
    assert seen["changed"] == [False, True, False]
    assert seen["final"]["trim_threshold"] == (1 << 31) - 1  # at most 2 GiB: mallopt's largest finite value


@needs_glibc
@slow
def test_freed_pages_are_reused_instead_of_faulted_in_again() -> None:
    script = (
        BIG_MODEL
        + """
faults = [faults_of_pass() for _ in range(5)]
print(json.dumps({"faults": faults, "state": allocator.allocator_state()}))
"""
    )
    steady = _run(script)
    default = _run(script, HOOKSCOPE_MALLOC="default")
    assert steady["state"]["trim_threshold"] > 0
    assert default["state"] == {"mmap_threshold": 0, "trim_threshold": 0, "skipped": "HOOKSCOPE_MALLOC=default"}
    pages = 16 * (16 << 20) // 4096  # the kept values' pages: 65,536
    # Glibc's defaults hand the kept memory back after a capture and fault it in again (here, the
    # second pass; later ones only when nothing live happens to sit above the freed memory at the
    # heap's top, which varies from run to run). Kept resident, every warm pass reuses it (the
    # first pass ran before the setting, the second filled the heap).
    assert default["faults"][1] > pages // 2, default
    assert max(steady["faults"][2:]) < pages // 4, steady  # a block or two may still land on fresh pages


@needs_glibc
@slow
def test_the_users_own_malloc_settings_are_left_alone() -> None:
    script = BIG_MODEL + "faults_of_pass()\nprint(json.dumps(allocator.allocator_state()))\n"
    by_variable = _run(script, MALLOC_TRIM_THRESHOLD_="1048576")
    assert by_variable["trim_threshold"] == 0
    assert by_variable["skipped"] == "the process was started with its own malloc settings (MALLOC_TRIM_THRESHOLD_)"
    by_tunable = _run(script, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    assert by_tunable["skipped"].endswith("(glibc.malloc.mmap_threshold)")


@slow
def test_no_glibc_no_change() -> None:
    seen = _run(
        BIG_MODEL
        + """
allocator._mallopt = lambda: None  # as on musl or macOS: no glibc to ask
faults_of_pass()
print(json.dumps(allocator.allocator_state()))
"""
    )
    assert seen == {"mmap_threshold": 0, "trim_threshold": 0, "skipped": "the C library is not glibc"}


@slow
def test_a_small_capture_leaves_the_allocator_alone() -> None:
    seen = _run(
        """
import json, torch
from torch import nn
import hookscope as hs
from hookscope._shared import malloc as allocator
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
for _ in range(3):
    _, cache = hs.run_with_capture(model, torch.randn(256, 64), layers=["0", "1"])
print(json.dumps(allocator.allocator_state()))
"""
    )
    assert seen == {"mmap_threshold": 0, "trim_threshold": 0, "skipped": None}


def test_a_mistyped_opt_out_is_refused_when_the_capture_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    model = track(nn.Sequential(nn.Linear(4, 4)))
    monkeypatch.setenv(allocator.ENV, "off")
    with pytest.raises(hs.SpecError, match=r"HOOKSCOPE_MALLOC='off' is not a choice: use HOOKSCOPE_MALLOC=default"):
        hs.capture(model, "0")
    monkeypatch.setenv(allocator.ENV, " Default ")
    hs.capture(model, "0").remove()  # spelled loosely, still the opt-out


# -- values stay each pass's own, with freed memory reused ------------------------------------------

VALUES = """
import json
import torch
from torch import nn
from transformers import GPT2Config, GPT2Model, ResNetConfig, ResNetModel
import hookscope as hs
from hookscope._shared import malloc as allocator

torch.manual_seed(0)
leaf = lambda name, module: next(module.children(), None) is None

def raw_hooks(model, x):
    # What every leaf returned, cloned at once (later in-place ops cannot touch the clone).
    seen, handles = {}, []
    for name, module in model.named_modules():
        if leaf(name, module):
            def keep(module, args, output, name=name):
                if isinstance(output, torch.Tensor):
                    seen.setdefault(name, output.detach().clone())
            handles.append(module.register_forward_hook(keep))
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen

def captured(model, x):
    with hs.capture(model, leaf, calls="first") as cap:
        model(x)
    return cap

def same(cap, reference):
    names = {site.module: cap[site] for site in cap.sites() if site.path == ""}
    return sorted(reference) == sorted(names) and all(torch.equal(names[n], reference[n]) for n in reference)

report = {}
models = {
    "gpt2": (GPT2Model(GPT2Config(n_layer=2)).eval(), lambda b, s: torch.randint(0, 50257, (b, s))),
    "resnet": (ResNetModel(ResNetConfig(depths=[1, 1, 1, 1])).eval(), lambda b, s: torch.randn(b, 3, s, s)),
}
sizes = {"gpt2": [(8, 256), (8, 256), (4, 200)], "resnet": [(4, 224), (4, 224), (2, 160)]}
with torch.no_grad():
    for key, (model, make) in models.items():
        inputs = [make(*size) for size in sizes[key]]
        first = captured(model, inputs[0])          # the user keeps pass 1's capture...
        held = {site: first[site].clone() for site in first.sites()}
        shapes = {}
        results = []
        for x in inputs[1:]:                        # ...while later passes reuse freed memory
            cap = captured(model, x)
            results.append(same(cap, raw_hooks(model, x)))
            shapes = {str(site): list(cap[site].shape) for site in cap.sites()}
            del cap
        report[key] = {
            "passes_match_raw_hooks": results,
            "first_unchanged": all(torch.equal(first[site], held[site]) for site in first.sites()),
            "first_differs_from_second": not same(first, raw_hooks(model, inputs[1])),
            "last_shapes": shapes,
        }
report["state"] = allocator.allocator_state()
print(json.dumps(report))
"""


@needs_glibc
@slow
@pytest.mark.transformers
def test_values_are_each_passs_own_on_real_models_with_freed_memory_reused() -> None:
    seen = _run(VALUES)
    assert seen["state"]["trim_threshold"] > 0  # the captures were big enough to keep memory
    for key in ("gpt2", "resnet"):
        assert seen[key]["passes_match_raw_hooks"] == [True, True], key  # pass 2's values are pass 2's, and pass 3's
        assert seen[key]["first_unchanged"], key  # a capture the user still holds is never written over
        assert seen[key]["first_differs_from_second"], key
    assert seen["gpt2"]["last_shapes"]["wte#0:output"] == [4, 200, 768]  # the shape changed with the input
    assert seen["resnet"]["last_shapes"]["embedder.embedder.convolution#0:output"] == [2, 64, 80, 80]


def test_keep_freed_memory_ignores_what_is_below_the_minimum() -> None:
    before = allocator.allocator_state()
    assert not allocator.keep_freed_memory(allocator.MIN_BYTES - 1)
    assert allocator.allocator_state() == before
