"""The library's one base error.

Every error family the library raises derives from :class:`NemoDataplaneError` (as well as from
the built-in type its callers already catch), so ``except NemoDataplaneError`` catches anything
this library raised on purpose and nothing else:

=====================================  ==========================================  ===================
family                                 where                                       also a
=====================================  ==========================================  ===================
``ConfigError``                        ``nemo_dataplane.config``                   ``ValueError``
``DataPlaneError`` (store failures)    ``nemo_dataplane.client``                   ``RuntimeError``
``ClaimsNotSupported``                 ``nemo_dataplane.client``                   ``NotImplementedError``
``MissingKeysError``                   ``nemo_dataplane.meta``                     ``KeyError``
``StatelessGroupError``                ``nemo_dataplane.distributed.work``         ``RuntimeError``
``StoreAuthError``                     ``nemo_dataplane.distributed.auth``         ``RuntimeError``
``RefitError``                         ``nemo_dataplane.refit.protocol``           ``RuntimeError``
``LayoutError``                        ``nemo_dataplane.refit.reshard.layout``     ``ValueError``
=====================================  ==========================================  ===================
"""

from __future__ import annotations

__all__ = ["NemoDataplaneError"]


class NemoDataplaneError(Exception):
    """Base of every error family of nemo-dataplane."""
