"""A stand-in for the Dockerfile's base image, ``python:3.11-slim``, built on this machine.

No image registry is reachable here, so the image tier (tests/test_image.py) builds the base
the Dockerfile names from what the machine has, and tags it with that name; the project's
Dockerfile is then built unchanged on top of it. What each part follows of the official
image (docker-library/python, ``3.11/slim-bookworm/Dockerfile``):

- **Debian bookworm, minimal**: the official slim image is ``debian:bookworm-slim`` plus the
  run-time libraries CPython links (found there by ``ldd`` over the built modules, kept by
  ``apt-mark manual``); here ``debootstrap --variant=minbase`` of bookworm from the mirror
  the host's apt uses, with the packages of the libraries this CPython's modules and
  ``libpython`` link (``ldd`` + ``dpkg -S`` on the host; Tk left out, as slim has no tkinter
  built), ``ca-certificates``, ``netbase`` and ``tzdata``.
- **CPython 3.11 in /usr/local, built from source, shared**: ``/usr/local/bin/python3.11``
  with ``python3`` and ``python`` links, ``/usr/local/lib/libpython3.11.so.1.0`` (found
  through ``ldconfig``), the standard library in ``/usr/local/lib/python3.11`` with pip and
  setuptools in its ``site-packages`` (no test suite, no idlelib/tkinter/turtledemo),
  headers in ``/usr/local/include/python3.11``, ``pip``/``pip3``/``pip3.11`` scripts. Here
  it is the host's own source-built CPython 3.11 (pyenv's) copied into that layout; the
  patch release may differ from the official tag's.
- **Environment**: ``PATH`` with ``/usr/local/bin`` first, ``LANG=C.UTF-8``,
  ``PYTHON_VERSION``, ``CMD ["python3"]``.
- **This machine's reach** (not in the official image): the host's CA bundle and pip
  settings (``/etc/pip.conf``), and the host's apt sources, so that ``pip`` and ``apt-get``
  in the build reach the same package index and mirror the host does.

    python tests/image_standin.py [--tag python:3.11-slim]   # build and tag it
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TAG = "python:3.11-slim"
LABEL = "org.gpu-topology-agent.stand-in"
SUITE = "bookworm"
_SKIP_STDLIB = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "__pycache__"}
_KEEP_SITE = ("pip", "setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence.pth")


class StandInError(RuntimeError):
    """The stand-in cannot be built here (the message says why)."""


def host_python() -> Path:
    """The prefix of a source-built, shared CPython 3.11 on this machine."""
    candidates = [Path(sys.base_prefix)]
    candidates += [Path(p) for p in sorted(glob.glob("/root/.pyenv/versions/3.11*"))]
    for prefix in candidates:
        if (prefix / "bin" / "python3.11").exists() and (prefix / "lib" / "libpython3.11.so.1.0").exists():
            return prefix
    raise StandInError("no shared CPython 3.11 build (bin/python3.11 + lib/libpython3.11.so.1.0) here")


def debian_mirror() -> str:
    """The Debian mirror the host's apt uses."""
    for path in ["/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"]:
        if os.path.exists(path):
            text = Path(path).read_text()
            match = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) or re.search(
                r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)\s", text, re.M)
            if match:
                return match.group(1)
    return "http://deb.debian.org/debian"


def library_packages(prefix: Path) -> list[str]:
    """Debian packages of the shared libraries libpython and the stdlib modules link."""
    objects = [prefix / "lib" / "libpython3.11.so.1.0"] + [
        Path(p) for p in glob.glob(str(prefix / "lib" / "python3.11" / "lib-dynload" / "*.so"))
        if "_tkinter" not in p
    ]
    libraries: set[str] = set()
    for obj in objects:
        out = subprocess.run(["ldd", str(obj)], capture_output=True, text=True, check=True).stdout
        for match in re.finditer(r"=>\s+(/\S+)", out):
            if not match.group(1).startswith(str(prefix)):
                libraries.add(os.path.realpath(match.group(1)))
    packages: set[str] = set()
    for library in sorted(libraries):
        # merged /usr: dpkg knows a library under the path its package ships it at
        other = library[4:] if library.startswith("/usr/lib/") else "/usr" + library
        for path in (library, other):
            done = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, check=False)
            if done.returncode == 0:
                packages.add(done.stdout.split(":", 1)[0])
                break
        else:
            raise StandInError(f"no Debian package owns {library} (linked by CPython)")
    return sorted(packages)


