"""What every rank runs for tests/extract/test_distributed.py (module-level: a spawned process imports them).

Each check returns plain values; the test asserts on them in the parent, where failures print.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookscope as hs
from hookscope.tensors import tensor_stats


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
        nn.Linear(8, 3),
    )


def _batch(rank: int, rows: int = 5, width: int = 4) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(100 + rank))


def ddp_names_and_captures(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = _blocks()
    ddp = DistributedDataParallel(model)
    x = _batch(rank)
    with hs.capture(ddp, ["1.0", "module.3"]) as cap:
        out = ddp(x)
    trace = hs.trace(ddp, x)
    return {
        "layers": [row.name for row in hs.layers(ddp).rows],
        "sites": sorted(cap),
        "short_equal": bool(torch.equal(cap["1.0"], model[1][0](model[0](x)))),
        "long_spelling_reads": bool(torch.equal(cap["module.3"], out)),
        "trace_names": [row.name for row in trace.rows],
    }


def ddp_gradients_are_the_averaged_ones(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = _blocks()
    ddp = DistributedDataParallel(model)
    x = _batch(rank)
    local: dict[str, torch.Tensor] = {}
    handle = model[3].weight.register_hook(lambda grad: local.setdefault("grad", grad.clone()))
    with hs.watch_grads(ddp) as monitor:
        ddp(x).square().sum().backward()
        step = monitor.step()
    handle.remove()
    averaged = local["grad"].clone()
    dist.all_reduce(averaged)
    averaged /= world
    record = next(r for r in step.records if r.what == "param" and r.path == "3.weight")
    return {"norm": record.norm, "averaged": float(averaged.norm()), "local": float(local["grad"].norm())}


def ddp_gpt2(rank: int, world: int) -> dict[str, Any]:
    import transformers
    from torch.nn.parallel import DistributedDataParallel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    ddp = DistributedDataParallel(model)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(rank))
    with hs.capture(model, "transformer.h.1") as expected:
        model(ids)
    with hs.capture(ddp, ["transformer.h.1", "module.lm_head"]) as cap:
        logits = ddp(ids).logits
    return {
        "sites": sorted(cap),
        "block_equal": bool(torch.equal(cap["transformer.h.1"], expected["transformer.h.1"])),
        "logits_equal": bool(torch.equal(cap["lm_head"], logits)),
    }


def fsdp2(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference = _blocks()
    model = _blocks()
    mesh = init_device_mesh("cpu", (world,))
    for block in (model[1], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = _batch(rank)
    with hs.capture(model, ["1", "2.0", "3"]) as cap:
        out = model(x)
    with hs.watch_grads(model) as monitor:
        model(x).square().sum().backward()
        step = monitor.step()
    weight = model[1][0].weight
    grad = weight.grad
    assert grad is not None
    full_grad, full_weight = grad.full_tensor(), weight.detach().full_tensor()
    record = next(r for r in step.records if r.what == "param" and r.path == "1.0.weight")
    stats = tensor_stats(weight)  # a DTensor: its whole value, gathered
    return {
        "classes": sorted({type(m).__name__ for m in model.modules()}),
        "sharded": type(weight).__name__,
        "local_rows": weight.to_local().shape[0],
        "sites": sorted(cap),
        "block_equal": bool(torch.allclose(cap["1"], reference[1](reference[0](x)))),
        "out_equal": bool(torch.equal(cap["3"], out)),
        "params_counted": hs.layers(model).total_params,
        "params_plain": sum(p.numel() for p in reference.parameters()),
        "grad_norm": (record.norm, float(full_grad.norm())),
        "ratio": (record.ratio, float(full_grad.norm() / full_weight.norm())),
        "stats_mean": (stats.mean, float(full_weight.mean())),
        "stats_count": (stats.count, full_weight.numel()),
    }


def ddp_monitor(rank: int, world: int) -> dict[str, Any]:
    """hs.monitor on a DDP model: names without DDP's ``module.``, norms of the averaged gradients."""
    from torch.nn.parallel import DistributedDataParallel

    model = _blocks()
    ddp = DistributedDataParallel(model)
    x = _batch(rank)
    local: dict[str, torch.Tensor] = {}
    handle = model[3].weight.register_hook(lambda grad: local.setdefault("grad", grad.clone()))
    with hs.monitor(ddp, layers=["1", "2"], names="modules") as mon:
        ddp(x).square().sum().backward()
        logged = mon.step()
    handle.remove()
    averaged = local["grad"].clone()
    dist.all_reduce(averaged)
    averaged /= world
    assert logged is not None
    return {
        "norm": logged.scalars["param_grad/norm/3.weight"],
        "averaged": float(averaged.norm()),
        "names": sorted(name for name in logged.scalars if name.startswith("grad/norm/")),
    }


def extract_stats(rank: int, world: int, out: str) -> dict[str, Any]:
    """A store written by 2 ranks: its merged statistics (every chunk's part, merged in chunk order)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5))
    rows = torch.randn(70, 6, generator=torch.Generator().manual_seed(5))
    store = hs.extract(model, rows, out, layers="0", batch_size=5, chunk_rows=10, progress=False)
    return {"stats": store.meta["stats"], "row_index": store.row_index[:].tolist()}


def every_check(rank: int, world: int, folder: str | None = None) -> dict[str, Any]:
    """Every check in one pair of processes: spawning (imports, ~5 s on 2 cores) is paid once."""
    warnings.simplefilter("error")  # the parent's filterwarnings do not reach a spawned process
    warnings.filterwarnings("ignore", "Full backward hook is firing when gradients are computed", UserWarning)
    checks = [ddp_names_and_captures, ddp_gradients_are_the_averaged_ones, ddp_monitor, ddp_gpt2, fsdp2]
    found = {check.__name__: check(rank, world) for check in checks}
    if folder is not None:
        found["extract_stats"] = extract_stats(rank, world, f"{folder}/stats.zarr")
    return found


def close(pair: tuple[float, float], rel: float = 1e-5) -> bool:
    return math.isclose(pair[0], pair[1], rel_tol=rel, abs_tol=1e-7)
