"""``hs.extract``: the features of a whole data set, streamed to a zarr store, resumable, sharded.

The steps, on every process (one, or each rank of a ``torch.distributed`` job):

1. read what ``out`` holds already and decide: a new store, a resumed one, or a refusal;
2. run the first batch (the probe) to learn the sites and the shape of a row: the layout;
3. compare the configuration with the stored one (every difference named) and meet the other
   ranks; rank 0 makes the store; meet again;
4. read the manifest and share the chunks still to do between the ranks, round robin;
5. run the batches of this rank's chunks, the writer thread storing each chunk as it fills;
6. meet; rank 0 checks that every chunk is done and marks the store complete; meet.

A failure at any step is shared at the next meeting, so no rank waits for one that gave up.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from hookscope._arch.std import expand_std
from hookscope._core.attach import HookGroup
from hookscope._core.compat.offload import ensure_loaded
from hookscope._core.params import model_device
from hookscope._core.select import Selector, describe_selector, ensure_module, given_selectors
from hookscope._extract.config import model_identity
from hookscope._extract.data import IndexedSource, make_source
from hookscope._extract.job import _Job
from hookscope._extract.options import ExtractConfig
from hookscope._extract.pipeline import SiteCaptures
from hookscope._extract.ranks import resolve_ranks
from hookscope._shared.options import with_options
from hookscope._store import Store, target_of, zarr_module
from hookscope.errors import SpecError

__all__ = ["extract"]


def _layers_and_out(where: tuple[Any, ...], layers: Any, out: Any) -> tuple[Any, Any]:
    """``(layers, out)`` of :func:`extract`: ``out`` positionally or as ``out=``, ``layers=`` by keyword;
    the older ``extract(model, data, layers, out)`` with a ``FutureWarning``."""
    if len(where) > 2:
        raise SpecError(
            f"hs.extract takes model, data and out positionally, and layers=...; got {2 + len(where)} positional "
            "arguments"
        )
    if len(where) == 2 or (len(where) == 1 and layers is None and out is not None):
        old_layers, old_out = where if len(where) == 2 else (where[0], out)
        if len(where) == 2 and out is not None:
            raise SpecError("hs.extract got out twice, positionally and as out=; give it once")
        return given_selectors((old_layers,), layers, feature="hs.extract", old_form=True)[0], old_out
    if where:
        if out is not None:
            raise SpecError("hs.extract got out twice, positionally and as out=; give it once")
        out = where[0]
    if layers is None or out is None:
        missing = " and ".join(name for name, value in (("layers=", layers), ("out", out)) if value is None)
        raise SpecError(f"hs.extract needs {missing}: hs.extract(model, data, 'feats.zarr', layers=['h.5'])")
    return layers, out


@with_options(ExtractConfig)
def extract(
    model: nn.Module,
    data: Any,
    *where: Any,
    layers: Selector | Sequence[Selector] | None = None,
    out: str | Path | Any = None,
    options: ExtractConfig | None = None,
    **opts: Any,
) -> Store:
    """Run ``model`` over ``data`` and store the values of ``layers`` for every row in a zarr store.

    One array per site (a module's output; every call of a reused module; every tensor of a
    tuple or ``ModelOutput``; an op site such as ``"h.3:op[add#0]"`` or an attention sub-site
    such as ``"h.*.attn:attn.pattern"``, kept as :func:`hookscope.capture` keeps them), shaped
    ``(N, ...)`` and chunked along the rows. Returns the complete :class:`Store`.

    ``data``: a ``DataLoader`` (not shuffling), a map-style ``Dataset`` (batched by
    ``batch_size``, default 32, with ``num_workers``; ``indices`` picks rows), a tensor or array
    of rows or a dict of them (keyword inputs), or any iterable of batches. A batch is a
    tensor, a dict of keyword inputs, or a tuple whose first element is the input (labels
    after it are ignored); ``inputs=lambda batch: (args, kwargs)`` says otherwise.

    The options are :class:`ExtractConfig`'s, as keywords or ``options=``: among them
    ``reduce`` per layer before storing (``"mean:1"``, ``"cls"``, ``"last"``, a function, or a
    dict ``{selector: reduction}``, first match wins (an op site takes the key written as its
    selector is in ``layers``); ``"mean:1"``, ``"last"`` and the others
    over dim 1 use only real tokens when the batch has an ``attention_mask``, see ``mask``),
    ``dtype`` to store floats in (``torch.float16``, ``"bfloat16"``), ``device`` to put the
    inputs on (default: the model's), ``keep`` and ``calls`` as in :func:`hookscope.capture`,
    ``chunk_rows``, ``compression_level``, ``progress``. The model runs under
    ``torch.no_grad()``, in eval mode unless ``eval_mode=False``; its mode is restored after.
    Only this thread's forwards are stored: another thread calling the model meanwhile (a
    serving thread) passes through, though it sees the eval mode, which is the model's.

    Resuming: a store left by a run that stopped is continued by the same call (``resume=True``,
    the default): done chunks are skipped and the result is bit-identical to an uninterrupted
    run. A store made with another configuration (model, layers, reductions, dtype, rows, ...)
    is refused with every difference named, unless ``overwrite=True`` replaces it. Data that
    changes its story part-way (fewer rows than its ``len()``, a batch that reaches other sites or
    gives other shapes than the first) raises :class:`~hookscope.errors.DataError` naming the
    rows (``.rows``); the chunks recorded before it stay valid.

    Many processes: call it on every rank of a ``torch.distributed`` job (torchrun,
    accelerate); each rank writes whole chunks of its own and rank 0 marks the store complete.

    ``out`` may be an fsspec URL (``"s3://bucket/feats.zarr"``, ``"gs://..."``) with
    ``storage_options`` for its file system; everything above works there too. Beside the
    values the store keeps each row's data index, token ids and padding mask (``tokens=``) and
    each site's running statistics (``store.row_index``, ``store.tokens``, ``store.stats``).

    Example::

        store = hs.extract(model, loader, "feats.zarr", layers=["h.5", "ln_f"], reduce="mean:1")
        store["h.5"][:10]                       # numpy rows 0..9
    """
    layers, out = _layers_and_out(where, layers, out)
    ensure_loaded(model)  # a meta model: one line, not torch's error
    ensure_module(model)
    config = ExtractConfig.build(options, opts)
    given: list[Selector] = list(layers) if isinstance(layers, (list, tuple)) else [layers]  # type: ignore[list-item]
    expanded, std_names = expand_std(model, layers, "read")  # "std:blocks.*.resid_post" -> site selectors
    zarr_module()
    target = target_of(out, config.storage_options)
    ranks = resolve_ranks(config.rank, config.world_size)
    source = make_source(
        data,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        indices=config.indices,
        inputs=config.inputs,
    )
    if not isinstance(source, IndexedSource) and ranks.world_size > 1:
        raise SpecError(
            f"{ranks.world_size} processes need data they can index by row (a map-style Dataset, a DataLoader over "
            "one, or tensors); this data is a stream that only one process can read in order"
        )
    run_on = config.torch_device or model_device(model)
    selectors: list[Selector] = expanded
    captures = SiteCaptures(model, selectors, reduce=config.reduce, options=config.capture)
    job = _Job(
        model=model,
        source=source,
        target=target,
        ranks=ranks,
        captures=captures,
        device=run_on,
        mask_key=config.mask_key,
        mask_required=config.mask_required,
        progress=config.progress,
        compression_level=config.compression_level,
        tokens=config.tokens,
    )
    recorded = {
        "model": model_identity(model, config.model_spec),
        "layers": [_layer_text(s) for s in given],
        **({"std": dict(std_names)} if std_names else {}),
        **config.recorded(),
        "reduce": captures.reductions,
        "rows": source.rows,
        "device": run_on.type,  # CPU and GPU kernels round differently: rows of one would not match the other's
    }
    with HookGroup(model, [], owner="extract"), captures:  # the group restores every module's train/eval mode
        if config.eval_mode:
            model.eval()
        return job.run(
            recorded, config.chunk_rows, resume=config.resume, overwrite=config.overwrite, command=config.command
        )


def _layer_text(selector: object) -> str:
    """A selector as the store records it: names, globs and regexes as written, others described."""
    return selector if isinstance(selector, str) else describe_selector(selector)
