"""Build the optional C frame writer (headgate.log._frame_writer); metadata is in pyproject.toml.

The extension is optional: if it cannot be built (no compiler, no zlib
headers), the install still succeeds and headgate.log writes frames in pure
Python (see LOG.md, "The C frame writer").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "headgate.log._frame_writer",
            sources=["src/headgate/log/_frame_writer.c"],
            libraries=["z"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
            optional=True,
        )
    ]
)
