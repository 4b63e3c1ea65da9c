"""Adapters for the frameworks people train with.

- :mod:`trainguard.integrations.lightning`: ``TrainguardCallback`` for ``lightning.Trainer``
  (``pip install 'trainguard[lightning]'``).
- :mod:`trainguard.integrations.transformers`: ``TrainguardCallback`` for the Hugging Face
  ``Trainer`` (``pip install 'trainguard[transformers]'``).

Each callback drives the monitor and the recorder with the framework's own step
(``global_step``, also after resuming the framework's checkpoint), tells the monitor when the
gradients are complete, and writes each rank of a distributed run to ``logdir/rank-K``.
Importing this package imports no framework; each submodule imports its own.

:func:`watch_frameworks` is how ``trainguard run --monitor`` and ``trainguard monitor`` give an
unmodified script the same answers: when the monitor attaches to a model trained by one of these
frameworks, the matching callback joins the framework's trainer.
"""

from trainguard.integrations._auto import watch_frameworks

__all__ = ["watch_frameworks"]
