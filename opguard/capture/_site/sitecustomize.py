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


if os.environ.get("OPGUARD_CAPTURE", "").strip().lower() in ("1", "true", "yes", "on"):
    from opguard.capture.bootstrap import install_hook
    from opguard.errors import OpguardError

    try:
        install_hook()
    except OpguardError as err:
        # site.py would print a warning and run the program uncaptured: refuse instead
        sys.stderr.write(f"opguard capture: refusing to start (pid {os.getpid()}): {err}\n")
        raise SystemExit(err.exit_code) from None
_chain()
