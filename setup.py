"""Build hook for the optional C extensions; everything else is in pyproject.toml.

* ``flowdecision._otlp`` encodes finished spans to OTLP protobuf in C for
  ``serve --otel`` (src/flowdecision/_otlp.c);
* ``flowdecision._fastreq`` decodes the common decision request body and writes
  its wire and canonical JSON in C (src/flowdecision/_fastreq.c).

Both are optional: where no C compiler is at hand the package installs without
them and tracer.py and model.py do the same work in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("flowdecision._otlp", ["src/flowdecision/_otlp.c"], optional=True),
        Extension("flowdecision._fastreq", ["src/flowdecision/_fastreq.c"], optional=True),
    ]
)
