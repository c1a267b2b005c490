"""usaf: sparse native fine-tuning of Mixture-of-Experts language models.

Importing the package is cheap on purpose (no torch, no transformers): the CLI's ``--help`` and
``--version`` must be instant, so heavy modules are imported by the stages that need them.
"""

from usaf._version import __version__

__all__ = ["__version__"]
