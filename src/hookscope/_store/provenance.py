"""The names of a store's provenance arrays: what each row is.

Beside the sites' arrays, in the group ``_rows``, a store keeps per row its index in the data
(``_rows/index``), and for token models the token ids (``_rows/tokens``) and the padding mask
(``_rows/attention_mask``). How they are read off the batches is the extraction's
(``hookscope._extract.provenance``); this module names them for writers and readers alike.
"""

from __future__ import annotations

from hookscope._store.layout import SiteLayout

__all__ = ["INDEX", "MASK", "ROWS_GROUP", "TOKENS", "provenance_array"]

ROWS_GROUP = "_rows"  # the rows' provenance arrays
INDEX = f"{ROWS_GROUP}/index"
TOKENS = f"{ROWS_GROUP}/tokens"
MASK = f"{ROWS_GROUP}/attention_mask"


def provenance_array(name: str, dtype: str, shape: tuple[int, ...]) -> SiteLayout:
    """The layout of provenance array ``name``: rows of ``shape`` in ``dtype``, filled by no module.

    >>> provenance_array(INDEX, "int64", ()).site
    '_rows/index'
    """
    return SiteLayout(name=name, site=name, layer="", shape=shape, dtype=dtype, reduce=None)
