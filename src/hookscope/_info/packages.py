"""The optional packages hookscope uses, and which of them this environment has, found without importing them.

Importing every optional package to see whether it is there would take seconds (lightning,
mlflow and wandb each pull in a large tree) and could change the process (a logging setup, a
warning filter). So a package counts as present when Python can find its module
(``importlib.util.find_spec``); its version is the one its installed metadata gives, or the
``__version__`` of the module where it was imported already.

>>> found = [package for package in OPTIONAL if package.found() is not None]
>>> all(package.module for package in found)
True
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass

__all__ = ["INTEGRATIONS", "OPTIONAL", "Package"]


@dataclass(frozen=True)
class Package:
    """One optional package: its module, the distributions that install it, what uses it, and the fix."""

    module: str
    purpose: str
    install: str
    distributions: tuple[str, ...] = ()

    def found(self) -> str | None:
        """Its version where it is installed (``"installed"`` where no version can be read), else None."""
        loaded = sys.modules.get(self.module)
        if loaded is not None:
            version = getattr(loaded, "__version__", None)
            if isinstance(version, str):
                return version
        elif importlib.util.find_spec(self.module) is None:
            return None
        for distribution in self.distributions or (self.module,):
            try:
                return importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "installed"


def _extra(name: str) -> str:
    return f"pip install 'hookscope[{name}]'"


#: Libraries hookscope works with as integrations: their models, callbacks and offloading.
INTEGRATIONS = (
    Package("transformers", "hookscope.integrations.hf, canonical names of its models", "pip install transformers"),
    Package("accelerate", "models offloaded with accelerate's hooks", "pip install accelerate"),
    Package("lightning", "hookscope.integrations.lightning", _extra("lightning")),
)

#: Packages single features need, imported on first use (``hookscope._shared.optional.require``).
OPTIONAL = (
    Package("pandas", "to_pandas(), history()", _extra("pandas")),
    Package("matplotlib", "hs.plots, .plot(), hs.report", _extra("plots")),
    Package("jinja2", "hs.report", _extra("report")),
    Package("safetensors", ".safetensors files", _extra("safetensors")),
    Package("zarr", "feature stores (hs.extract)", "pip install 'zarr>=3.1'"),
    Package("fsspec", "stores at URLs", "pip install fsspec"),
    Package("s3fs", "stores at s3:// URLs", _extra("s3")),
    Package("google_crc32c", "a feature store's checksums", "pip install google-crc32c", ("google-crc32c",)),
    Package("xarray", "Effects.to_xarray()", "pip install xarray"),
    Package("datasets", "Store.to_hf_dataset()", _extra("datasets")),
    Package("tensorboard", "TensorBoardSink", _extra("tensorboard")),
    Package("wandb", "WandbSink", _extra("wandb")),
    Package("mlflow", "MLflowSink", _extra("mlflow"), ("mlflow-skinny", "mlflow")),
)
