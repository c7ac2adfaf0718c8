"""Builds the optional C extensions ``fastload._native`` (native/_native.c) and
``fastload._curl`` (native/_curl.c).

Everything else about the package lives in pyproject.toml. Both extensions are
``optional``: when they cannot be compiled (no C compiler, no Python headers), the
install still succeeds and fastload runs its pure-Python fallbacks
(fastload/cache/gather.py; aiohttp for every HTTP request, fastload/transport/curl.py).
``_native`` links nothing but libc and pthreads; LZ4 and xxh3 are resolved at
run time from the installed ``lz4`` and ``xxhash`` packages (see native/README.md).
"""

from setuptools import Extension, setup

CFLAGS = ["-O2", "-std=gnu11", "-fvisibility=hidden", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "fastload._native",
            sources=["native/_native.c"],
            depends=["native/lines.h"],
            extra_compile_args=CFLAGS,
            extra_link_args=["-pthread"],
            optional=True,
        ),
        # libcurl is opened at run time (dlopen), so neither its headers nor the library are
        # needed to build this; without it fastload's HTTP GETs stay on aiohttp (fastload/transport/curl.py).
        Extension(
            "fastload._curl",
            sources=["native/_curl.c"],
            depends=["native/lines.h"],
            extra_compile_args=CFLAGS,
            extra_link_args=["-pthread"],
            libraries=["dl"],
            optional=True,
        ),
    ],
)
