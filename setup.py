"""Builds the native pieces: tierkv/_native/pmem_copy.c (the pmem tier's copy-and-hash paths)
and tierkv/_native/untrack.c (`tierkv._untracked`'s call into the garbage collector).

The copy library is loaded with ctypes, not imported, so it uses no Python API; the other is a
small extension module (ctypes does the same call, slower, where it is not built). Both builds
are optional: without a C compiler or xxhash.h (Debian: gcc, libxxhash-dev; scripts/setup
installs both) the package still installs and the pmem tier uses its Python copy path, saying
so in `tierkv info`. The copy library is compiled for the machine that builds it
(-march=native: xxh3 picks its widest vector unit at compile time), which is where
scripts/setup and `pip install` run it.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierkv._native.pmem_copy",
            sources=["tierkv/_native/pmem_copy.c", "tierkv/_native/copy_queue.c"],
            depends=["tierkv/_native/copy_queue.h"],
            extra_compile_args=["-O3", "-march=native", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "tierkv._native._untrack",
            sources=["tierkv/_native/untrack.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            optional=True,
        ),
    ]
)
