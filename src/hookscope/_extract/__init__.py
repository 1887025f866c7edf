"""Extract: run a model over a whole data set and stream the features to a chunked zarr store.

``api`` holds ``extract()``, ``job`` its steps on one process, ``options`` its
``ExtractConfig``, ``data`` turns data sets, loaders and iterables into numbered batches,
``pipeline`` runs the captures and hands values on, ``writer`` fills chunks on a thread of its
own, ``resume`` and ``config`` say what a store was made with, ``inputs`` checks a resumed run's
data, ``ranks`` lets processes agree. The store itself, its format and its readers
(``open_store``), are ``hookscope._store``'s.
"""

from hookscope._extract.api import extract
from hookscope._extract.options import ExtractConfig

__all__ = ["ExtractConfig", "extract"]
