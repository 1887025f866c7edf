"""Extract: the features of a whole data set, streamed to a chunked zarr store, resumable, sharded.

``api`` holds ``extract()`` and its steps, ``options`` its ``ExtractConfig``, ``data`` turns
data sets, loaders and iterables into numbered batches, ``pipeline`` runs the captures and
hands values on, ``writer`` fills chunks on a thread of its own, ``layout`` and ``config``
describe a store, ``zarr_io`` makes it and keeps its manifest, ``ranks`` lets processes agree,
``store`` reads it back (``open_store``).
"""

from hookscope._extract.api import extract
from hookscope._extract.options import ExtractConfig

__all__ = ["ExtractConfig", "extract"]
