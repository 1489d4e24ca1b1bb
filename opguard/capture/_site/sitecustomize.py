"""opguard capture bootstrap (put first on PYTHONPATH by ``opguard-run --capture``).

Enables capture in this Python process when OPGUARD_CAPTURE=1, then runs the next
``sitecustomize`` on ``sys.path`` (if any) so an existing site customisation keeps working.
"""

import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_opguard_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


def _import_opguard() -> None:
    """Import the opguard package this file belongs to (the wrapper's, whatever this interpreter
    has installed), leaving ``sys.path`` as the program would have it: the directory holding the
    package is on the path only while the package itself is imported (its submodules are found
    through the package's own ``__path__`` after that)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if any(os.path.abspath(p or os.curdir) == root for p in sys.path):
        import opguard
        return
    sys.path.insert(0, root)
    try:
        import opguard  # noqa: F401
    finally:
        try:
            sys.path.remove(root)
        except ValueError:
            pass


if os.environ.get("OPGUARD_CAPTURE", "").strip().lower() in ("1", "true", "yes", "on"):
    _import_opguard()
    from opguard.capture.bootstrap import install_hook
    from opguard.errors import OpguardError

    try:
        install_hook()
    except OpguardError as err:
        # site.py would print a warning and run the program uncaptured: refuse instead
        sys.stderr.write(f"opguard capture: refusing to start (pid {os.getpid()}): {err}\n")
        raise SystemExit(err.exit_code) from None
_chain()
