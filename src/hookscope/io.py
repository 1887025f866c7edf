"""Files of tensors: save and load a name → tensor mapping, check an output path first.

The formats a capture saves (:meth:`hookscope.Cache.save`), for any mapping of tensors:
``.safetensors`` (default), ``.npz`` and ``.pt`` (read with ``weights_only=True`` only), each
written atomically, so a failed write leaves no partial file.

>>> import tempfile, torch
>>> from pathlib import Path
>>> from hookscope import io
>>> path = io.save_tensors(Path(tempfile.mkdtemp()) / "acts.safetensors", {"h.0": torch.ones(2)})
>>> tensors, meta = io.load_tensors(path)
>>> tensors["h.0"], meta
(tensor([1., 1.]), {})
>>> io.tensor_file_format("acts.npz")
'npz'
"""

from __future__ import annotations

from hookscope._capture.files import load_tensors, save_tensors, tensor_file_format
from hookscope._shared.files import check_output_path
from hookscope._shared.names import own_exports, public_dir

__all__ = ["check_output_path", "load_tensors", "save_tensors", "tensor_file_format"]

own_exports(__name__)


def __dir__() -> list[str]:
    """``__all__``, the dunders and public submodules, not the imports: what tab completion offers."""
    return public_dir(__name__)
