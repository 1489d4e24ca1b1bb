"""Build of the optional native parts of capture: the host kernel (``opguard.capture._hostkernel``,
docs/capture.md §5.2) and the function mode's common call (``opguard.capture._fastcall``, §3.11).

Everything else is declared in pyproject.toml. Both extensions are optional: without a C compiler the
install still succeeds, and capture summarises CPU tensors with PyTorch ops instead (it says so on
stderr at start; ``OPGUARD_CAPTURE_HOST_KERNEL=native`` makes its absence an error).
"""

import sys

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add, so every instruction-set clone of the kernel gives the
# same bits (the statistics' sums of squares would otherwise differ between x86-64-v3 and default).
flags = [] if sys.platform == "win32" else [
    "-O3", "-std=gnu11", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-psabi"]

setup(
    ext_modules=[
        Extension(
            "opguard.capture._hostkernel",
            ["opguard/capture/_hostkernel.c"],
            extra_compile_args=flags,
            py_limited_api=True,
            optional=True,
        ),
        Extension(
            "opguard.capture._fastcall",
            ["opguard/capture/_fastcall.c"],
            extra_compile_args=flags,
            py_limited_api=True,
            optional=True,
        ),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
