"""Builds the one native piece, tierkv/_native/pmem_copy.c (the pmem tier's copy-and-hash paths).

It is loaded with ctypes, not imported, so it uses no Python API. The build is optional: without
a C compiler or xxhash.h (Debian: gcc, libxxhash-dev; scripts/setup installs both) the package
still installs and the pmem tier uses its Python copy path, saying so in `tierkv info`.
It is compiled for the machine that builds it (-march=native: xxh3 picks its widest vector unit
at compile time), which is where scripts/setup and `pip install` run it.
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
        )
    ]
)
