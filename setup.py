"""Build steps that pyproject.toml cannot express declaratively.

* ``ext/_topo.pyx`` is compiled into ``agent._topo`` (Cython).
* ``proto/**/*.proto`` are compiled into ``agent/_proto/`` with grpcio-tools before the
  Python files are collected, so both regular and editable installs ship the stubs.
"""

from __future__ import annotations

import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_proto_stubs() -> None:
    import grpc_tools
    from grpc_tools import protoc

    out = ROOT / "agent" / "_proto"
    out.mkdir(exist_ok=True)
    (out / "__init__.py").touch()
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    for proto in sorted((ROOT / "proto").glob("*.proto")):
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT / 'proto'}",
                f"-I{include}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                f"--pyi_out={out}",  # type stubs, so mypy knows the message classes
                str(proto),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto} (exit {rc})")
    # protoc writes absolute imports ("import api_pb2"); make them package-relative.
    for stub in out.glob("*_pb2*.py"):
        text = stub.read_text()
        for proto in (ROOT / "proto").glob("*.proto"):
            mod = proto.stem + "_pb2"
            text = text.replace(f"\nimport {mod} as ", f"\nfrom . import {mod} as ")
        stub.write_text(text)


class BuildPyWithProto(build_py):
    def run(self) -> None:
        generate_proto_stubs()
        super().run()


generate_proto_stubs()

setup(
    cmdclass={"build_py": BuildPyWithProto},
    ext_modules=cythonize(
        [Extension("agent._topo", [os.path.join("ext", "_topo.pyx")])],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    ),
)
