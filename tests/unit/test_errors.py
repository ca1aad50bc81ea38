"""Every error class the library defines (warnings aside) derives from the one base error."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import nemo_dataplane
from nemo_dataplane.errors import NemoDataplaneError


def _library_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(nemo_dataplane.__path__, "nemo_dataplane.")]


def test_every_exception_class_of_the_library_derives_from_the_base_error() -> None:
    offenders, seen = [], []
    for name in _library_modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == name
                and not issubclass(obj, Warning)
            ):
                seen.append(f"{name}.{attr}")
                if not issubclass(obj, NemoDataplaneError):
                    offenders.append(f"{name}.{attr}")
    assert "nemo_dataplane.client.DataPlaneError" in seen and "nemo_dataplane.refit.protocol.RefitError" in seen
    assert offenders == []


def test_the_base_error_is_public_and_families_keep_their_builtin_types() -> None:
    from nemo_dataplane.config import ConfigError
    from nemo_dataplane.meta import MissingKeysError

    assert nemo_dataplane.NemoDataplaneError is NemoDataplaneError
    assert issubclass(ConfigError, ValueError) and issubclass(MissingKeysError, KeyError)
