"""opguard: debugging evidence for large distributed training jobs.

Importing this package is cheap: it never imports torch or mpi4py.
"""

__version__ = "0.2.0.dev0"
