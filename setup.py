"""Build hook for the one optional C extension; everything else is in pyproject.toml.

``flowdecision._otlp`` encodes finished spans to OTLP protobuf in C for
``serve --otel`` (src/flowdecision/_otlp.c). It is optional: where no C compiler
is at hand the package installs without it and tracer.py encodes in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("flowdecision._otlp", ["src/flowdecision/_otlp.c"], optional=True),
    ]
)