def _copy_python(prefix: Path, root: Path) -> None:
    local = root / "usr" / "local"
    (local / "bin").mkdir(parents=True, exist_ok=True)
    (local / "lib").mkdir(parents=True, exist_ok=True)
    shutil.copy2(prefix / "bin" / "python3.11", local / "bin" / "python3.11")
    for name in ("python3", "python"):
        os.symlink("python3.11", local / "bin" / name)
    for lib in ("libpython3.11.so.1.0", "libpython3.so"):
        if (prefix / "lib" / lib).exists():
            shutil.copy2(prefix / "lib" / lib, local / "lib" / lib)
    os.symlink("libpython3.11.so.1.0", local / "lib" / "libpython3.11.so")
    stdlib, target = prefix / "lib" / "python3.11", local / "lib" / "python3.11"
    shutil.copytree(stdlib, target, symlinks=True, ignore=lambda d, names: [
        n for n in names if n in _SKIP_STDLIB or n.startswith("_tkinter")])
    (target / "site-packages").mkdir()
    for entry in sorted((stdlib / "site-packages").iterdir()):
        if entry.name.startswith(_KEEP_SITE) and "__pycache__" not in entry.name:
            copy = shutil.copytree if entry.is_dir() else shutil.copy2
            copy(entry, target / "site-packages" / entry.name)
    shutil.copytree(prefix / "include" / "python3.11", local / "include" / "python3.11")
    for name in ("pip", "pip3", "pip3.11"):
        script = local / "bin" / name
        script.write_text("#!/usr/local/bin/python3.11\nimport sys\n"
                          "from pip._internal.cli.main import main\nsys.exit(main())\n")
        script.chmod(0o755)


def _host_reach(root: Path) -> None:
    shutil.copy2("/etc/ssl/certs/ca-certificates.crt", root / "etc" / "ssl" / "certs" / "ca-certificates.crt")
    if os.path.exists("/etc/pip.conf"):
        shutil.copy2("/etc/pip.conf", root / "etc" / "pip.conf")
    for path in glob.glob("/etc/apt/sources.list.d/*.sources") + glob.glob("/etc/apt/sources.list"):
        shutil.copy2(path, root / path.lstrip("/"))


def build(tag: str = TAG, log: Path | None = None) -> str:
    """Build the stand-in and tag it ``tag``; returns the image id."""
    for tool in ("debootstrap", "docker", "dpkg", "ldd"):
        if shutil.which(tool) is None:
            raise StandInError(f"{tool} is not installed")
    prefix = host_python()
    packages = library_packages(prefix) + ["ca-certificates", "netbase", "tzdata"]
    version = subprocess.run([str(prefix / "bin" / "python3.11"), "-c",
                              "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="standin-") as tmp:
        root = Path(tmp) / "rootfs"
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                            SUITE, str(root), debian_mirror()], stdout=out, stderr=out, check=True,
                           timeout=1200)
        except subprocess.CalledProcessError as exc:
            raise StandInError(f"debootstrap failed (exit {exc.returncode}; see {log})") from None
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        _copy_python(prefix, root)
        _host_reach(root)
        subprocess.run(["chroot", str(root), "ldconfig"], check=True)
        shutil.rmtree(root / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        (root / "var" / "lib" / "apt" / "lists" / "partial").mkdir(parents=True)
        for deb in glob.glob(str(root / "var" / "cache" / "apt" / "archives" / "*.deb")):
            os.unlink(deb)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            ["docker", "import",
             "--change", "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
             "--change", "ENV LANG=C.UTF-8", "--change", f"ENV PYTHON_VERSION={version}",
             "--change", f"LABEL {LABEL}=true", "--change", 'CMD ["python3"]', "-", tag],
            stdin=tar.stdout, capture_output=True, text=True, check=False, timeout=600)
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0:
            raise StandInError(f"docker import failed: {imported.stderr.strip()}")
    return imported.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=TAG)
    args = parser.parse_args()
    print(build(args.tag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
