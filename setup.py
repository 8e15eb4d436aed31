"""Build steps that pyproject.toml cannot express declaratively.

* ``ext/_topo.pyx`` is compiled into ``agent._topo`` (Cython, translated when ``build_ext``
  runs, so an sdist carries the ``.pyx`` and never a generated ``.c``).
* Every ``proto/*.proto`` is compiled into the package ``agent._proto`` by the ``build_proto``
  command (grpcio-tools, pinned in pyproject's [build-system]). ``build_py`` runs it: into
  the build directory for a wheel, into the source tree for an editable install;
  ``build_ext --inplace`` runs it into the source tree too.

Nothing is generated when this file is merely imported (``python -m build --sdist``, metadata
queries): only the build commands produce code.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from setuptools import Command, Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "proto"
# The package the stubs belong to, as a path: protoc derives the generated modules' names
# and their imports of each other from the .proto files' paths under the include root.
PROTO_PACKAGE = Path("agent", "_proto")
CYTHON_DIRECTIVES = {"language_level": "3", "boundscheck": False, "wraparound": False}


def generate_proto_stubs(out_root: Path) -> list[Path]:
    """Compile every ``proto/*.proto`` into ``out_root/agent/_proto/``.

    The .proto files are copied into a temporary ``agent/_proto/`` tree that is protoc's
    include root, so protoc itself names the modules ``agent._proto.<name>_pb2`` and writes
    ``from agent._proto import <name>_pb2`` in the gRPC modules (no rewriting afterwards).
    One proto importing another writes ``import "agent/_proto/<name>.proto";``.
    """
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise SystemExit(f"build_proto: no .proto files in {PROTO_DIR}")
    out_dir = out_root / PROTO_PACKAGE
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(prefix="build_proto-") as tmp:
        staged = Path(tmp) / PROTO_PACKAGE
        staged.mkdir(parents=True)
        for proto in protos:
            shutil.copyfile(proto, staged / proto.name)
        args = [
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"--pyi_out={out_root}",  # type stubs, so mypy knows the message classes
            *[(PROTO_PACKAGE / proto.name).as_posix() for proto in protos],
        ]
        rc = protoc.main(args)
    if rc != 0:
        names = ", ".join(p.name for p in protos)
        raise SystemExit(f"build_proto: protoc failed (exit {rc}) on {names} in {PROTO_DIR}")
    return sorted(out_dir.glob("*_pb2*.py*"))


class BuildProto(Command):
    description = "generate agent/_proto/*_pb2*.py(i) from proto/*.proto with grpcio-tools"
    user_options = [
        ("build-lib=", "d", "directory the package is built in"),
        ("inplace", "i", "write the modules into the source tree (editable installs)"),
    ]
    boolean_options = ["inplace"]

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.inplace = False

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        out_root = ROOT if self.inplace else Path(str(self.build_lib))
        for path in generate_proto_stubs(out_root):
            self.announce(f"generated {path}", level=2)


class BuildPy(build_py):
    def run(self) -> None:
        # Package modules first, stubs after: a stale stub left in the source tree by an
        # earlier editable install never overwrites the freshly generated one.
        super().run()
        proto = self.distribution.get_command_obj("build_proto")
        proto.inplace = bool(getattr(self, "editable_mode", False))
        self.run_command("build_proto")


class BuildExt(build_ext):
    def run(self) -> None:
        from Cython.Build import cythonize

        # Translate .pyx to .c now (not when setup.py is imported); keep setuptools' own
        # Extension objects, which its finalize_options prepared, and only swap their sources.
        translated = cythonize(self.extensions, compiler_directives=CYTHON_DIRECTIVES)
        for ext, c_ext in zip(self.extensions, translated, strict=True):
            assert ext.name == c_ext.name, (ext.name, c_ext.name)
            ext.sources = c_ext.sources
        if self.inplace:  # `setup.py build_ext --inplace` refreshes the stubs too
            proto = self.distribution.get_command_obj("build_proto")
            proto.inplace = True
            self.run_command("build_proto")
        super().run()


setup(
    cmdclass={"build_proto": BuildProto, "build_py": BuildPy, "build_ext": BuildExt},
    ext_modules=[Extension("agent._topo", [os.path.join("ext", "_topo.pyx")])],
)
