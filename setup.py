"""Build hook for the optional C extension; everything else is in pyproject.toml.

``flowdecision._fastreq`` decodes the common decision request body and writes
its wire and canonical JSON in C (src/flowdecision/_fastreq.c). It is
optional: where no C compiler is at hand the package installs without it and
model.py does the same work in Python.

``FLOWDECISION_C_BUILD`` picks one of the checked builds ``make test`` makes
(tests/c_check.sh, into a temporary directory; an install never sets it):

* ``strict``: every warning of ``-Wall -Wextra`` is an error, and a failed
  build fails instead of installing without the extension;
* ``sanitize``: ``strict``, plus AddressSanitizer and UndefinedBehaviorSanitizer
  (the first error aborts) and CPython's header assertions (``-UNDEBUG``).
"""

import os

from setuptools import Extension, setup

STRICT = [
    "-Wall",
    "-Wextra",
    # CPython's conventions, not mistakes: METH_O/METH_VARARGS functions take a
    # module they do not use; PyModuleDef's trailing members are left to zero.
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
    "-Werror",
]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
BUILDS: dict[str, tuple[list[str], list[str]]] = {
    "": ([], []),
    "strict": (STRICT, []),
    "sanitize": (
        STRICT + SANITIZE + ["-fno-omit-frame-pointer", "-g", "-O1", "-UNDEBUG"],
        SANITIZE,
    ),
}

build = os.environ.get("FLOWDECISION_C_BUILD", "")
if build not in BUILDS:
    raise SystemExit(f"FLOWDECISION_C_BUILD `{build}` is not supported: use strict or sanitize")
compile_args, link_args = BUILDS[build]

setup(
    ext_modules=[
        Extension(
            f"flowdecision.{name}",
            [f"src/flowdecision/{name}.c"],
            optional=not build,
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
        for name in ("_fastreq",)
    ]
)
