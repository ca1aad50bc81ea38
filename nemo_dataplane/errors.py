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
``NonFiniteError``                     ``nemo_dataplane.errors``                   ``ArithmeticError``
=====================================  ==========================================  ===================
"""

from __future__ import annotations

__all__ = ["NemoDataplaneError", "NonFiniteError"]


class NemoDataplaneError(Exception):
    """Base of every error family of nemo-dataplane."""


class NonFiniteError(NemoDataplaneError, ArithmeticError):
    """A value a training step depends on is NaN or infinite (a reward, an advantage, a behaviour,
    proximal, reference or current log-prob, the gradient norm). Raised before any optimizer
    step of the step it fails; the message names the value, the group(s) and the prompt(s)."""
